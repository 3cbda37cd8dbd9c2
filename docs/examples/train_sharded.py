"""The sharded example of docs/writing-a-trainer.md ("Sharded models"), filled in.

Above the marker: what the page leaves to the reader (the imports, a model made of blocks, its
data, the loss, the number of steps, and the state and training function of the page's first
example). Below it: the page's code block, as written (the guide's unit tests check they are the
same; its process tests run this file under `python` and under `elasticctl up` in both recovery
modes).
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import elasticctl.train as elastic


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 16), nn.ReLU()), nn.Linear(16, 2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


generator = torch.Generator().manual_seed(0)
dataset = TensorDataset(torch.randn(256, 8, generator=generator),
                        torch.randint(0, 2, (256,), generator=generator))
loss_fn = nn.CrossEntropyLoss()
steps = 6

model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
state = elastic.State(model, opt, sampler=elastic.ResumableSampler(dataset))


def train(state, group):
    while state.step < steps:
        if state.sampler.epoch_done:
            state.sampler.set_epoch(state.sampler.epoch + 1)
        for x, y in DataLoader(dataset, batch_size=32, sampler=state.sampler):
            loss = loss_fn(group.model(x), y)
            loss.backward()
            state.commit(samples=len(x), loss=loss.item())
            if state.step >= steps:
                return


# -- the page's code block --------------------------------------------------------------------
from torch.distributed.fsdp import fully_shard

def shard(model, group):                       # called for each generation, on its workers
    mesh = elastic.hsdp_mesh(group)            # 2-D: replicate across nodes, shard within a node
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)

elastic.run(state, train, wrap=shard, sharded="hsdp")  # group.model / state.model: this generation's module
