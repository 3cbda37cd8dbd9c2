"""How a framework's ``Trainer`` batches at each world size: the job's batch policy.

A restart at another world size changes the global batch (each worker's batch times the
workers) unless something holds it, and with it what the learning rate means. The policies are
those of ``elasticctl.train`` (:func:`elasticctl.train.script.plan_batches`), applied to what the
framework's script configured:

* ``"framework"`` (the default): the script's per-worker batch, its accumulation and its
  learning rate, as the framework has them; the global batch follows the world.
* ``"linear"``: the per-worker batch and the accumulation stay; the learning rate is the
  configured one times the world size (the configured one is one worker's; Goyal et al.).
* ``"constant-batch"``: the global batch stays (``global_batch``, else what the first start
  made) and so does the learning rate: each worker accumulates as many micro-batches of at most
  its configured batch as the world needs, rounded up where it does not divide.

:func:`plan` decides (pure); :class:`Batching` says what it decided, in one line that the
integrations print once per start, which under restart mode is once per resize;
:func:`rescale_lr` moves an optimizer's (and its schedulers') learning rates from the scale
they were saved at to the plan's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from elasticctl.errors import ConfigError
from elasticctl.train.script import LR_POLICIES, plan_batches

POLICIES = ("framework", *LR_POLICIES)


@dataclasses.dataclass(frozen=True)
class Batching:
    """What one start at ``world_size`` trains with."""

    policy: str
    world_size: int
    micro_batch: int  # samples per worker per forward/backward
    accumulation: int  # micro-batches per optimizer step
    lr_scale: float  # the factor on the learning rate the script configured
    asked: int | None = None  # constant-batch: the global batch it holds

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.world_size

    def describe(self) -> str:
        """One line: the policy, the global batch and how it is made, the learning rate."""
        workers = f"{self.world_size} worker{'s' if self.world_size != 1 else ''}"
        made = f"{self.micro_batch} per worker x {self.accumulation} accumulated x {workers}"
        rounded = (f", {self.asked} asked: rounded up to what {workers} make"
                   if self.asked is not None and self.asked != self.global_batch else "")
        lr = "the learning rate as configured" if self.lr_scale == 1 else \
            f"the learning rate x{self.lr_scale:g} (the configured one is one worker's)"
        return f"batch policy '{self.policy}': global batch {self.global_batch} ({made}{rounded}), {lr}"


def check_policy(policy: str, global_batch: int | None) -> None:
    """Raise a one-sentence :class:`ConfigError` for a policy or global batch a script gave wrong."""
    if policy not in POLICIES:
        raise ConfigError(f"The batch policy {policy!r} must be one of {', '.join(POLICIES)}.")
    if global_batch is not None and (isinstance(global_batch, bool) or not isinstance(global_batch, int)
                                     or global_batch < 1):
        raise ConfigError(f"The global batch ({global_batch!r}) must be a whole number of samples, at least 1.")
    if global_batch is not None and policy != "constant-batch":
        raise ConfigError(f"A global batch ({global_batch}) is held only by the batch policy 'constant-batch', "
                          f"not {policy!r}.")


def plan(policy: str, *, world_size: int, batch_size: int, accumulation: int,
         global_batch: int | None) -> Batching:
    """The batching of one start at ``world_size`` under ``policy``, from the script's
    ``batch_size`` per worker and its ``accumulation``. ``global_batch``: constant-batch's
    target; None there means what this start makes (a first start: it is then kept)."""
    check_policy(policy, global_batch)
    if world_size < 1 or batch_size < 1 or accumulation < 1:
        raise ConfigError(f"A world of {world_size} workers with batches of {batch_size} accumulated {accumulation} "
                          "times trains nothing: each must be at least 1.")
    if policy == "framework":
        return Batching(policy, world_size, batch_size, accumulation, 1.0)
    if policy == "linear":
        return Batching(policy, world_size, batch_size, accumulation, float(world_size))
    target = global_batch if global_batch is not None else batch_size * accumulation * world_size
    made = plan_batches("constant-batch", 1.0, batch_size, world_size, target)
    return Batching(policy, world_size, made.micro_batch, made.accumulation, 1.0, target)


def rescale_lr(optimizers: Iterable[Any], schedulers: Iterable[Any], factor: float) -> None:
    """Multiply the learning rates of ``optimizers`` (each group's ``lr``, and ``initial_lr``
    where a scheduler set it) and the base rates of ``schedulers`` by ``factor``: what a
    learning rate restored at one scale becomes at another."""
    if factor == 1:
        return
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for key in ("lr", "initial_lr"):
                if isinstance(group.get(key), (int, float)):
                    group[key] = group[key] * factor
    for scheduler in schedulers:
        if isinstance(getattr(scheduler, "base_lrs", None), list):
            scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]


def saved_scale(value: Any) -> float:
    """The LR scale a checkpoint says its learning rates carry (read from disk: untrusted); 1
    for a checkpoint that says none."""
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e9:
        raise ValueError(f"the learning-rate scale {value!r} is not a positive number")
    return float(value)


def saved_global_batch(value: Any) -> int | None:
    """The global batch a checkpoint says constant-batch holds (untrusted); None if it says none."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**40:
        raise ValueError(f"the global batch {value!r} is not a positive whole number")
    return value
