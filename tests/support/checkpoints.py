"""Model states and planted files for the checkpoint tests."""

from __future__ import annotations

import hashlib
import json

import torch
from torch import nn

from elasticctl.train.checkpoints import sharded as sharded_checkpoint
from elasticctl.train.sampler import ResumableSampler


def make_state(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    sampler = ResumableSampler(range(100), num_replicas=1, rank=0)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    scheduler.step()
    sampler.advance(30)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler}


class CreatesAFile:
    """Pickles to a call of open(path, "w"): unpickling it unrestricted creates ``path``."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def sharded_state(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def write_manifest(directory) -> None:
    """A valid manifest for what the directory holds now, as anyone with write access can make."""
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
             for p in directory.iterdir() if p.name != sharded_checkpoint.MANIFEST}
    (directory / sharded_checkpoint.MANIFEST).write_text(
        json.dumps({"format": sharded_checkpoint.MANIFEST_FORMAT, "files": files}))
