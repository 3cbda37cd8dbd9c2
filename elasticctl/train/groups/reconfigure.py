"""One process group for a worker's whole life, reconfigured in place for each generation.

torch (2.14 on) can reconfigure a default process group in place: created with
``init_process_group(..., enable_reconfigure=True)``, each member hands its peers an opaque
handle (``_get_reconfigure_handle``), and ``_reconfigure(uuid, handles)`` re-forms the same
group object over exactly those peers, a fresh ``uuid`` per re-formation. A member that left
is simply not among the handles; a brand-new process joins with the group of its own it made
at start. The communicator, and everything built on the group object (a
``DistributedDataParallel`` module, its reducer and buckets), outlives the generation:
nothing is torn down or re-wrapped, and on a GPU no communicator is created per generation.
``abort()`` on such a group revokes it: a collective pending on a lost peer raises at once
(a plain gloo group has no abort), and the next reconfigure recovers it.

The API is experimental (underscored, "subject to change or removal"). This module is the
only place elasticctl touches it; ``tests/process/test_torch_reconfigure.py`` pins every
behaviour relied on here and fails loudly on a torch that changes one. Where it is missing
or not yet trusted, :func:`group_strategy` (pure) chooses today's rebuild of a new group per
generation, and says why; the recovery timeline names which one ran.

Why a :class:`GenerationStore`: a reconfigure exchanges the members' addresses through the
store the group was created with, so that store must outlive every member, yet a generation's
TCPStore is hosted by its rank 0 and dies with it. The group is created on a store whose
target each generation replaces with that generation's own store (rank 0's TCPStore under the
generation's prefix, as a rebuilt group uses): every member of a generation points at the same
store before it reconfigures, and a member that died takes only its own generation's store with it.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import inspect
import re
import secrets
import threading
from typing import Any

import torch
import torch.distributed as dist

# The longest handle a peer may hand over: torch's are a few dozen bytes (an address and a port
# for gloo); anything longer, or not printable ASCII, is refused before torch parses it.
MAX_HANDLE_BYTES = 4096
_HANDLE_RE = re.compile(r"[\x21-\x7e]{1,%d}" % MAX_HANDLE_BYTES)


class GroupStrategy(enum.Enum):
    RECONFIGURE = "reconfigured"  # the worker's one group, reconfigured in place
    REBUILD = "rebuilt"           # a new process group (and store) per generation


@dataclasses.dataclass(frozen=True)
class StrategyChoice:
    strategy: GroupStrategy
    why: str


def torch_can_reconfigure() -> bool:
    """Whether this torch has the in-place reconfiguration API (the three calls, and the flag)."""
    return (all(hasattr(dist, name) for name in ("_reconfigure", "_get_reconfigure_handle", "_supports_reconfigure"))
            and "enable_reconfigure" in inspect.signature(dist.init_process_group).parameters)


def group_strategy(backend: str, torch_can: bool, *, sharded: bool, default_wrap: bool,
                   forced_rebuild: bool = False, kept_mesh: bool = False) -> StrategyChoice:
    """How a hot-mode worker's generations get their process group, for its whole life.

    Reconfigure only where every piece is known to hold: torch has the API; the backend is gloo
    alone (``nccl2`` has it too, but nothing here can pin it: no machine with several GPUs); the
    model is replicated and wrapped by the runtime's own DDP (built once, without the
    collectives of its start, which a joiner would run alone: the state sync does their work), or
    sharded on the runtime's HSDP mesh (``kept_mesh``: ``run(..., sharded="hsdp")``), whose two
    groups are reconfigured with the world, so that the mesh and the module sharded on it outlive
    generations (``new_group`` on a reconfigurable group is reconfigurable, FSDP2 divides by the
    live sizes: pinned in tests/process/test_torch_reconfigure.py). A script's own mesh is built
    anew each generation: torch's bookkeeping of a reconfigured group's ranks is not updated
    (``get_process_group_ranks`` keeps its first members), which a mesh of the whole world reads.
    A script's own wrap may run collectives of its own whenever it is called."""
    if forced_rebuild:
        return StrategyChoice(GroupStrategy.REBUILD, "asked for")
    if not torch_can:
        return StrategyChoice(GroupStrategy.REBUILD, f"torch {torch.__version__} cannot reconfigure a group")
    backends = {name.lower() for name in dist.BackendConfig(backend).get_device_backend_map().values()}
    if backends != {dist.Backend.GLOO}:
        return StrategyChoice(GroupStrategy.REBUILD, f"the {backend} backend is not pinned here")
    if sharded:
        if kept_mesh:
            return StrategyChoice(GroupStrategy.RECONFIGURE, "gloo, the runtime's HSDP mesh, kept")
        return StrategyChoice(GroupStrategy.REBUILD, "the script's wrap builds its own mesh each generation")
    if not default_wrap:
        return StrategyChoice(GroupStrategy.REBUILD, "the script wraps the model itself")
    return StrategyChoice(GroupStrategy.RECONFIGURE, "gloo, the runtime's DDP")


# What gloo says when a collective's timeout ends it (torch 2.14: "[.../unbound_buffer.cc:81] Timed
# out waiting 4000ms for recv operation to complete"); a lost peer's error says its connection
# closed or was reset instead. Pinned in tests/process/test_torch_reconfigure.py.
_TIMEOUT_RE = re.compile(r"Timed out waiting \d+ ?ms for (recv|send) operation")


def is_collective_timeout(error: BaseException) -> bool:
    """Whether ``error``, raised by a collective, is the end of its timeout (a peer that did not
    answer), not a lost peer's closed connection."""
    return bool(_TIMEOUT_RE.search(str(error)))


def checked_handle(text: object) -> str:
    """A peer's handle, as torch may parse it: printable ASCII, bounded; else ValueError."""
    if not isinstance(text, str) or not _HANDLE_RE.fullmatch(text):
        raise ValueError(f"a reconfigure handle must be 1 to {MAX_HANDLE_BYTES} printable ASCII characters, "
                         f"got {str(text)[:80]!r}")
    return text


class GenerationStore(dist.Store):
    """A c10d store that forwards to the current generation's store (see the module docstring).

    Written by the training thread (:meth:`point_at`, before the generation's reconfigure) and
    read by gloo's threads during it; the target is replaced whole under a lock."""

    def __init__(self, timeout: datetime.timedelta) -> None:
        super().__init__()  # required by the pybind trampoline
        self._lock = threading.Lock()
        self._target: dist.Store = dist.HashStore()  # until the first generation: the group of one
        self.set_timeout(timeout)

    def point_at(self, store: dist.Store) -> None:
        with self._lock:
            self._target = store

    @property
    def target(self) -> dist.Store:
        with self._lock:
            return self._target

    def set(self, key, value) -> None:
        self.target.set(key, value)

    def get(self, key) -> bytes:
        return self.target.get(key)

    def add(self, key, amount) -> int:
        return self.target.add(key, amount)

    def compare_set(self, key, expected_value, desired_value) -> bytes:
        return self.target.compare_set(key, expected_value, desired_value)

    def wait(self, keys, timeout=None) -> None:
        if timeout is None:
            self.target.wait(keys)
        else:
            self.target.wait(keys, timeout)

    def check(self, keys) -> bool:
        return self.target.check(keys)

    def delete_key(self, key) -> bool:
        return self.target.delete_key(key)

    def num_keys(self) -> int:
        return self.target.num_keys()

    # The pybind trampoline looks these two up by their C++ names.
    getNumKeys = num_keys
    deleteKey = delete_key

    def multi_get(self, keys) -> list[bytes]:
        return [self.get(key) for key in keys]

    def multi_set(self, keys, values) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)


# The uuid of the group of one each worker starts with: drawn from a range no generation number
# reaches, so that it never meets a generation's uuid (its number) nor, in practice, another's.
_SOLO_UUIDS = (1 << 40, 1 << 62)


class ReconfigurableGroup:
    """This worker's default process group, made once and reconfigured for each generation.

    It starts as a group of this worker alone, reconfigured once under a random uuid: a gloo
    handle names the member's rank and the uuid of its last reconfigure, so two workers that
    never reconfigured would hand over the same handle (rank 0, none), which torch refuses.
    """

    def __init__(self, backend: str, timeout: datetime.timedelta, *, with_mesh: bool = False) -> None:
        self.store = GenerationStore(timeout)
        self.timeout = timeout
        dist.init_process_group(backend, store=self.store, rank=0, world_size=1, timeout=timeout,
                                enable_reconfigure=True)
        self.group = dist.distributed_c10d._get_default_group()
        if not dist._supports_reconfigure(self.group):
            dist.destroy_process_group()
            raise RuntimeError(f"the {backend} process group does not support reconfiguration")
        solo = secrets.SystemRandom().randrange(*_SOLO_UUIDS)
        dist._reconfigure(solo, [dist._get_reconfigure_handle(self.group)], group=self.group,
                          timeout=timeout).wait()
        # An HSDP mesh's groups, kept with this one (made now, while this worker is a world of its own)
        self.mesh_groups = MeshGroups(self) if with_mesh else None

    @property
    def handle(self) -> str:
        """What this worker's peers pass to the next reconfigure (it changes with each one)."""
        return dist._get_reconfigure_handle(self.group)

    def reconfigure(self, uuid: int, handles: list[str], store: dist.Store) -> None:
        """Re-form the group over ``handles`` (rank = position), exchanging addresses through
        ``store`` (every member of the generation passes the same one); raises on failure."""
        handles = [checked_handle(handle) for handle in handles]
        self.store.point_at(store)
        dist._reconfigure(uuid, handles, group=self.group, timeout=self.timeout).wait()
        keep_torch_bookkeeping(self.group, list(range(len(handles))))

    def release_store(self) -> None:
        """Let go of the generation's store (until the next reconfigure points at another)."""
        self.store.point_at(dist.HashStore())

    def revoke(self) -> None:
        """Make a collective pending on this group raise now (a lost peer); the next
        :meth:`reconfigure` recovers the group."""
        self.group.abort()

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def keep_torch_bookkeeping(group: Any, members: list[int]) -> None:
    """Tell torch who ``group``'s members are now (``members``: global ranks, in group-rank order):
    a reconfigure does not update torch's own map of them, which ``get_rank(group)``,
    ``get_group_rank``, ``get_process_group_ranks`` and c10d's error reporting read. Stale, a
    survivor whose global rank changed made every failed collective on a kept mesh group raise
    "Global rank N is not part of group" from that reporting, instead of its own error (a
    timeout, say). The map is private (``_world.pg_group_ranks``), like the reconfigure itself:
    pinned in tests/process/test_torch_reconfigure.py."""
    dist.distributed_c10d._world.pg_group_ranks[group] = {member: index for index, member in enumerate(members)}


def handles_of(store: dist.Store, rank: int, world_size: int, handle: str) -> list[str]:
    """Every member's handle in rank order, exchanged through the generation's store; each one
    checked before torch parses it."""
    store.set(f"reconfigure-handle/{rank}", handle)
    return [checked_handle(store.get(f"reconfigure-handle/{peer}").decode("ascii", errors="replace"))
            for peer in range(world_size)]


# -- a sharded model's mesh, kept across generations ----------------------------------------------


class MeshDim(enum.IntEnum):
    """The dimensions of an HSDP mesh (elasticctl.train.sharding.shards.hsdp_layout: rows are nodes)."""

    REPLICATE = 0  # a column: the same shard index on every node
    SHARD = 1      # a row: one node's workers


# A mesh group's uuid: above every generation's own number (the world group's uuid) and below the
# solo range; one per (generation, dimension, group index), so that no two groups a generation
# reconfigures share one, nor does a group ever get the uuid it holds.
_MESH_UUID_BASE = 1 << 32
MAX_MESH_GROUPS = 1 << 12  # groups per dimension (nodes, or workers per node)


def mesh_group_uuid(generation: int, dim: MeshDim, index: int) -> int:
    """The uuid of mesh group ``index`` of dimension ``dim`` (a replicate group: its shard index; a
    shard group: its node's row) in generation ``generation``; ValueError out of range."""
    if generation < 0 or not 0 <= index < MAX_MESH_GROUPS:
        raise ValueError(f"No mesh group uuid for generation {generation}, group {index}.")
    uuid = _MESH_UUID_BASE + (generation * len(MeshDim) + int(dim)) * MAX_MESH_GROUPS + index
    if uuid >= _SOLO_UUIDS[0]:
        raise ValueError(f"Generation {generation} is past the mesh groups' uuids.")
    return uuid


def mesh_group_members(rows: list[list[int]], rank: int) -> dict[MeshDim, tuple[int, list[int]]]:
    """For each dimension, the index of ``rank``'s group and its members in group-rank order: its
    column across the rows (node order) and its row. ValueError if ``rank`` is not in ``rows`` once
    or the rows are ragged."""
    where = [(row_index, row.index(rank)) for row_index, row in enumerate(rows) if rank in row]
    if len(where) != 1 or len({len(row) for row in rows}) != 1:
        raise ValueError(f"Rank {rank} is not once in the mesh rows {rows}.")
    row_index, column = where[0]
    return {MeshDim.REPLICATE: (column, [row[column] for row in rows]),
            MeshDim.SHARD: (row_index, list(rows[row_index]))}


class MeshGroups:
    """A worker's two HSDP mesh groups, kept for its whole life beside its :class:`ReconfigurableGroup`
    and reconfigured with it for each generation: made alone at start (``new_group`` on a
    reconfigurable default group is reconfigurable itself), each re-formed over its generation's
    members. A mesh made from them (``DeviceMesh.from_group``) keeps serving the FSDP2 module wrapped
    on it (pinned in tests/process/test_torch_reconfigure.py).

    Make it right after the ReconfigurableGroup, while the worker is a world of its own."""

    def __init__(self, world: ReconfigurableGroup) -> None:
        self.world = world
        self.groups = {dim: dist.new_group([0], use_local_synchronization=True, timeout=world.timeout)
                       for dim in MeshDim}
        self.rows: list[list[int]] = [[0]]  # the layout the groups were last reconfigured over
        self._mesh: Any = None
        for group in self.groups.values():  # a handle of (rank 0, no uuid) would be every fresh group's
            solo = secrets.SystemRandom().randrange(*_SOLO_UUIDS)
            dist._reconfigure(solo, [dist._get_reconfigure_handle(group)], group=group,
                              timeout=world.timeout).wait()

    def handles(self) -> dict[MeshDim, str]:
        """What this worker's peers pass to the next reconfigure of each group."""
        return {dim: dist._get_reconfigure_handle(group) for dim, group in self.groups.items()}

    def reconfigure(self, generation: int, rows: list[list[int]], rank: int,
                    handles: dict[MeshDim, list[str]], store: dist.Store) -> None:
        """Re-form both groups over ``rank``'s column and row of ``rows`` (global ranks of
        ``generation``), from every rank's handles (``handles[dim][rank]``); each group's exchange
        under a prefix of its own in ``store`` (the generation's)."""
        for dim, (index, members) in mesh_group_members(rows, rank).items():
            self.world.store.point_at(dist.PrefixStore(f"mesh-{dim.name.lower()}-{index}", store))
            dist._reconfigure(mesh_group_uuid(generation, dim, index),
                              [checked_handle(handles[dim][member]) for member in members],
                              group=self.groups[dim], timeout=self.world.timeout).wait()
            keep_torch_bookkeeping(self.groups[dim], members)
        self.rows = [list(row) for row in rows]

    def mesh(self, device_type: str, dim_names: tuple[str, str]) -> Any:
        """The 2-D mesh of the two groups (``DeviceMesh.from_group``), made once, on the layout of the
        generation that first asks: the same object for the worker's whole life. Its rank tensor and
        coordinate stay those of that generation; what reads them after a reconfigure is the shard
        coordinate (a worker's place in its node, which it keeps) and the groups, which are live."""
        from torch.distributed.device_mesh import DeviceMesh

        if self._mesh is None:
            self._mesh = DeviceMesh.from_group([self.groups[MeshDim.REPLICATE], self.groups[MeshDim.SHARD]],
                                               device_type, mesh=torch.tensor(self.rows, dtype=torch.int64),
                                               mesh_dim_names=dim_names)
        return self._mesh


def mesh_handles_of(store: dist.Store, rank: int, world_size: int,
                    handles: dict[MeshDim, str]) -> dict[MeshDim, list[str]]:
    """Every member's handle of each mesh group, by rank, exchanged through the generation's store
    (as :func:`handles_of`); each checked before torch parses it."""
    for dim, handle in handles.items():
        store.set(f"mesh-handle/{dim.name.lower()}/{rank}", handle)
    return {dim: [checked_handle(store.get(f"mesh-handle/{dim.name.lower()}/{peer}").decode("ascii", errors="replace"))
                  for peer in range(world_size)] for dim in handles}
