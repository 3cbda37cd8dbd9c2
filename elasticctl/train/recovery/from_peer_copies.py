"""The peer copies as a recovery source: a sharded state's shards held in memory by their owners and
their buddies (``State(peer_copies=K)``, :mod:`elasticctl.train.sharding.buddy_copies` keeps them).

Asked when the live replicas cannot make one state (FSDP without replicas: every shard of the
old mesh moves when the world changes). Each member reports the shards it holds
(:class:`elasticctl.train.sharding.buddy_copies.HeldShard`: its own snapshots and its buddies' copies, up to
:data:`MAX_HELD_REPORTED`); :func:`plan_from_peer_copies` picks the newest step at which every
shard of one old mesh is held, and every member goes back to it (:func:`restore_from_copies`):
the old mesh's shards resharded to the new mesh in memory, each worker receiving the rows of its
new shard from the holders of the old shards that overlap them, point to point on the training
group, in pieces of at most the bucket size; a newcomer takes the rest of the state (step,
fields, sampler, optimizer hyperparameters and counters) from a description the lead broadcasts,
read with ``weights_only=True`` and checked against its own parameters.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from elasticctl.train.state_transfer.description import (
    DESCRIPTION_MAX_BYTES,
    DTYPE_NAMES,
    DTYPES,
    TensorSpec,
    describe_state,
    flatten,
    read_description,
    rebuild,
)
from elasticctl.train.sharding.buddy_copies import (
    HeldShard,
    PeerCopies,
    Snapshot,
    chunk_rows,
    reshard_pieces,
    row_splits,
)
from elasticctl.train.recovery.source import Reports, Restoring
from elasticctl.train.sharding.local_shards import LocalShards
from elasticctl.train.sharding.shards import ShardedModel
from elasticctl.train.state import State, StateError
from elasticctl.train.state_transfer.transfer import WINDOW

log = logging.getLogger(__name__)

MAX_SHARDS = 2**20       # a reported shard count above this is not believed
MAX_HELD_REPORTED = 8    # shards a member reports holding (own snapshots and copies)
HELD_FIELDS = 6          # per reported shard: generation, count, shard, step, layout, own


@dataclasses.dataclass(frozen=True)
class FromPeerCopies:
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


# -- the decisions (pure) --------------------------------------------------------------------

def encode_held(held: Sequence[HeldShard]) -> list[int]:
    """``held`` as the fixed-size row of integers a member reports (the first MAX_HELD_REPORTED)."""
    row = []
    for entry in list(held)[:MAX_HELD_REPORTED]:
        row += [entry.generation, entry.count, entry.shard, entry.step, entry.layout, int(entry.own)]
    return row + [-1] * (HELD_FIELDS * MAX_HELD_REPORTED - len(row))


def decode_held(row: Sequence[int]) -> list[HeldShard]:
    """A peer's report back (entries with a negative field are empty or not believed)."""
    held = []
    for first in range(0, min(len(row), HELD_FIELDS * MAX_HELD_REPORTED), HELD_FIELDS):
        generation, count, shard, step, layout, own = row[first:first + HELD_FIELDS]
        if min(generation, count, shard, step, layout) < 0 or own not in (0, 1):
            continue
        held.append(HeldShard(generation, count, shard, step, layout, bool(own)))
    return held


def plan_from_peer_copies(held: Sequence[Sequence[HeldShard]], survivors: Sequence[bool]) -> FromPeerCopies | None:
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
    best: FromPeerCopies | None = None
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
            candidate = FromPeerCopies(generation, count, step, layout, tuple(sources), tuple(from_copies),
                                        newcomers, min(owners))
            if best is None or (step, generation) > (best.step, best.generation):
                best = candidate
    return best


class PeerCopySource:
    """The shards held in memory (``copies``: this worker's :class:`PeerCopies`), asked after the live
    replicas; every member goes back to the step of the newest whole set."""

    name = "peer_copies"
    report_width = HELD_FIELDS * MAX_HELD_REPORTED

    def __init__(self, copies: PeerCopies | None) -> None:
        self.copies = copies  # None: only planning (a table test)

    def report(self) -> list[int]:
        return encode_held(self.copies.held())

    def plan(self, reports: Reports) -> FromPeerCopies | None:
        held = [decode_held(row) for row in reports.of(self.name)]
        return plan_from_peer_copies(held, reports.survivors) if held else None

    def restore(self, plan: FromPeerCopies, reports: Reports, restoring: Restoring) -> tuple[int, ...]:
        """Every member back to the step of the newest whole set of shards held in memory, resharded
        to this generation's mesh."""
        trained, index = max(reports.trained), restoring.sharded.position.index
        log.warning("[%s] the shards of the previous mesh (trained to step %d) go to the new one from memory, "
                    "at step %d (shard(s) %s from a buddy's copy)", restoring.worker, trained, plan.step,
                    ", ".join(map(str, plan.from_copies)) or "none")
        state = restoring.state
        moved = restore_from_copies(self.copies, state, restoring.sharded, plan, restoring.rank, reports.shards,
                                    device=restoring.device, transport=restoring.transport)
        log.info("[%s] shard %d of step %d from peer copies: %d bytes sent in %.3f s", restoring.worker, index,
                 state.step, moved["nbytes"], moved["seconds"])
        restoring.emit("state_restored", step=state.step, source="peer_copy", shard=index, trained=trained,
                       redone=max(0, trained - state.step), **moved)
        return ()


# -- restoring (every member, while the next generation forms) ---------------------------------

def restore_from_copies(held: PeerCopies, state: State, sharded: ShardedModel, plan: FromPeerCopies, rank: int,
                        shards: Sequence[int], *, device: torch.device, transport: torch.device) -> dict:
    """Every member's part in going back to ``plan.step``: the old mesh's shards (``held``'s), resharded to
    this generation's (``shards[rank]``: each member's new shard index), point to point on the
    training group; then this worker's state loaded from them. Returns what moved (for the event)."""
    began = time.perf_counter()
    own, copies = held.holding(plan.generation, plan.count, plan.layout, plan.step)
    if plan.newcomers:  # they hold nothing of that mesh: the lead describes the rest of the state
        own = _describe_to_newcomers(own, plan, rank, state, transport)
    if own is None:
        raise StateError(f"This worker holds no snapshot of step {plan.step} (generation {plan.generation}).")

    def rows_of(old: int) -> dict[tuple, torch.Tensor]:
        held = own if own.shard == old else copies.get(old)
        if held is None:
            raise StateError(f"This worker was to send shard {old} of step {plan.step}, which it does not hold.")
        return held.sharded

    world = len(shards)
    new_count, new_index = sharded.position.count, sharded.position.index
    _, live = flatten(LocalShards(state).state_dict())
    live = dict(live)
    targets = {}
    for path, shape in own.global_shapes.items():
        start, stop = chunk_rows(shape[0], new_count, new_index)
        wanted = (stop - start, *shape[1:])
        mine = live.get(path)
        targets[path] = (mine if mine is not None and tuple(mine.shape) == wanted and mine.is_contiguous()
                         and mine.dtype == own.dtypes[path]
                         else torch.empty(wanted, dtype=own.dtypes[path], device=device))
    rank_of_new = {index: member for member, index in enumerate(shards)}
    moved, in_flight, tag = 0, [], 0
    for path, shape in own.global_shapes.items():
        row_bytes = own.dtypes[path].itemsize * _numel(shape[1:])
        for old, new, start, stop in reshard_pieces(shape[0], plan.count, new_count):
            source, target = plan.sources[old], rank_of_new.get(new)
            if target is None or not 0 <= source < world:
                raise StateError(f"The peer copy plan names no member for shard {new} (or {old}).")
            old_start = chunk_rows(shape[0], plan.count, old)[0]
            new_start = chunk_rows(shape[0], new_count, new)[0]
            for first, last in row_splits(start, stop, row_bytes, held.bucket_bytes):
                tag += 1
                if rank not in (source, target):
                    continue
                if source == target:
                    targets[path][first - new_start:last - new_start].copy_(
                        rows_of(old)[path][first - old_start:last - old_start])
                    continue
                while len(in_flight) >= WINDOW:
                    _complete(in_flight.pop(0))
                if rank == source:
                    payload = rows_of(old)[path][first - old_start:last - old_start].to(transport)
                    in_flight.append((dist.isend(payload, dst=target, tag=tag), None, None))
                    moved += payload.numel() * payload.element_size()
                else:
                    into = targets[path][first - new_start:last - new_start]
                    buffer = into if into.device == transport else torch.empty_like(into, device=transport)
                    in_flight.append((dist.irecv(buffer, src=source, tag=tag), buffer, into))
    while in_flight:
        _complete(in_flight.pop(0))
    tensors = {path: tensor for path, tensor in targets.items()}
    # clones: the optimizer may step its counters in place, and the snapshot must stay as it was
    tensors.update({path: value.to(where, copy=True) for path, (value, where) in own.replicated.items()})
    LocalShards(state).load_state_dict(rebuild(copy.deepcopy(own.skeleton), tensors))
    return {"nbytes": moved, "seconds": round(time.perf_counter() - began, 4),
            "copies_of": list(plan.from_copies),
            "copy_holders": sorted({plan.sources[old] for old in plan.from_copies})}



def _describe_to_newcomers(own: Snapshot | None, plan: FromPeerCopies, rank: int, state: State,
                           transport: torch.device) -> Snapshot | None:
    """The lead's snapshot minus its shards, broadcast to every member (a collective: all call it) in
    the one description format (:mod:`elasticctl.train.state_transfer.description`: its ``sharded`` section, the
    global shapes, and its ``values``, the unsharded tensors); a newcomer gets a Snapshot of its own
    from it (no shards: it receives its rows)."""
    blob = describe_snapshot(own) if rank == plan.lead else b""
    size = torch.tensor([len(blob)], dtype=torch.int64, device=transport)
    dist.broadcast(size, src=plan.lead)
    if not 0 < int(size.item()) <= DESCRIPTION_MAX_BYTES:
        raise StateError(f"The peer copies' description claims {int(size.item())} bytes: refused.")
    data = (torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(transport) if rank == plan.lead
            else torch.empty(int(size.item()), dtype=torch.uint8, device=transport))
    dist.broadcast(data, src=plan.lead)
    if rank not in plan.newcomers:
        return own
    return newcomer_snapshot(data.cpu().numpy().tobytes(), plan, state)


def describe_snapshot(own: Snapshot) -> bytes:
    """``own`` minus its shards, as the one description format: the skeleton, the sharded tensors'
    global shapes, and the unsharded tensors' values."""
    return describe_state(own.skeleton,
                          sharded=[TensorSpec(path, DTYPE_NAMES[own.dtypes[path]], tuple(shape), False)
                                   for path, shape in own.global_shapes.items()],
                          values=[(path, value, where.type == "cpu") for path, (value, where) in own.replicated.items()])


def newcomer_snapshot(blob: bytes, plan: FromPeerCopies, state: State) -> Snapshot:
    """A newcomer's Snapshot from the lead's description: the rest of the state as the lead holds it
    (read with ``weights_only=True``: numbers, never code), and the sharded tensors' global shapes
    checked against this worker's own parameters (an optimizer's per-parameter tensor against its
    parameter's). StateError if anything does not fit."""
    from torch.distributed.tensor import DTensor

    description = read_description(blob, "the peer copies' description")
    if description.tensors or description.bucket_bytes is not None:
        raise StateError("The peer copies' description carries sections a restore from peer copies does not take.")
    own_tensors = dict(flatten(state.state_dict())[1])
    parameters = [p for group in (state.optimizer.param_groups if state.optimizer else ()) for p in group["params"]]
    shapes, dtypes = {}, {}
    for spec in description.sharded:
        mine = own_tensors.get(spec.path)
        path = spec.path
        if path[0] == "optimizer" and len(path) == 4 and path[1] == "state" and type(path[2]) is int \
                and 0 <= path[2] < len(parameters):
            mine = parameters[path[2]]
        if not isinstance(mine, DTensor) or tuple(mine.shape) != spec.shape or not spec.shape:
            raise StateError(f"The peer copies' tensor '{spec.name}' {list(spec.shape)} does not fit "
                             "this worker's model.")
        shapes[path], dtypes[path] = spec.shape, DTYPES[spec.dtype]
    # the unsharded tensors (the optimizer's counters) go to the CPU, where torch keeps them unless capturable
    taken = {path: (value, torch.device("cpu")) for path, (value, _) in description.values.items()}
    for path in own_tensors:
        if path[0] == "model" and path not in shapes and path not in taken:
            raise StateError(f"The peer copies' description lacks the model's tensor '{'.'.join(map(str, path))}'.")
    return Snapshot(plan.generation, plan.count, -1, plan.step, plan.layout, description.state, {}, shapes, taken,
                    dtypes)


def _complete(entry: tuple) -> None:
    work, buffer, into = entry
    work.wait()
    if buffer is not None and buffer is not into:
        into.copy_(buffer)


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
