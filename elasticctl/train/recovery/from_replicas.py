"""The replicas as a recovery source: the live state of the members that trained on.

When the members' steps differ, the believed holders of the newest state
(:func:`elasticctl.train.recovery.source.trust`) send it to the others
(:mod:`elasticctl.train.state_transfer.transfer`, in buckets dealt over several senders). Several senders are
used only when they are members of the previous generation: replicas that trained together are
bit-identical at one step, and mixing the parts of two states that are not would make every
receiver differ from both.

A replicated (DDP) state moves whole, over the training group (:func:`plan_whole_state`). A
sharded one moves per shard index, over the mesh's replicate group (:func:`plan_shards`): the
newest step must be one at which every shard index has a believed holder, since mixing steps
would make the shards of no one state; where none is, the replicas have no plan and a later
source takes over (peer copies, the checkpoint: :func:`unheld_shards` names the shards missing).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch.distributed as dist

from elasticctl.train.recovery.source import NothingToMove, Reports, Restoring, trust
from elasticctl.train.sharding.local_shards import LocalShards
from elasticctl.train.state_transfer.transfer import transfer_state

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ReplicaTransfer:
    """``sources`` (ranks, the lead first) send shard index ``shard`` (None: the whole, replicated
    state) to the other ``members``."""

    shard: int | None
    members: tuple[int, ...]  # every rank holding this shard index (the whole state: every rank), in rank order
    sources: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class FromReplicas:
    """Every member takes the state of step ``step`` from its replicas: one transfer per shard index that
    needs one (a replicated state: one, of every member)."""

    transfers: tuple[ReplicaTransfer, ...]
    step: int


def plan_whole_state(steps: Sequence[int], survivors: Sequence[bool]) -> FromReplicas | NothingToMove | None:
    """A replicated state's plan for members reporting ``steps`` (by rank); ``survivors[rank]``: that
    member was in the previous generation. None: nobody holds state."""
    believed = trust(steps, survivors)
    if not believed.holders:
        return None
    best = max(steps[rank] for rank in believed.holders)
    if all(step == best for step in steps):
        return NothingToMove()
    newest = sorted(rank for rank in believed.holders if steps[rank] == best)
    sources = tuple(newest) if believed.from_survivors else (newest[0],)
    return FromReplicas((ReplicaTransfer(None, tuple(range(len(steps))), sources),), best)


def _newest_whole_step(steps: Sequence[int], shards: Sequence[int], survivors: Sequence[bool],
                       ) -> tuple[int | None, tuple[int, ...]]:
    """The newest step at which every shard index has a believed holder (None: none, or nobody holds
    state), and the shard indexes without one at the newest step believed (empty when there is one).

    A peer lost mid-step can leave one shard index a step ahead of another (its replicas' all-reduce
    went through, the other's did not), and a shard a step ahead cannot be combined with the rest:
    the holders a step ahead then receive the older shard like any other member (the step that did
    not reach every shard is trained again)."""
    believed = trust(steps, survivors)
    if not believed.holders:
        return None, ()
    indices = sorted(set(shards))
    newest = max(steps[rank] for rank in believed.holders)
    missing: list[int] = []
    for candidate in sorted({steps[rank] for rank in believed.holders}, reverse=True):
        held = {shards[rank] for rank in believed.holders if steps[rank] == candidate}
        absent = [shard for shard in indices if shard not in held]
        if candidate == newest:
            missing = absent
        if not absent:
            return candidate, ()
    return None, tuple(missing)


def plan_shards(steps: Sequence[int], shards: Sequence[int], survivors: Sequence[bool],
                ) -> FromReplicas | NothingToMove | None:
    """A sharded state's plan for members reporting ``steps`` and holding shard index ``shards[rank]``:
    the believed holders of a shard at the newest step every shard has send it to its other members;
    a holder at an older step, or one not believed, receives. None: no step has every shard (or
    nobody holds state)."""
    if isinstance(plan_whole_state(steps, survivors), NothingToMove):
        return NothingToMove()
    best, _ = _newest_whole_step(steps, shards, survivors)
    if best is None:
        return None
    believed = trust(steps, survivors)
    holding = [rank for rank in believed.holders if steps[rank] == best]
    transfers = []
    for shard in sorted(set(shards)):
        members = tuple(rank for rank in range(len(steps)) if shards[rank] == shard)
        holders = tuple(rank for rank in holding if shards[rank] == shard)
        sources = holders if believed.from_survivors else holders[:1]
        if set(sources) != set(members):
            transfers.append(ReplicaTransfer(shard, members, sources))
    return FromReplicas(tuple(transfers), best) if transfers else NothingToMove()


def unheld_shards(reports: Reports) -> tuple[int, ...]:
    """The shard indexes no believed replica holds at the newest step, when no step has every shard
    (empty: a replicated state, nobody holds state, or the replicas have a plan)."""
    if reports.shards is None:
        return ()
    return _newest_whole_step(reports.steps, reports.shards, reports.survivors)[1]


class Replicas:
    """The live state of the members: the first source asked (the cheapest, and nothing is re-done)."""

    name = "replicas"
    report_width = 0  # the common part of the report (step, shard index) is all it needs

    def report(self) -> list[int]:
        return []

    def plan(self, reports: Reports) -> FromReplicas | NothingToMove | None:
        if reports.shards is None:
            return plan_whole_state(reports.steps, reports.survivors)
        return plan_shards(reports.steps, reports.shards, reports.survivors)

    def restore(self, plan: FromReplicas | NothingToMove, reports: Reports, restoring: Restoring) -> tuple[int, ...]:
        match plan:
            case NothingToMove():
                return ()
            case FromReplicas() if restoring.sharded is None:
                return self._whole_state(plan.transfers[0], restoring)
            case FromReplicas():
                return self._shard(plan, restoring)
        raise TypeError(f"The replicas cannot carry out {plan!r}.")

    @staticmethod
    def _whole_state(transfer: ReplicaTransfer, restoring: Restoring) -> tuple[int, ...]:
        state, rank = restoring.state, restoring.rank
        moved = transfer_state(state, rank, transfer.sources, device=restoring.device, transport=restoring.transport,
                               bucket_bytes=restoring.bucket_bytes)
        log.info("[%s] state of step %d: %d bytes in %d buckets from rank(s) %s in %.3f s", restoring.worker,
                 state.step, moved.nbytes, moved.buckets, ", ".join(map(str, moved.senders)), moved.seconds)
        if rank not in moved.senders:
            restoring.emit("state_restored", step=state.step, source="replica", senders=list(moved.senders),
                           nbytes=moved.nbytes, seconds=round(moved.seconds, 4))
        return moved.senders

    @staticmethod
    def _shard(plan: FromReplicas, restoring: Restoring) -> tuple[int, ...]:
        """This worker's shard index from its replicas, over the mesh's replicate group (every shard
        index's group at once)."""
        state, rank, index = restoring.state, restoring.rank, restoring.sharded.position.index
        transfer = next((t for t in plan.transfers if t.shard == index), None)
        if transfer is None:
            return ()
        # torch's map of a reconfigured group's members is kept true (reconfigure.keep_torch_bookkeeping)
        replicas = restoring.sharded.replica_group()
        moved = transfer_state(LocalShards(state), dist.get_group_rank(replicas, rank),
                               [dist.get_group_rank(replicas, source) for source in transfer.sources],
                               device=restoring.device, transport=restoring.transport,
                               bucket_bytes=restoring.bucket_bytes, group=replicas)
        senders = [dist.get_global_rank(replicas, sender) for sender in moved.senders]
        log.info("[%s] shard %d of step %d: %d bytes in %d buckets from rank(s) %s in %.3f s", restoring.worker,
                 index, state.step, moved.nbytes, moved.buckets, ", ".join(map(str, senders)), moved.seconds)
        if rank not in senders:
            restoring.emit("state_restored", step=state.step, source="replica", shard=index, senders=senders,
                           nbytes=moved.nbytes, seconds=round(moved.seconds, 4))
        return tuple(senders)
