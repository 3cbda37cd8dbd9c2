"""The flags of a step boundary: whether a membership change is pending and whether this worker
leaves, summed over the generation's control group, and when the sum is read
(:func:`elasticctl.train.worker.lifecycle.when_flags_agreed`: at once, at the next boundary, or alone).

It owns the flags in flight (one all-reduce at a time) and the stop request: the SIGTERM handler
sets it between any two bytecodes of the training thread, so it is read once per boundary, and
what the boundary sends is what it records having sent (:attr:`leaving_sent`: a worker that sent
"not leaving" while recording that it did would re-form while the others enter the final
checkpoint without it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elasticctl.job.options import RecoveryMode
from elasticctl.train.worker import lifecycle
from elasticctl.train.worker.boundary import Agreed


class StepBoundary:
    """The boundary flags of a worker in ``mode``; ``stop_requested()``: whether it was told to stop;
    ``after_stop_flag_read()`` is called right after
    each boundary reads the stop request (a seam for tests: a stop delivered there is one that
    boundary did not send)."""

    def __init__(self, mode: RecoveryMode, stop_requested: Callable[[], bool],
                 after_stop_flag_read: Callable[[], None] = lambda: None) -> None:
        self.mode = mode
        self._stop_requested = stop_requested  # told to stop (SIGTERM): the inbox's; acted on at an agreed boundary
        self._after_stop_flag_read = after_stop_flag_read
        self.leaving_sent = False    # stop_requested as this worker sent it with the last flags
        self._in_flight: tuple[torch.Tensor, Any, int] | None = None  # (the flags, torch's Work, world size)

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested()

    def new_generation(self) -> None:
        """Nothing of the last generation's flags is read in the next one."""
        self._in_flight = None

    def in_flight(self) -> Agreed | None:
        """The flags sent at the previous boundary, agreed on since (None: none in flight)."""
        if self._in_flight is None:
            return None
        flags, work, world_size = self._in_flight
        work.wait()
        self._in_flight = None
        pending, leaving = (int(v) for v in flags.tolist())
        return Agreed(pending, leaving, world_size)

    def send(self, change_pending: bool, world_size: int, control_group: Any) -> Agreed | None:
        """This boundary's flags to every worker, agreed when the machine's rule says. CPU tensors
        on the control group: reading them never waits for a GPU. The sum, if it is agreed at
        this boundary (else None: it is read at the next one)."""
        leaving = self.leaving_sent = self.stop_requested  # read once
        self._after_stop_flag_read()
        when = lifecycle.when_flags_agreed(self.mode, world_size)
        if when is lifecycle.FlagsAgreed.ALONE:
            return Agreed(int(change_pending), int(leaving), 1)
        flags = torch.tensor([int(change_pending), int(leaving)], dtype=torch.int64)
        work = dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=control_group, async_op=True)
        self._in_flight = (flags, work, world_size)
        return self.in_flight() if when is lifecycle.FlagsAgreed.AT_THIS_BOUNDARY else None

    def drain(self) -> None:
        """Wait for the flags in flight (every rank done with its collectives before the end)."""
        if self._in_flight is not None:
            self._in_flight[1].wait()
