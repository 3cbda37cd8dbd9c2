"""Peer copies: a fully sharded state (FSDP2, no replica) survives a lost node from memory.

Opt-in, ``State(..., peer_copies=K)``, in hot mode, for a mesh without replicas (an HSDP mesh's
replicas already are the copies). Every K steps (and at the first step boundary of each
generation) each worker:

1. takes a **snapshot** of its own shards at that boundary, on the training thread: the state's
   local shards (model and optimizer, :class:`elasticctl.train.sharding.shards.LocalShards`) copied into
   host memory, with the rest of the state (step, fields, sampler, optimizer hyperparameters,
   the optimizer's step counters). This copy is the only cost on the training's path (a memcpy
   of the worker's shards);
2. sends its sharded tensors to its **buddy**, a worker on another node
   (:func:`choose_buddies`), and receives the shards of the workers whose buddy it is, on a
   background thread, over a gloo group of the generation's own (built at that generation's
   first copy), tensor by tensor (a tensor larger than the bucket size in bucket-sized pieces),
   straight out of the snapshot and into the copy: no whole-state blob;
3. agrees with every worker that the round is complete (an all-reduce on that group). Only then
   does anyone drop the snapshot and copies of the round before: a copy is either whole at its
   step or not used, and whatever round a failure cuts short, the one before stays whole
   everywhere.

With one node there is no buddy on another node: no copy is taken, and the log says so once.

When a generation forms, every shard of a mesh without replicas changes with the world, so the
re-wrap drops the live shards: each survivor first takes one more snapshot of them, at the step
it trained to (:meth:`PeerCopies.before_rewrap`). The members then report the shards they hold
(:class:`HeldShard`), and restoring from them is a recovery source of its own
(:mod:`elasticctl.train.recovery.from_peer_copies`): it picks the newest step at which every shard of
the old mesh is held (its owner's snapshot, else a buddy's copy), when the live replicas cannot
make one state: after a join, or any change without a loss, the step trained to (nothing
re-done); after a lost node, the last round agreed whole (at most K steps re-done, plus the step
in flight), every member going back to it, resharded to the new mesh in memory.

Memory, honestly: a worker holds, besides its live state, one snapshot of its own shards and
one copy of its buddy's shards (each the size of that worker's model and optimizer shards, in
host memory); while a round is in flight, the previous round's snapshot and copy are kept too
(twice that), and a re-formation adds the snapshot before the re-wrap until the next round. A
worker that is the buddy of several (nodes with unequal worker counts) holds a copy of each.

Limits: hot mode only; a 1-D mesh (``fully_shard`` over every worker: ``Shard(0)`` of every
parameter, torch's even chunks); a newcomer's copies of the optimizer's counters go to the CPU
(where torch keeps them unless ``capturable``); a round still in flight when the next is due
holds the training thread until it ends; a lost node whose buddy was lost with it (two nodes at
once) leaves its shards to the checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from elasticctl.train.state_transfer.description import flatten
from elasticctl.train.sharding.shards import ShardedModel
from elasticctl.train.state import State, StateError

log = logging.getLogger(__name__)

HEADER_FIELDS = 5       # a copy's header: generation, count, shard, step, layout


@dataclasses.dataclass(frozen=True)
class HeldShard:
    """A whole shard a member holds in memory besides its live state, as it reports it: its own
    snapshot, or the copy its buddy sent it."""

    generation: int  # the generation whose mesh the shard belongs to
    count: int       # the shard count of that mesh
    shard: int       # the shard's index in it
    step: int        # the step it is of
    layout: int      # the fingerprint of the state's tensors (paths, dtypes, global shapes)
    own: bool        # the member's own shard (a snapshot), not a buddy's copy


# -- the decisions (pure) --------------------------------------------------------------------

def choose_buddies(members: Sequence[str]) -> list[int | None]:
    """Each rank's buddy (the rank it sends its shards to) among ``members`` (``<node>.<local rank>``,
    in rank order), always on another node; None: it has none (the generation has one node).

    Nodes take their order of first appearance; the worker at place ``p`` among its node's workers
    (in rank order) sends to the worker at place ``p`` (modulo its size) of the next node, the last
    node to the first: one node lost loses no shard with its copy."""
    nodes: dict[str, list[int]] = {}
    for rank, member in enumerate(members):
        nodes.setdefault(member.rpartition(".")[0] or member, []).append(rank)
    if len(nodes) < 2:
        return [None] * len(members)
    rows = list(nodes.values())
    buddies: list[int | None] = [None] * len(members)
    for number, ranks in enumerate(rows):
        following = rows[(number + 1) % len(rows)]
        for place, rank in enumerate(ranks):
            buddies[rank] = following[place % len(following)]
    return buddies


def senders_to(buddies: Sequence[int | None], rank: int) -> list[int]:
    """The ranks whose buddy ``rank`` is, in rank order."""
    return [sender for sender, buddy in enumerate(buddies) if buddy == rank]


def chunk_rows(size: int, count: int, index: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of dimension 0 (``size`` rows) that shard ``index`` of ``count`` holds
    under ``Shard(0)``: torch's chunks, ``ceil(size / count)`` rows each, the last ones shorter or empty."""
    per = -(-size // count) if count else 0
    start = min(index * per, size)
    return start, min(start + per, size)


def reshard_pieces(size: int, old_count: int, new_count: int) -> list[tuple[int, int, int, int]]:
    """``(old shard, new shard, start, stop)`` for every non-empty overlap of an old shard's rows with a
    new shard's, new shard by new shard: what moves when ``size`` rows go from ``old_count`` shards
    to ``new_count``."""
    pieces = []
    for new in range(new_count):
        new_start, new_stop = chunk_rows(size, new_count, new)
        for old in range(old_count):
            old_start, old_stop = chunk_rows(size, old_count, old)
            start, stop = max(new_start, old_start), min(new_stop, old_stop)
            if start < stop:
                pieces.append((old, new, start, stop))
    return pieces


def row_splits(start: int, stop: int, row_bytes: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """``[start, stop)`` cut into runs of rows of at most ``bucket_bytes`` (at least one row each)."""
    per = max(1, bucket_bytes // max(1, row_bytes))
    return [(first, min(first + per, stop)) for first in range(start, stop, per)]


def flat_splits(numel: int, itemsize: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """A tensor of ``numel`` elements as messages of at most ``bucket_bytes``."""
    return row_splits(0, numel, itemsize, bucket_bytes)


# -- snapshots and copies --------------------------------------------------------------------

@dataclasses.dataclass
class Snapshot:
    """One worker's own shards at one step of one generation's mesh, in host memory."""

    generation: int
    count: int
    shard: int
    step: int
    layout: int
    skeleton: Any                                # the state dict, tensors replaced by None
    sharded: dict[tuple, torch.Tensor]           # path -> this shard's rows (model and optimizer)
    global_shapes: dict[tuple, tuple[int, ...]]  # path -> the sharded tensor's global shape
    replicated: dict[tuple, tuple[torch.Tensor, torch.device]]  # path -> (copy, where it lived)
    dtypes: dict[tuple, torch.dtype] = dataclasses.field(default_factory=dict)  # of the sharded tensors

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.sharded.values())

    def held(self) -> HeldShard:
        return HeldShard(self.generation, self.count, self.shard, self.step, self.layout, True)


@dataclasses.dataclass
class Copy:
    """A buddy's shards at one step, received whole."""

    generation: int
    count: int
    shard: int
    step: int
    layout: int
    sharded: dict[tuple, torch.Tensor]

    def held(self) -> HeldShard:
        return HeldShard(self.generation, self.count, self.shard, self.step, self.layout, False)


def take_snapshot(state: State, generation: int, shard: int, count: int) -> Snapshot:
    """The state's own shards and the rest of it, copied to host memory. StateError if a sharded
    tensor is not torch's even ``Shard(0)`` chunk of a 1-D mesh (peer copies cannot reshard it)."""
    from torch.distributed.tensor import DTensor, Shard

    skeleton, found = flatten(state.state_dict())
    sharded, shapes, replicated, signature = {}, {}, {}, []
    for path, tensor in found:
        if isinstance(tensor, DTensor):
            if tuple(tensor.placements) != (Shard(0),):
                raise StateError(f"The state's tensor '{'.'.join(map(str, path))}' is placed {tensor.placements}, "
                                 "not Shard(0) on one mesh dimension: peer copies cannot reshard it.")
            local = tensor.to_local()
            start, stop = chunk_rows(tensor.shape[0], count, shard)
            if tuple(local.shape) != (stop - start, *tensor.shape[1:]):
                raise StateError(f"The state's tensor '{'.'.join(map(str, path))}' holds {list(local.shape)} on "
                                 f"shard {shard} of {count}, not torch's even chunk: peer copies cannot reshard it.")
            sharded[path] = _host_copy(local)
            shapes[path] = tuple(tensor.shape)
            signature.append((path, str(tensor.dtype), tuple(tensor.shape)))
        else:
            replicated[path] = (_host_copy(tensor.detach()), tensor.device)
            signature.append((path, str(tensor.dtype), tuple(tensor.shape), "replicated"))
    fingerprint = int.from_bytes(hashlib.blake2b(repr(signature).encode(), digest_size=8).digest(), "big") >> 1
    return Snapshot(generation, count, shard, state.step, fingerprint, copy.deepcopy(skeleton), sharded, shapes,
                    replicated, {path: tensor.dtype for path, tensor in sharded.items()})


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="cpu").copy_(tensor)


def copy_shapes(own: Snapshot, shard: int) -> dict[tuple, tuple[int, ...]]:
    """The shapes of shard ``shard``'s tensors in ``own``'s mesh, from this worker's own global shapes
    (never from the peer)."""
    shapes = {}
    for path, shape in own.global_shapes.items():
        start, stop = chunk_rows(shape[0], own.count, shard)
        shapes[path] = (stop - start, *shape[1:])
    return shapes


def check_header(header: Sequence[int], own: Snapshot) -> None:
    """A buddy's copy header against this worker's own snapshot of the same round; StateError if it
    is not the round's (another generation, mesh, layout or step) or names an impossible shard."""
    generation, count, shard, step, layout = (int(v) for v in header)
    if (generation, count, step, layout) != (own.generation, own.count, own.step, own.layout):
        raise StateError(f"A peer copy announced generation {generation}, {count} shards, step {step}; this "
                         f"round is generation {own.generation}, {own.count} shards, step {own.step} (or the "
                         "state's tensors differ).")
    if not 0 <= shard < count or shard == own.shard:
        raise StateError(f"A peer copy announced shard {shard}, which its sender does not hold.")


# -- the worker's side -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _CopyGroup:
    """A generation's copy rounds: their gloo group (None: no worker has a buddy) and each rank's
    buddy."""

    generation: int
    group: Any
    buddies: list[int | None]


class PeerCopies:
    """One worker's snapshots and copies across generations (see the module docstring). The
    runtime calls :meth:`at_boundary` at each step boundary, :meth:`freeze` when a generation
    ends, :meth:`held` and :meth:`holding` while the next one forms."""

    def __init__(self, every: int, *, worker: str, timeout: Any, bucket_bytes: int,
                 emit: Any = None) -> None:
        self.every = every
        self.emit = emit  # the script's on_event: "peer_copy" for each round agreed whole, on the training thread
        self.worker = worker
        self.timeout = timeout
        self.bucket_bytes = bucket_bytes
        self._lock = threading.Lock()
        self._own: list[Snapshot] = []   # newest last; guarded by _lock (a round's thread commits)
        self._copies: list[Copy] = []
        self._token = 0                  # a round commits only under the token it started with
        self._copying: _CopyGroup | None = None  # the generation's group for its copy rounds
        self._round_done = threading.Event()
        self._round_done.set()
        self._said: set[str] = set()
        self._agreed: list[dict] = []  # rounds agreed whole since the last boundary (guarded by _lock)
        self._mesh_generation: int | None = None  # the generation whose mesh the live shards are on

    # -- training thread -------------------------------------------------------------

    def at_boundary(self, state: State, sharded: ShardedModel | None, group: Any) -> None:
        """A step boundary of ``group`` (the runtime's Group): a copy round if one is due."""
        self._report_agreed()
        if self.every <= 0 or sharded is None or sharded.position is None:
            return
        if sharded.replicate_dim is not None:
            self._say_once("replicas", "the mesh has replicas (HSDP): they are the copies; no peer copy is taken")
            return
        if not group.members:
            self._say_once("restart", "peer copies are kept in hot mode only (--recovery hot)")
            return
        first = self._copying is None or self._copying.generation != group.number
        if first:
            buddies = choose_buddies(group.members)
            self._copying = _CopyGroup(group.number, None, buddies)
            if all(buddy is None for buddy in buddies):
                self._say_once("one node", "the generation has one node: no buddy on another node, no peer copy")
                return
            # A collective on every rank (all compute the same buddies), at the same boundary.
            self._copying = _CopyGroup(group.number, dist.new_group(backend="gloo", timeout=self.timeout,
                                                                    group_desc="elasticctl peer copies"), buddies)
        copying = self._copying
        if copying.group is None or not (first or state.step % self.every == 0):
            return
        self._round_done.wait()  # the previous round of this generation (a round still out holds us here)
        snapshot = take_snapshot(state, group.number, sharded.position.index, sharded.position.count)
        with self._lock:
            self._own.append(snapshot)
            token = self._token
        self._round_done.clear()
        threading.Thread(target=self._round, args=(token, snapshot, group.rank, copying.group, copying.buddies),
                         name="elasticctl-peer-copies", daemon=True).start()

    def before_rewrap(self, state: State, sharded: ShardedModel | None) -> None:
        """A new generation forms: a snapshot of the live shards at the step they trained to, before
        the re-wrap drops them (every shard of a mesh without replicas moves when the world changes).
        With every survivor's, it makes a node's joining, or a change without a loss, cost no step
        re-done; the next round agreed whole drops it."""
        if (self.every <= 0 or sharded is None or sharded.position is None or sharded.replicate_dim is not None
                or not state.live or self._mesh_generation is None):
            return
        position = sharded.position
        with self._lock:
            if any((s.generation, s.step) == (self._mesh_generation, state.step) for s in self._own):
                return  # a round took it at this very step, or an earlier attempt to form did
        try:
            snapshot = take_snapshot(state, self._mesh_generation, position.index, position.count)
        except StateError as exc:
            self._say_once("snapshot", f"no snapshot of its shards: {exc}")
            return
        with self._lock:
            self._own.append(snapshot)

    def wrapped(self, generation: int) -> None:
        """The live shards are now on ``generation``'s mesh."""
        self._mesh_generation = generation

    def freeze(self) -> None:
        """The generation ends: a round still out commits nothing; what is held stays as it is."""
        with self._lock:
            self._token += 1
        self._copying = None
        self._round_done = threading.Event()
        self._round_done.set()

    def held(self) -> list[HeldShard]:
        with self._lock:
            return [s.held() for s in reversed(self._own)] + [c.held() for c in reversed(self._copies)]

    # -- a round (its own thread) ----------------------------------------------------

    def _round(self, token: int, snapshot: Snapshot, rank: int, group: Any, buddies: list[int | None]) -> None:
        done = self._round_done
        began = time.perf_counter()
        received: list[Copy] = []
        ok = True
        try:
            works = []
            buddy = buddies[rank]
            if buddy is not None:
                header = torch.tensor([snapshot.generation, snapshot.count, snapshot.shard, snapshot.step,
                                       snapshot.layout], dtype=torch.int64)
                works.append(dist.isend(header, group=group, group_dst=buddy, tag=0))
                for tag, view in enumerate(_message_views(snapshot.sharded.values(), self.bucket_bytes), start=1):
                    works.append(dist.isend(view, group=group, group_dst=buddy, tag=tag))
            for sender in senders_to(buddies, rank):
                received.append(self._receive(snapshot, sender, group))
            for work in works:
                work.wait()
        except Exception as exc:  # noqa: BLE001 - a peer lost mid-round, a copy that does not fit
            ok = False
            log.warning("[%s] the peer copy round of step %d failed: %s", self.worker, snapshot.step,
                        " ".join(str(exc).split())[:300])
        try:
            flag = torch.tensor([int(ok)], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
            agreed: bool | None = bool(flag.item())
        except Exception:  # noqa: BLE001 - the generation is ending: nothing agreed
            agreed = None
        with self._lock:
            if token == self._token:
                if agreed:  # whole everywhere: the round before is no longer needed by anyone
                    self._own = [snapshot]
                    self._copies = received
                    self._agreed.append({"step": snapshot.step, "shard": snapshot.shard, "nbytes": snapshot.nbytes,
                                         "copies_of": [c.shard for c in received],
                                         "seconds": round(time.perf_counter() - began, 4)})
                elif agreed is False:  # incomplete somewhere, known everywhere: keep the round before
                    self._own = [s for s in self._own if s is not snapshot]
                else:  # unknown: keep both rounds (the next generation's plan picks what is whole)
                    self._copies = [*self._copies, *received]
        if agreed:
            log.debug("[%s] peer copy of step %d: %d bytes sent, %d copies received in %.3f s", self.worker,
                      snapshot.step, snapshot.nbytes, len(received), time.perf_counter() - began)
        done.set()

    def _receive(self, own: Snapshot, sender: int, group: Any) -> Copy:
        header = torch.empty(HEADER_FIELDS, dtype=torch.int64)
        dist.irecv(header, group=group, group_src=sender, tag=0).wait()
        check_header(header.tolist(), own)
        shard = int(header[2])
        tensors = {path: torch.empty(shape, dtype=own.dtypes[path])
                   for path, shape in copy_shapes(own, shard).items()}
        works = [dist.irecv(view, group=group, group_src=sender, tag=tag)
                 for tag, view in enumerate(_message_views(tensors.values(), self.bucket_bytes), start=1)]
        for work in works:
            work.wait()
        return Copy(own.generation, own.count, shard, own.step, own.layout, tensors)

    # -- restoring (training thread, while the next generation forms) ----------------

    def holding(self, generation: int, count: int, layout: int, step: int) -> tuple[Snapshot | None, dict[int, Copy]]:
        """This worker's own snapshot of that mesh and step (None: none), and its buddies' copies of it
        by shard index: what :mod:`elasticctl.train.recovery.from_peer_copies` restores from."""
        key = (generation, count, layout, step)
        with self._lock:
            own = next((s for s in self._own if (s.generation, s.count, s.layout, s.step) == key), None)
            copies = {c.shard: c for c in self._copies if (c.generation, c.count, c.layout, c.step) == key}
        return own, copies

    def _report_agreed(self) -> None:
        with self._lock:
            agreed, self._agreed = self._agreed, []
        for fields in agreed:
            if self.emit is not None:
                self.emit("peer_copy", **fields)

    def _say_once(self, what: str, message: str) -> None:
        if what not in self._said:
            self._said.add(what)
            log.warning("[%s] %s", self.worker, message)


def _message_views(tensors: Any, bucket_bytes: int) -> list[torch.Tensor]:
    """Every tensor as flat views of at most ``bucket_bytes`` (contiguous: snapshots and copies are)."""
    views = []
    for tensor in tensors:
        flat = tensor.view(-1)
        views += [flat[first:last] for first, last in flat_splits(flat.numel(), tensor.element_size(), bucket_bytes)]
    return views
