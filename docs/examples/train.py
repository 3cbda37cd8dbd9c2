"""The first example of docs/writing-a-trainer.md ("The shape of a trainer"), filled in.

Above the marker: only what the page leaves to the reader (the imports, a tiny model, its data,
the loss and the number of steps). Below it: the page's code block, as written
(tests/unit/test_docs.py checks they are the same; tests/process/test_guide_example.py runs this
file under `python`, `elasticctl up` in both recovery modes, and plain torchrun).
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


generator = torch.Generator().manual_seed(0)
dataset = TensorDataset(torch.randn(256, 8, generator=generator),
                        torch.randint(0, 2, (256,), generator=generator))
loss_fn = nn.CrossEntropyLoss()
steps = 6

# -- the page's code block --------------------------------------------------------------------
import elasticctl.train as elastic

model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
state = elastic.State(model, opt, sampler=elastic.ResumableSampler(dataset))

def train(state, group):                       # re-entered for every generation of workers
    while state.step < steps:
        if state.sampler.epoch_done:
            state.sampler.set_epoch(state.sampler.epoch + 1)
        for x, y in DataLoader(dataset, batch_size=32, sampler=state.sampler):
            loss = loss_fn(group.model(x), y)  # group.model: the model in DDP over this generation
            loss.backward()
            state.commit(samples=len(x), loss=loss.item())  # optimizer step; a step boundary
            if state.step >= steps:
                return

elastic.run(state, train, checkpoint_every=100)  # restore, checkpoints, progress, SIGTERM
