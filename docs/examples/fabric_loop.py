"""The Fabric loop of docs/lightning.md ("A loop of your own on Fabric, in hot mode"): Lightning
Fabric's tutorial form, its loop made the function elasticctl re-enters for every generation.

Below the marker: the page's code block, as written (the guide's unit tests check they are the
same; tests/process/test_frameworks.py runs this file under `elasticctl up --recovery hot` through
a node's SIGKILL and another's join).
"""

# -- the page's code block --------------------------------------------------------------------
import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import elasticctl.train as elastic
from elasticctl.integrations.fabric import Fabric, unwrapped  # was: from lightning.fabric import Fabric


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    x = torch.randn(512, 16, generator=torch.Generator().manual_seed(0))
    dataset = TensorDataset(x, x.sum(dim=1, keepdim=True))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    state = elastic.State(model, optimizer, sampler=elastic.ResumableSampler(dataset))

    def train(state, group):  # was: the loop at the top level; now re-entered for every generation
        fabric = Fabric(group)  # this generation's Fabric: its DDP on the generation's group
        model = fabric.setup(state.model)
        dataloader = DataLoader(dataset, batch_size=8, sampler=state.sampler)  # was: fabric.setup_dataloaders
        while state.sampler.epoch < args.epochs:
            for x, y in dataloader:
                loss = nn.functional.mse_loss(model(x), y)
                fabric.backward(loss)
                state.commit(samples=len(x), loss=loss.item())  # was: optimizer.step(); optimizer.zero_grad()
            state.sampler.set_epoch(state.sampler.epoch + 1)

    elastic.run(state, train, wrap=unwrapped, checkpoint_every=10)  # the model's DDP is Fabric's


if __name__ == "__main__":
    main()
