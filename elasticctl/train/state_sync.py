"""Bringing the members of a new generation to one training state (hot recovery), out of the runtime.

When a generation forms, :class:`GenerationStateSync` brings every member to the most advanced
state it can trust: the members report their steps (an all-gather on the training group), the
pure decisions of :mod:`elasticctl.train.sync` say who sends what, and the state moves in
buckets (:mod:`elasticctl.train.transfer`): the whole state for a replicated (DDP) model, per
shard index over the mesh's replicate group for a sharded one (:mod:`elasticctl.train.shards`).
Where nobody holds the state (the job's start, every worker lost) or a shard has no replica at
the newest step, every member restores the newest checkpoint instead, through the callable the
runtime hands in (it owns the checkpointer).

What it takes is explicit: the state, where this worker's tensors live and where the runtime's
collectives' tensors travel from, the bucket size, the checkpoint restore, the script's event
callback and the worker's name (for the log); the sharded model when the state is sharded.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from elasticctl.train.peer_copies import HELD_FIELDS, MAX_HELD_REPORTED, PeerCopies, decode_held, encode_held
from elasticctl.train.shards import LocalShards, ShardedModel
from elasticctl.train.state import State, StateError
from elasticctl.train.sync import plan_shard_sync, plan_state_sync, previous_members
from elasticctl.train.transfer import transfer_state

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
    # (:func:`elasticctl.train.sync.previous_members`).
    in_sync: int = -1
    # Whether every member of the generation last synced trained in the previous one together
    # (no newcomer): a DDP wrapped on a group reconfigured in place may then go on (the runtime's _ddp).
    continued: bool = False

    def sync_state(self, rank: int, world_size: int, generation: int) -> tuple[int, ...]:
        """Bring every member of ``generation`` to the most advanced state it can trust
        (:mod:`elasticctl.train.sync`); the ranks that sent it (none: nothing was sent)."""
        if world_size == 1 and self.state.live:
            self.in_sync = generation
            self.continued = True  # alone: whatever its DDP did before, it agrees with itself
            return ()
        mine = torch.tensor([self.state.step if self.state.live else -1, self.in_sync], dtype=torch.int64,
                            device=self.transport)
        reports = [torch.zeros_like(mine) for _ in range(world_size)]
        dist.all_gather(reports, mine)
        rows = [[int(v) for v in report.tolist()] for report in reports]
        steps = [row[0] for row in rows]
        survivors = previous_members([row[1] for row in rows], generation)
        self.continued = all(survivors)
        plan = plan_state_sync(steps, survivors)
        for refused in plan.refused:
            log.warning("[%s] rank %d reported step %d, far ahead of the members it trained with; "
                        "its state is not taken", self.worker, refused, steps[refused])
        if plan.from_checkpoint:  # nobody holds state: the job's start, or every worker was lost
            self.restore_from_checkpoint()
            self.in_sync = generation
            return ()
        if plan.source is None:
            self.in_sync = generation
            return ()
        moved = transfer_state(self.state, rank, plan.sources, device=self.device, transport=self.transport,
                               bucket_bytes=self.bucket_bytes)
        self.in_sync = generation
        log.info("[%s] state of step %d: %d bytes in %d buckets from rank(s) %s in %.3f s", self.worker,
                 self.state.step, moved.nbytes, moved.buckets, ", ".join(map(str, moved.senders)), moved.seconds)
        if rank not in moved.senders:
            self.emit("state_restored", step=self.state.step, source="replica", senders=list(moved.senders),
                      nbytes=moved.nbytes, seconds=round(moved.seconds, 4))
        return moved.senders

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
        the newest step (:func:`elasticctl.train.sync.plan_shard_sync`), over the mesh's replicate
        group; else the shards held in memory (peer copies), every member going back to their step;
        else the checkpoint. ``held``: the step this worker trained to before the re-wrap, whether
        or not its shards still fit (-1: none). The ranks that sent this worker's shard."""
        position = self.sharded.position
        report = [self.state.step if self.state.live else -1, position.index, held, self.in_sync]
        if self.peer_copies is not None:  # every member has them or none: the same script
            report += encode_held(self.peer_copies.held())
        mine = torch.tensor(report, dtype=torch.int64, device=self.transport)
        reports = [torch.zeros_like(mine) for _ in range(world_size)]
        dist.all_gather(reports, mine)
        rows = [[int(v) for v in report.tolist()] for report in reports]
        steps, shards, helds, in_sync = (tuple(row[field] for row in rows) for field in range(4))
        survivors = previous_members(in_sync, generation)
        in_memory = [decode_held(row[4:4 + HELD_FIELDS * MAX_HELD_REPORTED]) for row in rows]
        plan = plan_shard_sync(steps, shards, survivors, held=in_memory if self.peer_copies is not None else ())
        for refused in plan.refused:
            log.warning("[%s] rank %d reported step %d, far ahead of the members it trained with; "
                        "its shard is not taken", self.worker, refused, steps[refused])
        if plan.peer_copies is not None:
            self._restore_peer_copies(plan.peer_copies, rank, shards, max(helds))
            self.in_sync = generation
            return ()
        if plan.from_checkpoint:
            self._restore_lost_shards(plan.missing, max(helds))
            self.in_sync = generation
            return ()
        transfer = next((t for t in plan.transfers if t.shard == position.index), None)
        if transfer is None:
            self.in_sync = generation
            return ()
        replicas = self.sharded.replica_group()
        moved = transfer_state(LocalShards(self.state), dist.get_group_rank(replicas, rank),
                               [dist.get_group_rank(replicas, source) for source in transfer.sources],
                               device=self.device, transport=self.transport, bucket_bytes=self.bucket_bytes,
                               group=replicas)
        self.in_sync = generation
        senders = [dist.get_global_rank(replicas, sender) for sender in moved.senders]
        log.info("[%s] shard %d of step %d: %d bytes in %d buckets from rank(s) %s in %.3f s", self.worker,
                 position.index, self.state.step, moved.nbytes, moved.buckets, ", ".join(map(str, senders)),
                 moved.seconds)
        if rank not in senders:
            self.emit("state_restored", step=self.state.step, source="replica", shard=position.index,
                      senders=senders, nbytes=moved.nbytes, seconds=round(moved.seconds, 4))
        return tuple(senders)

    def _restore_peer_copies(self, plan: Any, rank: int, shards: Sequence[int], trained: int) -> None:
        """Every member back to the step of the newest whole set of shards held in memory, resharded
        to this generation's mesh (:meth:`elasticctl.train.peer_copies.PeerCopies.restore`)."""
        log.warning("[%s] the shards of the previous mesh (trained to step %d) go to the new one from memory, "
                    "at step %d (shard(s) %s from a buddy's copy)", self.worker, trained, plan.step,
                    ", ".join(map(str, plan.from_copies)) or "none")
        moved = self.peer_copies.restore(self.state, self.sharded, plan, rank, shards, device=self.device,
                                         transport=self.transport)
        log.info("[%s] shard %d of step %d from peer copies: %d bytes sent in %.3f s", self.worker,
                 self.sharded.position.index, self.state.step, moved["nbytes"], moved["seconds"])
        self.emit("state_restored", step=self.state.step, source="peer_copy", shard=self.sharded.position.index,
                  trained=trained, redone=max(0, trained - self.state.step), **moved)

    def _restore_lost_shards(self, missing: tuple[int, ...], trained: int) -> None:
        """No replica holds some shard, or no shard fits this generation's mesh (FSDP without
        replicas, resized), or nobody holds state (the job's start): every member restores the
        newest sharded checkpoint, resharded to this generation, in process. ``trained``: the
        newest step any member trained to (-1: none)."""
        if trained >= 0:
            log.warning("[%s] %s at step %d: restoring the newest checkpoint", self.worker,
                        f"shard(s) {', '.join(map(str, missing))} have no replica" if missing
                        else "no member's shards fit the new mesh", trained)
        restored = self.restore_from_checkpoint(shard=self.sharded.position.index, missing=list(missing))
        if restored is None and trained >= 0:
            raise StateError(f"The model's shards trained to step {trained} have no replica in this generation "
                             "and there is no checkpoint to restore them from: the training state is lost.")
