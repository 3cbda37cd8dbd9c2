"""Who sends the state when a generation forms: a pure decision over the steps the members report.

Every member of a new generation reports its step (-1: it holds no state, a newcomer or a
restarted worker). When they differ, the members that hold the newest state send it to the
others (:mod:`elasticctl.train.transfer`), in buckets dealt round-robin over those holders
(:func:`plan_buckets`, :func:`bucket_owners`), so that a joiner's receive is spread over the
survivors.
Who counts as a member of the previous generation is agreed from the reports too, never from
each worker's own view of etcd (views differ: a worker sealed out of a generation, or frozen
through it, still remembers the one before): every member reports the generation in which its
state was last made one with its peers', and the previous generation's members are those that
report the newest such generation (:func:`previous_members`). A node that was sealed out (lost,
frozen) and returns is a newcomer to the generation it returns to: the survivors that trained on
without it keep their steps, and nothing rolls the job back past them.

A member's report is its own word: a process that could write etcd and got itself
admitted (no job secret) could claim any step and have every real worker load its
weights. So the sender is chosen among the members that were in the previous generation
when any of them holds state (they trained together, step by step), and a member that
claims to be far ahead of the others it trained with is not believed: members of one
generation are at most one step apart (the step in flight when it ended). Several senders
are used only when they are such members: replicas that trained together are bit-identical at
one step, and mixing the parts of two states that are not would make every receiver differ
from both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

MAX_STEP_LEAD = 1  # steps a member of the previous generation may be ahead of its peers' median
MAX_SHARDS = 2**20  # a reported shard count above this is not believed


def previous_members(in_sync: Sequence[int], generation: int) -> list[bool]:
    """Which members of generation ``generation`` were members of the previous one, by rank, from
    ``in_sync[rank]``: the generation in which that member's state was last made one with its
    peers' (-1: never, a newcomer or a restarted worker). They are the members that report the
    newest such generation: they trained together until this one formed. A report of this
    generation or a later one cannot be true (the state is synced after the generation forms)
    and counts as none."""
    believable = [number if 0 <= number < generation else -1 for number in in_sync]
    newest = max(believable, default=-1)
    return [newest >= 0 and number == newest for number in believable]


@dataclasses.dataclass(frozen=True)
class SyncPlan:
    """What the members of a new generation do before they train."""

    sources: tuple[int, ...] = ()     # the ranks that send their state, the lead first (empty: nobody needs to)
    from_checkpoint: bool = False     # nobody holds state: everyone restores the newest checkpoint
    refused: tuple[int, ...] = ()     # ranks whose reported step was not believed

    @property
    def source(self) -> int | None:
        """The lead sender: it describes the state (its structure and small values); None: no transfer."""
        return self.sources[0] if self.sources else None


def plan_state_sync(steps: Sequence[int], survivors: Sequence[bool],
                    max_lead: int = MAX_STEP_LEAD) -> SyncPlan:
    """The plan for members reporting ``steps`` (by rank); ``survivors[rank]``: that member was in
    the previous generation."""
    holders = [rank for rank, step in enumerate(steps) if step >= 0]
    if not holders:
        return SyncPlan(from_checkpoint=True)
    from_survivors = any(survivors[rank] for rank in holders)
    trusted = [rank for rank in holders if survivors[rank]] if from_survivors else holders
    ordered = sorted(steps[rank] for rank in trusted)
    reference = ordered[(len(ordered) - 1) // 2]  # the lower median: one liar among two loses
    refused = tuple(rank for rank in trusted if steps[rank] > reference + max_lead)
    eligible = [rank for rank in trusted if rank not in refused]
    best = max(steps[rank] for rank in eligible)
    if all(step == best for step in steps):
        return SyncPlan(refused=refused)
    newest = sorted(rank for rank in eligible if steps[rank] == best)
    return SyncPlan(sources=tuple(newest) if from_survivors else (newest[0],), refused=refused)


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + count)`` of tensor number ``tensor`` (in the flattened state)."""

    tensor: int
    start: int
    count: int


@dataclasses.dataclass(frozen=True)
class Bucket:
    """What one message carries: pieces of tensors of one dtype, at most the bucket size in bytes."""

    dtype: str
    pieces: tuple[Piece, ...]
    nbytes: int


def plan_buckets(tensors: Sequence[tuple[str, int, int]], bucket_bytes: int,
                 pack_below: int | None = None) -> list[Bucket]:
    """The buckets that carry ``tensors`` (each ``(dtype, element count, bytes per element)``, in the
    order both sides agree on), each at most ``bucket_bytes`` (at least one element).

    A tensor of at least ``pack_below`` bytes (default: the bucket size) travels alone, cut into
    bucket-sized pieces if it is larger: such buckets go out of and into the tensors themselves,
    with no copy on either side. Smaller tensors are packed, per dtype, into shared buckets (one
    copy on each side, but one message for many tensors); a packed bucket is closed when the next
    small tensor of its dtype would overflow it, and the ones still open come last. Empty tensors
    carry nothing and get no piece."""
    pack_below = bucket_bytes if pack_below is None else min(pack_below, bucket_bytes)
    buckets: list[Bucket] = []
    packing: dict[str, tuple[list[Piece], int]] = {}  # per dtype: the open bucket's pieces and bytes

    def close(dtype: str) -> None:
        pieces, used = packing.pop(dtype)
        buckets.append(Bucket(dtype, tuple(pieces), used))

    for index, (dtype, count, itemsize) in enumerate(tensors):
        nbytes = count * itemsize
        if count == 0:
            continue
        if nbytes >= pack_below:
            per_bucket = max(1, bucket_bytes // itemsize)
            for start in range(0, count, per_bucket):
                piece = Piece(index, start, min(per_bucket, count - start))
                buckets.append(Bucket(dtype, (piece,), piece.count * itemsize))
            continue
        if dtype in packing and packing[dtype][1] + nbytes > bucket_bytes:
            close(dtype)
        pieces, used = packing.get(dtype, ([], 0))
        packing[dtype] = ([*pieces, Piece(index, 0, count)], used + nbytes)
    for dtype in list(packing):
        close(dtype)
    return buckets


def bucket_owners(buckets: int, senders: Sequence[int]) -> list[int]:
    """Which sender sends each of ``buckets`` buckets: round-robin, the lead first."""
    if not senders:
        raise ValueError("A transfer needs at least one sender.")
    return [senders[index % len(senders)] for index in range(buckets)]


@dataclasses.dataclass(frozen=True)
class ShardTransfer:
    """One shard index's transfer: ``sources`` (ranks, the lead first) send it to the other ``members``."""

    shard: int
    members: tuple[int, ...]  # every rank holding this shard index, in rank order
    sources: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class HeldShard:
    """A whole shard a member holds in memory besides its live state, as it reports it (peer copies,
    :mod:`elasticctl.train.peer_copies`): its own snapshot, or the copy its buddy sent it."""

    generation: int  # the generation whose mesh the shard belongs to
    count: int       # the shard count of that mesh
    shard: int       # the shard's index in it
    step: int        # the step it is of
    layout: int      # the fingerprint of the state's tensors (paths, dtypes, global shapes)
    own: bool        # the member's own shard (a snapshot), not a buddy's copy


@dataclasses.dataclass(frozen=True)
class PeerCopyRestore:
    """Every member goes back to ``step`` from the shards of ``generation``'s mesh held in memory,
    resharded to the new mesh: old shard ``i`` is sent by rank ``sources[i]``."""

    generation: int
    count: int
    step: int
    layout: int
    sources: tuple[int, ...]      # by old shard index, the rank that holds it (its owner first)
    from_copies: tuple[int, ...]  # the old shard indexes only a buddy's copy had (their owner is gone)
    newcomers: tuple[int, ...] = ()  # members that were not in that mesh: the lead describes the state to them
    lead: int = 0                 # the lowest rank holding its own snapshot of that step

@dataclasses.dataclass(frozen=True)
class ShardSyncPlan:
    """What the members of a new generation do before they train, when the state is sharded."""

    transfers: tuple[ShardTransfer, ...] = ()  # the shard indexes that need one
    from_checkpoint: bool = False  # everyone restores the newest checkpoint
    missing: tuple[int, ...] = ()  # shard indexes with no holder at the newest step (why no replica sync)
    refused: tuple[int, ...] = ()
    step: int | None = None        # the step the replicas (or the peer copies) hold (None: no transfer)
    peer_copies: PeerCopyRestore | None = None  # everyone restores from the shards held in memory


def plan_shard_sync(steps: Sequence[int], shards: Sequence[int], survivors: Sequence[bool],
                    max_lead: int = MAX_STEP_LEAD, held: Sequence[Sequence[HeldShard]] = ()) -> ShardSyncPlan:
    """The plan for members reporting ``steps`` and holding shard index ``shards[rank]``; the trust
    rules are :func:`plan_state_sync`'s. The newest step is the same for every shard index: the
    holders of a shard at that step send it to its other members; a holder at an older step, or
    one not trusted, receives; a shard index without a holder at that step sends nothing (mixing
    steps would make the shards of no one state).

    Where the live shards cannot make one state, the cheapest other source, for every member at
    once: the shards held in memory (``held[rank]``, peer copies: :func:`plan_peer_copy_restore`),
    every member going back to their step; else the newest checkpoint. So, per shard, a live
    replica beats a buddy's copy, which beats the checkpoint."""
    plan = _plan_live_shards(steps, shards, survivors, max_lead)
    if not plan.from_checkpoint or not held:
        return plan
    copies = plan_peer_copy_restore(held, survivors)
    if copies is None:
        return plan
    return dataclasses.replace(plan, from_checkpoint=False, step=copies.step, peer_copies=copies)


def plan_peer_copy_restore(held: Sequence[Sequence[HeldShard]], survivors: Sequence[bool]) -> PeerCopyRestore | None:
    """Which step every member goes back to, and who sends each shard of the mesh it was trained
    on, from the shards the members hold in memory (``held[rank]``); None: they cannot make one
    whole state (the newest checkpoint then).

    Only the previous generation's members (``survivors``) are believed. A candidate is one mesh at
    one step (generation, shard count, layout, step): usable when every such member holds its own
    snapshot of it (each a different shard index: the proof it trained there, and the rest of the
    state besides the shards) and every shard index of that mesh is held by someone, its owner or
    a buddy. The newest usable step wins (then the newest generation). The others (newcomers) hold
    nothing and receive their shards, and the rest of the state from the lead. Reports out of range
    are ignored."""
    if not held or len(held) != len(survivors) or not any(survivors):
        return None
    candidates: dict[tuple[int, int, int, int], list[tuple[int, HeldShard]]] = {}
    for rank, shards_held in enumerate(held):
        if not survivors[rank]:
            continue
        for entry in shards_held:
            if not (0 < entry.count <= MAX_SHARDS and 0 <= entry.shard < entry.count and entry.step >= 0
                    and entry.generation >= 0):
                continue
            key = (entry.generation, entry.count, entry.layout, entry.step)
            candidates.setdefault(key, []).append((rank, entry))
    best: PeerCopyRestore | None = None
    survivor_count = sum(1 for survivor in survivors if survivor)
    for (generation, count, layout, step), entries in candidates.items():
        owners = {rank: entry.shard for rank, entry in entries if entry.own}
        if len(owners) != survivor_count or len(set(owners.values())) != len(owners):
            continue
        sources, from_copies = [], []
        for shard in range(count):
            own = sorted(rank for rank, index in owners.items() if index == shard)
            copy = sorted(rank for rank, entry in entries if not entry.own and entry.shard == shard)
            if not own and not copy:
                break
            sources.append((own or copy)[0])
            if not own:
                from_copies.append(shard)
        else:
            newcomers = tuple(rank for rank, survivor in enumerate(survivors) if not survivor)
            candidate = PeerCopyRestore(generation, count, step, layout, tuple(sources), tuple(from_copies),
                                        newcomers, min(owners))
            if best is None or (step, generation) > (best.step, best.generation):
                best = candidate
    return best


def _plan_live_shards(steps: Sequence[int], shards: Sequence[int], survivors: Sequence[bool],
                      max_lead: int) -> ShardSyncPlan:
    """:func:`plan_shard_sync` from the members' live shards alone.

    The step taken is the newest one at which every shard index has a trusted holder: a peer lost
    mid-step can leave one shard index a step ahead of another (its replicas' all-reduce went
    through, the other's did not), and a shard a step ahead cannot be combined with the rest. The
    holders a step ahead then receive the older shard like any other member: the step that did not
    reach every shard is trained again. Where no step has every shard, the missing ones are those
    of the newest step."""
    overall = plan_state_sync(steps, survivors, max_lead)
    if overall.source is None:
        return ShardSyncPlan(from_checkpoint=overall.from_checkpoint, refused=overall.refused)
    from_survivors = survivors[overall.source]
    eligible = [rank for rank, step in enumerate(steps)
                if step >= 0 and rank not in overall.refused and (survivors[rank] or not from_survivors)]
    indices = sorted(set(shards))
    newest = steps[overall.source]
    best, missing = newest, []
    for candidate in sorted({steps[rank] for rank in eligible}, reverse=True):
        held = {shards[rank] for rank in eligible if steps[rank] == candidate}
        absent = [shard for shard in indices if shard not in held]
        if candidate == newest:
            missing = absent
        if not absent:
            best, missing = candidate, []
            break
    if missing:
        return ShardSyncPlan(from_checkpoint=True, missing=tuple(missing), refused=overall.refused)
    trusted = [rank for rank in eligible if steps[rank] == best]
    transfers = []
    for shard in indices:
        members = tuple(rank for rank in range(len(steps)) if shards[rank] == shard)
        holders = tuple(rank for rank in trusted if shards[rank] == shard)
        sources = holders if from_survivors else holders[:1]
        if set(sources) != set(members):
            transfers.append(ShardTransfer(shard, members, sources))
    return ShardSyncPlan(transfers=tuple(transfers), refused=overall.refused, step=best)
