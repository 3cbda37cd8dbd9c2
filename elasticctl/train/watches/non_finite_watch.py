"""One worker's part in catching non-finite steps: its own values checked before they are spread,
the exchange on a non-finite step, the event naming the ranks that produced them, and, with
``--skip-non-finite 1``, the step skipped on every rank (the why of each, and the rule:
:mod:`elasticctl.train.watches.non_finite`).

The runtime owns one watch per run: its :meth:`NonFiniteWatch.bucket_observer` in the DDP
communication hook of each model it wraps (:mod:`elasticctl.train.watches.ddp_hooks`: this worker's own
gradients, before the all-reduce),
:meth:`new_generation` when a generation forms, and :meth:`before_step` in ``State.commit``,
after the backward and before the optimizer step, whose answer says whether to apply it.

Cost on a healthy step: a min/max pass over each gradient bucket before its all-reduce and a
maximum over the gradients applied after it (on their device, in a few foreach kernels whatever
the number of parameters; one read brought to the host per step); a
sharded model adds one all-reduce of one integer on the control group. A non-finite step adds one
all-gather of two integers per worker. Off (every call a no-op) outside elasticctl's handler and
with a GradScaler in the state: mixed precision's scaler already skips such steps and lowers its
scale, and its first steps are expected to overflow; and with ``--check-non-finite 0``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elasticctl.job.records import EventKind
from elasticctl.job.settings import NonFiniteSettings
from elasticctl.train.watches.non_finite import (
    NonFinite,
    RankFindings,
    finite_flag,
    gradients_norm,
    judge_non_finite,
    read_flags,
    starts_a_run,
)
from elasticctl.train.groups.roster import Roster
from elasticctl.train.watches.verdicts import Verdicts

log = logging.getLogger(__name__)


class NonFiniteWatch:
    """The non-finite checks of this worker's run."""

    def __init__(self, settings: NonFiniteSettings | None, worker: str, node: str, *, enabled: bool,
                 control_group: Callable[[], Any],
                 roster: Callable[[Any, Any, str], list[str]] | None = None) -> None:
        self.settings = settings
        self.enabled = enabled and settings is not None and bool(settings.check)
        self.worker, self.node = worker, node
        # the generation's roster, shared with the other watches (groups/roster.py)
        self._roster = roster or Roster(node, worker).nodes
        self._control_group = control_group  # the current generation's (None: torch's default)
        self.verdicts = Verdicts()  # what it concludes: the reporter acts on them (watches/verdicts.py)
        self._bucket_flags: list[torch.Tensor] = []  # this step's: each bucket finite before its all-reduce
        self._rank_nodes: list[str] | None = None    # the node of each rank ([]: a peer sent a bad id)
        self.last_non_finite: int | None = None      # the newest non-finite step of this run
        self._last_loss_only: int | None = None      # the newest step whose loss alone was not finite
        self.non_finite_steps = 0                    # how many, in this process

    @property
    def skip(self) -> bool:
        return bool(self.settings is not None and self.settings.skip)

    def bucket_observer(self) -> Callable[[torch.Tensor], None] | None:
        """What the DDP communication hook calls on each bucket (:mod:`elasticctl.train.watches.ddp_hooks`):
        note whether this worker's own gradients are finite before the all-reduce (None: off)."""
        return self._note_bucket if self.enabled else None

    def _note_bucket(self, buffer: torch.Tensor) -> None:
        self._bucket_flags.append(finite_flag(buffer))

    def new_generation(self) -> None:
        """The members, and so the ranks' nodes, changed."""
        self._rank_nodes = None
        self._bucket_flags = []

    def before_step(self, group: Any, step: int, loss: float | None, parameters: Any, *, sharded: bool) -> bool:
        """Whether to apply ``step``'s gradients (False only with ``--skip-non-finite 1`` on a
        non-finite step: the same answer on every worker of the generation)."""
        own_flags, self._bucket_flags = self._bucket_flags, []
        if not self.enabled:
            return True
        loss_finite = _finite(loss)
        finite, own_gradients = read_flags(gradients_norm(parameters), own_flags)
        if group.world_size == 1 and own_gradients is None:
            own_gradients = finite  # nothing is reduced: the gradients applied are this worker's own
        if sharded and group.world_size > 1:
            # Each worker holds other shards of the gradients: agree, so that every one decides alike.
            flag = torch.tensor([int(finite)], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._control_group())
            finite = bool(flag.item())
        if finite:
            if loss_finite is False and starts_a_run(step, self._last_loss_only):
                # its gradients are finite, so no other worker can know: its own word, once per run
                log.warning("[%s] the loss of step %d is not finite on this worker (rank %d), its gradients are",
                            self.worker, step, group.rank)
                self.verdicts.record(EventKind.NON_FINITE, step=step, world_size=group.world_size,
                             reason=f"rank {group.rank}'s loss was not finite, its gradients were (the step was "
                                    "applied)")
            if loss_finite is False:
                self._last_loss_only = step
            return True
        found = self._exchange(group, step, RankFindings(loss_finite, own_gradients))
        self.non_finite_steps += 1
        first = starts_a_run(step, self.last_non_finite)
        self.last_non_finite = step
        if first:
            self._report(group, found)
        return not self.skip

    def _exchange(self, group: Any, step: int, mine: RankFindings) -> NonFinite:
        """Every worker's own findings, and once per generation its node, to every worker."""
        if group.world_size == 1:
            return judge_non_finite(step, [mine])
        control_group = self._control_group()
        if self._rank_nodes is None:
            self._rank_nodes = self._roster(group, control_group, "non-finite steps name no node")
        sent = torch.tensor(mine.encode(), dtype=torch.int64)
        gathered = [torch.empty_like(sent) for _ in range(group.world_size)]
        dist.all_gather(gathered, sent, group=control_group)
        return judge_non_finite(step, [RankFindings.decode(t.tolist()) for t in gathered])

    def _report(self, group: Any, found: NonFinite) -> None:
        """Every worker logs the first step of a run of non-finite steps; rank 0 records an event per
        node that produced them (or one of the job's, when no rank can be named)."""
        action = "skipped on every rank (--skip-non-finite)" if self.skip else "applied (--skip-non-finite 0)"
        nodes = self._rank_nodes if group.world_size > 1 else [self.node]
        named = [rank for rank in found.ranks if nodes and rank < len(nodes)]
        log.error("[%s] step %d's gradients are not finite; %s; the step was %s", self.worker, found.step,
                  ", ".join(f"rank {rank} produced its {found.what(rank)}" for rank in named)
                  or "no rank's own values were non-finite before the all-reduce", action)
        if group.rank != 0:
            return
        by_node: dict[str, list[int]] = {}
        for rank in named:
            by_node.setdefault(nodes[rank], []).append(rank)
        for node, ranks in by_node.items():
            produced = ", ".join(f"rank {rank}'s {found.what(rank)}" for rank in ranks)
            self.verdicts.record(EventKind.NON_FINITE, node=node, step=found.step, world_size=group.world_size,
                         reason=f"{produced} were not finite before the all-reduce; the step was {action}")
        if not by_node:
            self.verdicts.record(EventKind.NON_FINITE, node="", step=found.step, world_size=group.world_size,
                         reason="the gradients were not finite after the all-reduce and no rank's own values were "
                                "before it (a sum that overflowed, or a sharded model's reduce-scatter, where no "
                                f"rank looks); the step was {action}")


def _finite(loss: object) -> bool | None:
    """Whether the loss a script handed ``State.commit`` is finite (None: none given, or nothing
    that reads as one number: it only goes to ``status`` then)."""
    if loss is None:
        return None
    try:
        return math.isfinite(float(loss))
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of more than one element
        return None
