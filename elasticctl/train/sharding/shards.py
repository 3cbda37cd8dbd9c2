"""Sharded models (FSDP2 ``fully_shard``, HSDP) across generations: the mesh, the re-wrap, the shards.

A script that shards its model passes ``run(..., wrap=fn, sharded=True)``: ``fn(model, group)``
applies ``fully_shard`` on a mesh of that generation's workers (:func:`hsdp_mesh`: replicate
across nodes, shard within a node) and returns the model. An FSDP module is bound to the mesh it
was sharded on. Where the mesh's groups are reconfigured in place (``sharded="hsdp"``:
:class:`elasticctl.train.groups.reconfigure.MeshGroups`), :func:`hsdp_mesh` is one mesh for the worker's
life and a survivor keeps its module through a change agreed at a boundary. Otherwise (a
failure, a joiner's first generation, a mesh the script builds) each generation gets a new
module (:class:`ShardedModel`):

1. a copy of the script's model on the meta device (made once, before the first wrap: it holds
   no memory) goes through ``fn`` on the new mesh and is given empty local storage
   (``to_empty``);
2. the new module's local shards are filled from the previous module's: the same tensors when
   this worker holds the same shard (same shard index, same shard count; :func:`hsdp_mesh`
   keeps both for a survivor), else nothing (the worker reports no state and
   receives its shards, :mod:`elasticctl.train.recovery.from_replicas`); the first generation fills them from the
   script's full tensors (``distribute_tensor`` of each rank's own data, no communication);
3. the optimizer is pointed at the new parameters, its state moved onto them.

The state then travels as local shards (:class:`~elasticctl.train.sharding.local_shards.LocalShards`): per shard index, the replicas at
the newest step send to the others of that shard index over the mesh's replicate group, with
:mod:`elasticctl.train.state_transfer.transfer`'s bucketed path (a description checked against the receiver's
own local shards, then the tensors in place).

Limits: every parameter is a DTensor on one mesh with one placement (``fully_shard`` of the model,
of its blocks, or both, on the mesh ``fn`` builds); that mesh is 1-D (``Shard(0)``: no replicas,
a changed world restores the peers' in-memory copies, :mod:`elasticctl.train.sharding.buddy_copies`, or
else the newest sharded checkpoint) or 2-D (``Replicate(), Shard(0)``);
optimizer state tensors are shaped like their parameter or are scalars; the model's buffers are
replicated (FSDP2 does not shard them); the script builds its full model once per process (the
first generation shards it; a meta-device model is not supported yet). An HSDP generation must
hold whole nodes (:func:`hsdp_layout`): a sharded job's generations admit a node with all its
workers or not at all (``rendezvous/rounds.py``: ``whole_nodes``), and a layout still refused
fails that generation, which is formed again.

Each generation's mesh is new, but torch's DTensor caches (sharding propagation, redistribution
plans) key on ``DeviceMesh`` equality, which compares ranks, shape and dimension names and not
the process groups: a DTensor made by an op (``nn.Parameter``'s detach, ``to_empty``) on a mesh
equal to an earlier generation's gets that earlier mesh back, whose group names were that
generation's. They resolve by luck when every worker kept its rank and the groups were created
in the same order; otherwise to nothing ("Could not resolve the process group registered under
the name N") or to another group of this generation. :meth:`ShardedModel.rewrap` therefore
empties those caches first (:func:`forget_earlier_meshes`), and checks that the module's mesh
resolves to this generation's groups (:func:`check_mesh`) before it uses it.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import datetime
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from elasticctl.errors import ConfigError, ElasticctlError
from elasticctl.train.state import State, StateError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from elasticctl.train.group import Group

REPLICATE_DIM, SHARD_DIM = "replicate", "shard"


class LayoutError(ElasticctlError):
    """A generation whose workers cannot be laid out as nodes of equal size."""


class MeshError(ElasticctlError):
    """A sharded module's mesh that does not name this generation's process groups."""


def hsdp_layout(members: Sequence[str], world_size: int, local_world_size: int) -> list[list[int]]:
    """The ranks of an HSDP mesh: one row per node (its replicas), one column per shard index.

    A row holds its node's ranks in ascending order: torch numbers a mesh dimension's workers by
    their rank in its process group (sorted global ranks), FSDP shards by that number and DTensor
    locates shards by the mesh coordinate, which agree only so. A worker's shard index is thus its
    place among its node's workers in rank order, which a survivor keeps: a new generation keeps
    the order of the members of the one before (newcomers come after).

    ``members``: the workers ``<node>.<local rank>`` in rank order (hot mode); empty: torchrun's
    ranks, node after node (``rank = node * local_world_size + local rank``). Raises LayoutError
    when a node does not bring exactly ``local_world_size`` workers."""
    if local_world_size < 1 or world_size % local_world_size:
        raise LayoutError(f"A world of {world_size} workers is not nodes of {local_world_size} workers each.")
    if not members:
        return [list(range(start, start + local_world_size)) for start in range(0, world_size, local_world_size)]
    if len(members) != world_size:
        raise LayoutError(f"The generation lists {len(members)} workers for a world of {world_size}.")
    rows: dict[str, list[int]] = {}
    for rank, member in enumerate(members):
        node, _, local = member.rpartition(".")
        if not node or not local.isdigit():
            raise LayoutError(f"The worker '{member}' is not named <node>.<local rank>.")
        rows.setdefault(node, []).append(rank)
    for node, ranks in rows.items():
        if len(ranks) != local_world_size:
            raise LayoutError(f"The node '{node}' has {len(ranks)} of its {local_world_size} workers in this "
                              "generation: it cannot hold a replica of every shard.")
    return list(rows.values())  # rows in order of their first rank, each ascending


def hsdp_mesh(group: Group) -> DeviceMesh:
    """The 2-D mesh of ``group``'s workers for ``fully_shard``: dimension ``replicate`` across nodes,
    ``shard`` within a node (shard count = workers per node; :func:`hsdp_layout`). Every worker
    calls it, at the same point (it builds the process groups of both dimensions).

    Under ``run(..., sharded="hsdp")`` with groups reconfigured in place, it is the worker's one mesh,
    the same object every generation: its groups are re-formed over each generation's layout and
    the module sharded on it is kept (:class:`ShardedModel`)."""
    from torch.distributed.device_mesh import DeviceMesh

    layout = hsdp_layout(group.members, group.world_size, group.local_world_size)
    if group.mesh_groups is not None:
        if group.mesh_groups.rows != layout:
            raise MeshError(f"The kept mesh groups were formed over {group.mesh_groups.rows}, not this generation's "
                            f"layout {layout}.")
        return group.mesh_groups.mesh(group.device.type, (REPLICATE_DIM, SHARD_DIM))
    options = mesh_group_options(group.device, group.timeout)
    return DeviceMesh(group.device.type, torch.tensor(layout, dtype=torch.int64),
                      mesh_dim_names=(REPLICATE_DIM, SHARD_DIM),
                      backend_override=None if options is None else ((None, options), (None, options)))


def kept_position(group: Group) -> ShardPosition:
    """The shard ``group``'s worker holds on an HSDP mesh: its place among its node's workers."""
    rows = hsdp_layout(group.members, group.world_size, group.local_world_size)
    row = next(row for row in rows if group.rank in row)
    return ShardPosition(row.index(group.rank), len(row))


def mesh_group_options(device: torch.device, timeout: datetime.timedelta | None):
    """The options of a mesh dimension's process groups that carry ``timeout`` (None: torch's defaults).
    A mesh builds its dimensions' groups with torch's default timeout (30 minutes), not the
    training group's: a frozen peer would stall every survivor's step for that long, where the
    training group gives up at the node TTL. torch takes a group's timeout for a mesh only from
    these options (``DeviceMesh(backend_override=...)``, which reads their ``_timeout``): NCCL's
    own options class, else the generic backend options, constructed with the timeout."""
    import torch.distributed as dist

    if timeout is None:
        return None
    if device.type == "cuda" and dist.is_nccl_available():
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return options
    return dist.ProcessGroupGloo.Options("gloo", timeout)


def forget_earlier_meshes() -> None:
    """Empty torch's DTensor caches, which may hold an earlier generation's mesh (see the module
    docstring). torch has no public call for this: ``torch.distributed.tensor.debug``'s
    ``_clear_sharding_prop_cache`` ("the recommended way to clear all sharding propagation caches",
    its docstring says) and the redistribution planner's caches. A torch without them keeps its
    caches, and :func:`check_mesh` then fails a generation whose mesh is stale (it is formed
    again) instead of letting it train on another generation's groups."""
    try:
        from torch.distributed.tensor import _redistribute
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:
        return
    _clear_sharding_prop_cache()
    for clear in (getattr(_redistribute, "clear_redistribute_planner_cache", None),
                  getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None)):
        if clear is not None:
            clear()


def ranks_along(mesh: torch.Tensor, rank: int) -> list[list[int]]:
    """For each dimension of ``mesh`` (a tensor of global ranks), the ranks of the group along that
    dimension through ``rank``, ascending; raises MeshError if ``rank`` is not in the mesh once."""
    found = (mesh == rank).nonzero()
    if len(found) != 1:
        raise MeshError(f"Rank {rank} is {len(found)} times in the mesh {mesh.tolist()}, not once.")
    coordinate = found[0].tolist()
    along = []
    for dim in range(mesh.dim()):
        index = list(coordinate)
        index[dim] = slice(None)
        along.append(sorted(mesh[tuple(index)].flatten().tolist()))
    return along


def stale_dims(expected: list[list[int]], resolved: list[list[int] | None]) -> list[int]:
    """The dimensions whose group, as the mesh resolves it (None: it does not), is not the group of
    ranks ``expected`` along that dimension."""
    return [dim for dim, (want, got) in enumerate(zip(expected, resolved, strict=True)) if got != want]


def check_mesh(mesh: DeviceMesh) -> None:
    """Raise MeshError unless every dimension of ``mesh`` resolves to a process group of this
    generation holding exactly this worker's ranks along it."""
    import torch.distributed as dist

    resolved: list[list[int] | None] = []
    for dim in range(mesh.ndim):
        try:
            resolved.append(sorted(dist.get_process_group_ranks(mesh.get_group(dim))))
        except (RuntimeError, ValueError):  # "Could not resolve the process group registered under ..."
            resolved.append(None)
    expected = ranks_along(mesh.mesh, dist.get_rank())
    stale = stale_dims(expected, resolved)
    if stale:
        names = mesh.mesh_dim_names or tuple(map(str, range(mesh.ndim)))
        raise MeshError("The sharded model's mesh does not name this generation's process groups ("
                        + "; ".join(f"dimension {names[d]}: ranks {expected[d]}, resolved "
                                    f"{'nothing' if resolved[d] is None else resolved[d]}" for d in stale)
                        + "): it is an earlier generation's; this generation is formed again.")


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (sharded, e.g. by ``fully_shard``)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


@dataclasses.dataclass(frozen=True)
class ShardPosition:
    """Where a worker's local shards sit in its mesh: the shard it holds, out of how many."""

    index: int
    count: int


def _sharding(model: nn.Module) -> tuple[Any, tuple, int | None, int]:
    """The mesh and placements every parameter shares, the replicate dim (None: none) and the shard dim."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    specs = {(id(p.device_mesh), tuple(p.placements)) if isinstance(p, DTensor) else None
             for p in model.parameters()}
    if None in specs or len(specs) != 1:
        raise StateError("A sharded model must have every parameter a DTensor on one mesh with one placement "
                         "(the wrap applies fully_shard to the model, its blocks or both, on one mesh).")
    first = next(iter(model.parameters()))
    placements = tuple(first.placements)
    shard_dims = [d for d, p in enumerate(placements) if isinstance(p, Shard) and p.dim == 0]
    replicate_dims = [d for d, p in enumerate(placements) if isinstance(p, Replicate)]
    if len(shard_dims) != 1 or len(replicate_dims) + 1 != len(placements):
        raise StateError(f"A sharded model's placements must be (Shard(0),) or (Replicate(), Shard(0)), "
                         f"not {placements}.")
    return first.device_mesh, placements, (replicate_dims[0] if replicate_dims else None), shard_dims[0]


class ShardedModel:
    """The runtime's hold on a sharded model from generation to generation (see the module docstring)."""

    def __init__(self, wrap: Any) -> None:
        self._wrap = wrap
        self._template: nn.Module | None = None  # the script's model on the meta device
        # The current module's sharded parameters by name, as wrapped: a step that failed half-way
        # leaves FSDP's unsharded ones registered on the module instead (and the optimizer holds these).
        self._parameters: dict[str, nn.Parameter] = {}
        self.mesh: Any = None
        self.replicate_dim: int | None = None
        self.shard_dim: int | None = None
        self.position: ShardPosition | None = None
        self._device: torch.device | None = None
        # run(..., sharded="hsdp") on groups reconfigured in place: the mesh groups the module is
        # sharded on (elasticctl.train.groups.reconfigure.MeshGroups); None: a mesh of this generation's own.
        self.kept_groups: Any = None
        self.kept = False  # whether the last generation kept the module (no re-wrap)
        # A step failed half-way (FSDP's unsharded parameters may still be registered): the next
        # generation re-wraps even on the kept mesh, from the sharded parameters the optimizer holds.
        self.after_failure = False

    def rewrap(self, state: State, group: Group) -> bool:
        """Shard ``state.model`` over ``group``'s mesh as a new module; True if this worker kept its
        local shards (the same shard of as many), False if it holds none that fit any more.

        On a kept mesh (``group.mesh_groups``) a survivor keeps its module instead: its mesh's groups
        were re-formed in place over this generation, and its shard is the same (its place among its
        node's workers). A worker whose place changed fails the generation (MeshError): the mesh's
        coordinate is its first generation's, so the next attempt builds every group anew."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        kept_groups = group.mesh_groups
        same_mesh = kept_groups is not None and kept_groups is self.kept_groups
        after_failure, self.after_failure = self.after_failure, False
        if same_mesh:
            if kept_position(group) != self.position:
                raise MeshError(f"This worker's shard moved from {self.position} to {kept_position(group)} on its "
                                "kept mesh; this generation is formed again with new groups.")
            if state.live and not after_failure:
                self.kept = True
                return True
        self.kept = False
        previous = state.model
        first = self._template is None
        if first:
            self._template = meta_copy(previous)
        if not same_mesh:  # the same mesh object keeps its caches right, and warm
            forget_earlier_meshes()  # before any DTensor op of this generation
        fresh = self._wrap(copy.deepcopy(self._template), group)
        fresh.to_empty(device=group.device)
        mesh, placements, replicate_dim, shard_dim = _sharding(fresh)
        if kept_groups is not None:
            if mesh is not kept_groups.mesh(group.device.type, (REPLICATE_DIM, SHARD_DIM)):
                raise ConfigError("run(..., sharded='hsdp') keeps the mesh of elasticctl.train.hsdp_mesh(group): the "
                                  "wrap must shard the model on that mesh, not on one of its own.")
            position = kept_position(group)  # torch's bookkeeping of the reconfigured groups is stale
        else:
            check_mesh(mesh)
            position = ShardPosition(mesh.get_local_rank(shard_dim), mesh.size(shard_dim))
        kept = first or (state.live and position == self.position)
        old_parameters = self._parameters or dict(previous.named_parameters())
        with torch.no_grad():
            for name, parameter in fresh.named_parameters():
                old = old_parameters[name]
                if isinstance(old, DTensor):
                    if kept:
                        parameter.to_local().copy_(old.to_local())
                else:  # the first generation: this rank's part of the script's full tensor, no communication
                    parameter.to_local().copy_(distribute_tensor(old.detach(), mesh, placements,
                                                                 src_data_rank=None).to_local())
            old_buffers = dict(previous.named_buffers())
            for name, buffer in fresh.named_buffers():
                buffer.copy_(old_buffers[name])
        parameters = dict(fresh.named_parameters())
        if state.optimizer is not None:
            rebind_optimizer(state.optimizer, old_parameters, parameters, keep_state=kept)
        state.model, self._parameters = fresh, parameters
        self.mesh, self.replicate_dim, self.shard_dim, self.position = mesh, replicate_dim, shard_dim, position
        self._device = group.device
        self.kept_groups = kept_groups
        if not kept:
            state.live = False
        return kept

    def warm_up(self, state: State, group: Group) -> None:
        """Pay torch's one-time cost of a sharded step now, on a throwaway: a copy of the model on
        the meta device (no memory) wrapped over ``group`` (this worker alone, before its first
        generation), given zero gradients and stepped once by a copy of the optimizer; then its
        mesh's groups destroyed. torch's DTensor caches are emptied before and after.

        Why: the first ``fully_shard`` and the first optimizer step over DTensors of a process run
        FSDP2's and DTensor's first-use code (about 0.15 s and 0.4 s on this CPU, against 0.03 s
        each after); a worker that joins a running job paid it after its admission, while every
        running worker waited in the state sync and in the first step. The script's model, its
        optimizer (state, hooks) and the kept mesh groups are not touched."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        # Before any DTensor op: a cache holding an equal mesh of an earlier wrap would hand the
        # throwaway's parameters that mesh, whose groups may be gone (see the module docstring).
        forget_earlier_meshes()
        throwaway = self._wrap(meta_copy(state.model), group)
        meshes = {id(p.device_mesh): p.device_mesh for p in throwaway.parameters() if isinstance(p, DTensor)}
        try:
            parameters = [p for p in throwaway.parameters() if p.requires_grad]
            for parameter in parameters:
                parameter.grad = torch.zeros_like(parameter)
            if state.optimizer is not None and parameters:
                step_a_copy(state.optimizer, parameters)
        finally:
            for mesh in meshes.values():
                for dim in range(mesh.ndim):
                    dist.destroy_process_group(mesh.get_group(dim))
            forget_earlier_meshes()

    def agree_gradients_complete(self) -> None:
        """Return once every worker of this worker's shard group (its node's row of an HSDP mesh, the
        whole world for FSDP) has finished its backward; raise where one cannot.

        Why: each shard index's gradients are all-reduced over its own replicate group, so a peer
        lost mid-backward can fail that collective on some shard indices and not on others. A worker
        whose collective completed would apply its step while its node-mates could not: the node's
        shards would then sit at two steps, and no one state could be made of them. After this
        agreement a worker applies the step only if its whole row can, so every row holds all of
        its shards at one step. One small all-reduce per step, on the training backend."""
        import torch.distributed as dist

        if self.mesh is None or self.shard_dim is None or self.mesh.size(self.shard_dim) < 2:
            return  # a row of one worker cannot be split
        dist.all_reduce(torch.ones(1, device=self._device), group=self.mesh.get_group(self.shard_dim))

    def replica_group(self) -> Any:
        """The process group of the workers that hold this worker's shard (None: no replicas)."""
        return None if self.replicate_dim is None else self.mesh.get_group(self.replicate_dim)


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (no memory): the
    deep copy is told, through its memo, to take a meta tensor for each of them."""
    memo: dict[int, Any] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def step_a_copy(optimizer: torch.optim.Optimizer, parameters: list[nn.Parameter]) -> None:
    """One step of ``optimizer``'s algorithm over ``parameters`` (their gradients set), taken by a
    shallow copy of it made anew by ``Optimizer.__init__``: one parameter group with the optimizer's
    defaults, no state, no hooks of its own. The optimizer itself (its parameters, its state, its
    hooks, a learning-rate scheduler's wrapper of its ``step``) is not touched: the class's
    ``step`` is called on the copy."""
    clone = copy.copy(optimizer)
    torch.optim.Optimizer.__init__(clone, parameters, optimizer.defaults)
    type(optimizer).step(clone)


def rebind_optimizer(optimizer: torch.optim.Optimizer, old_parameters: dict[str, nn.Parameter],
                     new_parameters: dict[str, nn.Parameter], keep_state: bool) -> None:
    """Point ``optimizer`` at the new parameters (matched to the old ones by name), its per-parameter
    state moved onto them (the same local tensors on the new mesh), or dropped (``keep_state``
    False: the state will be received)."""
    from torch.distributed.tensor import DTensor

    name_of = {id(p): name for name, p in old_parameters.items()}
    moved = {}
    for group in optimizer.param_groups:
        group["params"] = [new_parameters[name_of[id(p)]] for p in group["params"]]
    for parameter, values in optimizer.state.items():
        target = new_parameters[name_of[id(parameter)]]
        if not keep_state or not isinstance(parameter, DTensor):
            continue  # a plain parameter's optimizer state before the first wrap: nothing trained yet
        moved[target] = {key: _onto(value, target) for key, value in values.items()}
    optimizer.state = collections.defaultdict(dict, moved)


def _onto(value: Any, parameter: Any) -> Any:
    """An optimizer state value of a parameter, as a DTensor of ``parameter``'s mesh if it was one."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return value
    return DTensor.from_local(value.to_local(), parameter.device_mesh, parameter.placements,
                              shape=value.shape, stride=value.stride(), run_check=False)
