"""What the hot-mode loops of the framework integrations share, and no framework: the wrap that
leaves the model to the framework's own DDP."""

from __future__ import annotations

import torch

from elasticctl.train.group import Group


def unwrapped(model: torch.nn.Module, group: Group) -> torch.nn.Module:
    """``elasticctl.train.run(..., wrap=unwrapped)``: the runtime leaves the model as it is, for
    the generation's Fabric or Accelerator to wrap in its own DDP on the generation's group."""
    return model
