"""Non-finite values, attributed: the rule that names the ranks which produced a NaN or an infinity,
and the device-side checks it reads.

A NaN or an infinity made on one rank does not stay there: data-parallel training all-reduces the
gradients, so after the backward every rank holds the bad value and nothing says where it came from
(a bad sample, an overflowing layer, or a device that computes wrong numbers). So each worker
checks its **own** values before they are spread:

* its loss (the value the script hands ``State.commit``);
* its own gradients, bucket by bucket in DDP's communication hook, *before* the all-reduce
  (:func:`finite_flag` on each bucket; the default DDP wrap of ``elasticctl.train.run``).

After the backward each worker checks the gradients it will apply. Under DDP they are the
all-reduced ones, identical on every rank, so every rank finds a non-finite step at the same step
and no collective is needed on a healthy step. A sharded model's gradients are shards, different
on each rank: one small all-reduce per step makes the finding the same everywhere
(:mod:`elasticctl.train.watches.non_finite_watch`).

On a non-finite step the workers all-gather their own findings (two small integers each) and
:func:`judge_non_finite` names the ranks that produced the values: those whose loss, or whose own
gradients before the all-reduce, were not finite. None of them means the values arose in the
reduction itself (finite gradients whose sum overflows) or where no rank could look (a sharded
model's reduce-scatter, a wrap of the script's own).

The rule and the report's decoding are pure and table-tested; what a worker does with a finding
(the event, skipping the step) is the watch's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import torch

# One worker's own findings as it sends them (two int64: loss, gradients), each one of:
FINITE, NOT_FINITE, UNKNOWN = 1, 0, -1  # UNKNOWN: not checked (no loss given, no hook on the wrap)


@dataclasses.dataclass(frozen=True)
class RankFindings:
    """One rank's own values, before the all-reduce: finite (True), not (False), or not checked (None)."""

    loss: bool | None
    gradients: bool | None

    def encode(self) -> tuple[int, int]:
        return (_encode(self.loss), _encode(self.gradients))

    @classmethod
    def decode(cls, values: Sequence[object]) -> RankFindings:
        """A peer's two integers (untrusted): anything but the three known values reads as not checked."""
        if len(values) != 2:
            return cls(None, None)
        return cls(_decode(values[0]), _decode(values[1]))


def _encode(finite: bool | None) -> int:
    return UNKNOWN if finite is None else FINITE if finite else NOT_FINITE


def _decode(value: object) -> bool | None:
    if type(value) is not int:
        return None
    return {FINITE: True, NOT_FINITE: False}.get(value)


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """A step whose values were not finite, and the ranks that produced them."""

    step: int
    loss_ranks: tuple[int, ...] = ()      # ranks whose own loss was not finite
    gradient_ranks: tuple[int, ...] = ()  # ranks whose own gradients were not finite before the all-reduce

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank that produced a non-finite value (empty: none could be named)."""
        return tuple(sorted({*self.loss_ranks, *self.gradient_ranks}))

    def what(self, rank: int) -> str:
        """What ``rank`` produced, in words."""
        parts = [name for name, ranks in (("loss", self.loss_ranks), ("gradients", self.gradient_ranks))
                 if rank in ranks]
        return " and ".join(parts)


def judge_non_finite(step: int, reports: Sequence[RankFindings]) -> NonFinite:
    """Which ranks (their index in ``reports``) produced the non-finite values of ``step``."""
    return NonFinite(step, tuple(rank for rank, found in enumerate(reports) if found.loss is False),
                     tuple(rank for rank, found in enumerate(reports) if found.gradients is False))


def starts_a_run(step: int, last_non_finite: int | None) -> bool:
    """Whether the non-finite ``step`` is the first of a run of them (reported as an event), not
    the next of one: a model whose parameters became NaN stays NaN, and an event per step would
    bury the first, the one that names where it began. Every one is still counted."""
    return last_non_finite is None or step != last_non_finite + 1


# -- the checks, on the device ------------------------------------------------------------------

def finite_flag(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor on ``tensor``'s device: every element finite. No sync with the host, no
    temporary of the tensor's size: the minimum and maximum are NaN if any element is, and
    infinite if any element is."""
    if tensor.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    low, high = torch.aminmax(tensor.detach().reshape(-1))
    return torch.isfinite(low) & torch.isfinite(high)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this worker, else the tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def gradients_norm(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor | None:
    """The largest magnitude among the gradients this worker holds (a sharded model's: its local
    shards): a 0-d tensor on their device, NaN or infinite when any element is (None: no gradient).

    torch's foreach norm reads every gradient in a few kernels whatever the number of parameters;
    a check per parameter was four kernel launches each, the largest cost of a small model's step
    on a GPU. The infinity norm is a maximum: it never overflows where a sum of squares would."""
    gradients = [_local(p.grad).detach() for p in parameters if p.grad is not None]
    if not gradients:
        return None
    return torch.nn.utils.get_total_norm(gradients, math.inf)


def read_flags(applied: torch.Tensor | None, own: Sequence[torch.Tensor]) -> tuple[bool, bool | None]:
    """(whether the gradients to apply are finite, given their :func:`gradients_norm`; whether every
    one of this worker's own bucket flags is (None: none was taken)), brought to the host in one
    read: each read waits for the device to finish the step's work so far."""
    if applied is None and not own:
        return True, None
    device = applied.device if applied is not None else own[0].device
    first = torch.isfinite(applied) if applied is not None else torch.ones((), dtype=torch.bool, device=device)
    values = torch.stack([first, *(flag.to(device) for flag in own)]).tolist()
    return bool(values[0]), (all(values[1:]) if own else None)


def gradients_finite(parameters: Iterable[torch.nn.Parameter]) -> bool:
    """Whether every gradient this worker holds is finite (one read to the host)."""
    return read_flags(gradients_norm(parameters), ())[0]
