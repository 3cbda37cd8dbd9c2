"""Bringing the members of a new generation to one training state (hot recovery), out of the runtime.

When a generation forms, :class:`GenerationStateSync` brings every member to the most advanced
state it can trust, through the recovery sources (:mod:`elasticctl.train.recovery`): the members
report what they hold (one all-gather on the training group), the pure chooser picks the plan of
the cheapest source that can make one state (the live replicas, then the shards held in memory,
then the checkpoint), and the source that made it carries it out.

What it takes is explicit: the state, where this worker's tensors live and where the runtime's
collectives' tensors travel from, the bucket size, the checkpoint restore, the script's event
callback and the worker's name (for the log); the sharded model when the state is sharded, and
its peer copies if it keeps them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elasticctl.train.sharding.buddy_copies import PeerCopies
from elasticctl.train.recovery.source import (
    Reports,
    Restoring,
    choose_plan,
    common_report,
    read_reports,
    trust,
)
from elasticctl.train.recovery.sources import recovery_sources
from elasticctl.train.sharding.shards import ShardedModel
from elasticctl.train.state import State

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)  # one worker's, compared by identity
class GenerationStateSync:
    """One worker's part in the state sync of each generation it joins (see the module docstring).

    ``restore_from_checkpoint(**event)``: the newest checkpoint into the state, its Restored (None:
    there is none), ``event``'s fields added to the ``state_restored`` the script hears;
    ``emit(kind, **fields)``: the script's ``on_event``."""

    state: State
    _: dataclasses.KW_ONLY
    device: torch.device
    transport: torch.device
    bucket_bytes: int
    restore_from_checkpoint: Callable[..., Any]
    emit: Callable[..., None]
    worker: str
    sharded: ShardedModel | None = None
    peer_copies: PeerCopies | None = None  # the shards held in memory (State(peer_copies=K)), or None
    # The generation in which this worker's state was last made one with its peers' (-1: never):
    # what it reports, so that the members agree on who trained together until now
    # (:func:`elasticctl.train.recovery.source.previous_members`).
    in_sync: int = -1
    # Whether every member of the generation last synced trained in the previous one together
    # (no newcomer): a DDP wrapped on a group reconfigured in place may then go on (the runtime's _ddp).
    continued: bool = False

    def sync_state(self, rank: int, world_size: int, generation: int) -> tuple[int, ...]:
        """Bring every member of ``generation`` to the most advanced state it can trust (a replicated
        state: the whole state from the replicas, else the checkpoint); the ranks that sent it (none:
        nothing was sent)."""
        if world_size == 1 and self.state.live:
            self.in_sync = generation
            self.continued = True  # alone: whatever its DDP did before, it agrees with itself
            return ()
        step = self.state.step if self.state.live else -1
        reports = self._gather(common_report(step, self.in_sync, step, None), world_size, generation)
        self.continued = all(reports.survivors)
        return self._recover(reports, rank, generation, "state")

    def rewrap(self, group: Any) -> None:
        """Shard the state over ``group``'s mesh as a new module (:class:`ShardedModel`); with peer copies,
        a snapshot of the live shards first (the re-wrap drops them where they no longer fit)."""
        if self.peer_copies is not None:
            self.peer_copies.before_rewrap(self.state, self.sharded)
        self.sharded.rewrap(self.state, group)
        if self.peer_copies is not None:
            self.peer_copies.wrapped(group.number)

    def sync_shards(self, rank: int, world_size: int, generation: int, held: int) -> tuple[int, ...]:
        """A sharded state's :meth:`sync_state`: per shard index, from the replicas that hold it at
        the newest step, over the mesh's replicate group; else the shards held in memory (peer
        copies), every member going back to their step; else the checkpoint. ``held``: the step
        this worker trained to before the re-wrap, whether or not its shards still fit (-1: none).
        The ranks that sent this worker's shard."""
        step = self.state.step if self.state.live else -1
        reports = self._gather(common_report(step, self.in_sync, held, self.sharded.position.index), world_size,
                               generation)
        return self._recover(reports, rank, generation, "shard")

    def _sources(self) -> list:
        return recovery_sources(self.peer_copies if self.sharded is not None else None)

    def _gather(self, common: list[int], world_size: int, generation: int) -> Reports:
        """Every member's report (the common part, then each source's fields), in one all-gather."""
        sources = self._sources()
        row = list(common)
        for source in sources:
            fields = list(source.report())
            if len(fields) != source.report_width:  # every member must send rows of one width
                raise ValueError(f"The recovery source {source.name} reported {len(fields)} fields, "
                                 f"not {source.report_width}.")
            row += fields
        mine = torch.tensor(row, dtype=torch.int64, device=self.transport)
        gathered = [torch.zeros_like(mine) for _ in range(world_size)]
        dist.all_gather(gathered, mine)
        return read_reports([[int(v) for v in report.tolist()] for report in gathered], generation,
                            [(source.name, source.report_width) for source in sources], self.sharded is not None)

    def _recover(self, reports: Reports, rank: int, generation: int, what: str) -> tuple[int, ...]:
        """The plan for ``reports`` carried out by the source that made it; ``what``: the log's word
        for what a refused member's report is not believed about."""
        for refused in trust(reports.steps, reports.survivors).refused:
            log.warning("[%s] rank %d reported step %d, far ahead of the members it trained with; "
                        "its %s is not taken", self.worker, refused, reports.steps[refused], what)
        source, plan = choose_plan(self._sources(), reports)
        restoring = Restoring(self.state, rank, self.device, self.transport, self.bucket_bytes,
                              self.restore_from_checkpoint, self.emit, self.worker, self.sharded)
        senders = source.restore(plan, reports, restoring)
        self.in_sync = generation
        return senders
