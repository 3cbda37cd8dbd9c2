"""The watches a worker runs at its step boundaries, behind one face: the stragglers
(:mod:`elasticctl.train.watches.straggler_watch`), the replica check
(:mod:`elasticctl.train.watches.replica_watch`) and non-finite gradients
(:mod:`elasticctl.train.watches.non_finite_watch`). Each watch's rule is pure and beside it; a
watch only concludes (:mod:`elasticctl.train.watches.verdicts`), and this supervisor hands every
verdict to the one reporter: an event for the job's history, or a node asked to leave."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from elasticctl.job.settings import WorkerSettings
from elasticctl.train.watches.non_finite_watch import NonFiniteWatch
from elasticctl.train.watches.replica_watch import ReplicaWatch
from elasticctl.train.watches.straggler_watch import StragglerWatch
from elasticctl.train.watches.verdicts import Eviction, Finding, Verdict


class Watches:
    """The watches of worker ``worker`` (node ``node``) under ``settings`` (None: not under
    elasticctl: none watches). ``record`` and ``request_leave``: the reporter's, which acts on
    their verdicts; ``roster``: the generation's node names, shared; ``control_group()``: the
    generation's group for their exchanges; ``replica_set()``: this worker's replica-set key for
    the replica check; ``non_finite``: the non-finite watch may run (not under a gradient scaler,
    which skips such steps itself)."""

    def __init__(self, settings: WorkerSettings | None, *, worker: str, node: str, record: Callable[..., None],
                 request_leave: Callable[[str], None], roster: Callable[[Any, Any, str], list[str]],
                 control_group: Callable[[], Any], replica_set: Callable[[], int | None], sharded: bool | str,
                 non_finite: bool) -> None:
        self._record = record
        self._request_leave = request_leave
        self.stragglers = StragglerWatch(None if settings is None else settings.stragglers, worker, node,
                                         control_group=control_group, roster=roster)
        self.replicas = ReplicaWatch(None if settings is None else settings.replicas, worker, node,
                                     control_group=control_group, replica_set=replica_set, sharded=sharded,
                                     roster=roster)
        self.non_finite = NonFiniteWatch(None if settings is None else settings.non_finite, worker, node,
                                         enabled=non_finite, control_group=control_group, roster=roster)

    def new_generation(self) -> None:
        self.stragglers.new_generation()
        self.replicas.new_generation()
        self.non_finite.new_generation()

    def bucket_observers(self) -> tuple[Callable[[torch.Tensor], None] | None, ...]:
        """What the default DDP's bucket hook calls (this worker's own part of a step; non-finite
        gradients as they are reduced)."""
        return (self.stragglers.bucket_observer(), self.non_finite.bucket_observer())

    def before_step(self, group: Any, step: int, loss: float | None, parameters: Any, *, sharded: bool) -> bool:
        """Whether the step is applied (a non-finite one is skipped where asked: the same answer on
        every worker)."""
        try:
            return self.non_finite.before_step(group, step, loss, parameters, sharded=sharded)
        finally:
            self._act_on(self.non_finite.verdicts.take())

    def step_done(self) -> None:
        """This worker's own part of the step ends (the straggler clock)."""
        self.stragglers.step_done()

    def at_boundary(self, group: Any, step: int, model: torch.nn.Module) -> None:
        """The exchanges due at this boundary: the step times, the replicas' checksums (before the
        checkpoint of the step, so that a diverged replica is named before it is saved). The
        verdicts are acted on even when the replica check stops the job (ReplicasDisagree)."""
        try:
            self.stragglers.at_boundary(group, step)
            self.replicas.at_boundary(group, step, model)
        finally:
            self._act_on(self.stragglers.verdicts.take() + self.replicas.verdicts.take())

    def next_step(self) -> None:
        self.stragglers.next_step()

    def _act_on(self, verdicts: list[Verdict]) -> None:
        for verdict in verdicts:
            if isinstance(verdict, Finding):
                self._record(verdict.kind, node=verdict.node, **verdict.fields)
            elif isinstance(verdict, Eviction):
                self._request_leave(verdict.node)
