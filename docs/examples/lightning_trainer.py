"""The Lightning script of docs/lightning.md: Lightning's tutorial form, with elasticctl's
``Trainer`` imported instead of Lightning's (and its checkpoint interval).

Below the marker: the page's code block, as written (the guide's unit tests check they are the
same; tests/process/test_frameworks.py runs this file under `python` and under `elasticctl up`
through a node's SIGKILL and another's join).
"""

# -- the page's code block --------------------------------------------------------------------
import argparse

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from elasticctl.integrations.lightning import Trainer  # was: from lightning.pytorch import Trainer


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--batch-policy", default="framework")  # or linear, constant-batch
    args = parser.parse_args()

    x = torch.randn(512, 16, generator=torch.Generator().manual_seed(0))
    dataset = TensorDataset(x, x.sum(dim=1, keepdim=True))
    trainer = Trainer(max_epochs=args.max_epochs, checkpoint_every=10, enable_progress_bar=False,
                      batch_policy=args.batch_policy)
    trainer.fit(Regression(), DataLoader(dataset, batch_size=8, shuffle=True))


if __name__ == "__main__":
    main()
