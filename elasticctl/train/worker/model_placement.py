"""The model's place in each generation: the state brought in sync among the generation's
members (:mod:`elasticctl.train.recovery.state_sync`), then the model wrapped on the generation's group:
the runtime's DDP (kept on a group reconfigured in place when no newcomer joined), the script's
own wrap, or a sharded model re-wrapped on the generation's mesh (:mod:`elasticctl.train.sharding.shards`),
with the in-memory peer copies of its shards (:mod:`elasticctl.train.sharding.buddy_copies`)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elasticctl.errors import ConfigError
from elasticctl.train.watches.ddp_hooks import observe_buckets
from elasticctl.train.group import Group
from elasticctl.train.sharding.buddy_copies import PeerCopies
from elasticctl.train.sharding.shards import ShardedModel, is_sharded
from elasticctl.train.state import State
from elasticctl.train.recovery.state_sync import GenerationStateSync
from elasticctl.train.worker.place import WorkerPlace

log = logging.getLogger(__name__)


class ModelPlacement:
    """``state``'s model in each generation of the worker at ``place``. ``wrap``: the script's
    (None: the runtime's DDP); ``sharded``: False, True (the wrap shards) or "hsdp" (on the
    runtime's HSDP mesh, kept where the groups are reconfigured in place)."""

    def __init__(self, state: State, place: WorkerPlace, *, wrap: Callable[[torch.nn.Module, Group], torch.nn.Module]
                 | None, sharded: bool | str, bucket_bytes: int, restore_from_checkpoint: Callable[..., Any],
                 emit: Callable[..., None], bucket_observers: Callable[[], tuple]) -> None:
        if sharded not in (False, True, "hsdp"):
            raise ConfigError(f"run(..., sharded={sharded!r}) is not one of False, True or 'hsdp'.")
        if sharded and (wrap is None or state.optimizer is None):
            raise ConfigError("run(..., sharded=True) needs the wrap that shards the model (wrap=...) and an "
                              "optimizer in the state.")
        if state.peer_copies and not sharded:
            raise ConfigError("State(peer_copies=...) is for a sharded model (run(..., sharded=True)); a replicated "
                              "model's replicas already are its copies.")
        self.state = state
        self.place = place
        self._wrap = wrap
        self._bucket_observers = bucket_observers
        self._emit = emit
        # sharded="hsdp": the wrap shards on hsdp_mesh(group), a mesh kept across generations where
        # the groups are reconfigured in place; else each generation's mesh is new (train/sharding/shards.py).
        self.keeps_mesh = sharded == "hsdp"
        self.sharded = ShardedModel(wrap) if sharded else None
        # In-memory copies of the shards, on a buddy (train/sharding/buddy_copies.py); None: not asked for.
        self.peer_copies = (PeerCopies(state.peer_copies, worker=place.worker, timeout=place.pg_timeout,
                                       bucket_bytes=bucket_bytes, emit=emit) if state.peer_copies else None)
        self._wrapped: tuple[Any, torch.nn.Module] | None = None  # (the group it was wrapped on, the DDP)
        self.sync = GenerationStateSync(state, device=place.device,
                                        transport=place.transport,
                                        bucket_bytes=bucket_bytes, restore_from_checkpoint=restore_from_checkpoint,
                                        emit=emit, worker=place.worker, sharded=self.sharded,
                                        peer_copies=self.peer_copies)

    def warm_up(self, make_group_alone: Callable[[], object] | None) -> bool:
        """Hot mode with a kept HSDP mesh (``make_group_alone``: how to make the worker's group
        alone, None where its generations do not reconfigure one): before its first generation,
        make this worker's group (alone, as the first reconfigure would) and run a throwaway
        sharded step in that world of one (ShardedModel.warm_up), so that a worker joining a
        running job does not make the running workers wait through torch's first-use costs. A
        warm-up that fails costs nothing but the time: the first generation pays those costs
        instead. Whether it made the group the first generation reconfigures."""
        if self.sharded is None or not self.keeps_mesh or make_group_alone is None:
            return False
        started, place, made = time.monotonic(), self.place, False
        try:
            make_group_alone()
            made = True
            alone = Group(number=0, rank=0, world_size=1, local_rank=place.local_rank, device=place.device,
                          model=self.state.model, members=(place.worker,), local_world_size=1,
                          timeout=place.pg_timeout)
            self.sharded.warm_up(self.state, alone)
        except Exception as exc:  # noqa: BLE001 - torch's errors of a script's own wrap or optimizer
            log.warning("[%s] the sharded warm-up before joining failed (the first generation pays its cost "
                        "instead): %s", place.worker, " ".join(str(exc).split())[:300])
            return made
        self._emit("warmed_up", seconds=round(time.monotonic() - started, 3))
        return True

    def after_failure_on_kept_group(self) -> None:
        """The group is kept, not the modules a failed step left half-way: DDP is wrapped anew on
        it, a sharded model re-wrapped on the same kept mesh (its caches stay warm)."""
        self._wrapped = None
        if self.sharded is not None:
            self.sharded.after_failure = True

    def freeze(self) -> None:
        """The generation ends: a copy round still out commits nothing now."""
        if self.peer_copies is not None:
            self.peer_copies.freeze()

    def enter(self, group: Group, reconfigured_in_place: bool,
              mark: Callable[[str], None]) -> tuple[Group, tuple[int, ...]]:
        """The state in sync among ``group``'s members and the model wrapped on it; the group with
        its model (and shard), and the ranks the state came from. ``mark``: each recovery phase as
        it ends."""
        state = self.state
        if self.sharded is not None:
            # The shards move between the modules of this generation's mesh: wrapped first.
            held = state.step if state.live else -1  # whether or not its shards still fit
            self.sync.rewrap(group)
            mark("module_kept" if self.sharded.kept else "rewrapped")
            group = dataclasses.replace(group, shard=self.sharded.position.index)
            sent_from = self.sync.sync_shards(group.rank, group.world_size, group.number, held)
            model = state.model
        else:
            # DDP broadcasts rank 0's parameters when it wraps: the state is in sync before.
            sent_from = self.sync.sync_state(group.rank, group.world_size, group.number)
            model = (self._wrapped_in_ddp(state.model, group, reconfigured_in_place) if self._wrap is None
                     else self._wrap(state.model, group))
            if self._wrap is not None and is_sharded(model):
                raise ConfigError("The wrap sharded the model (its parameters are DTensors): pass "
                                  "run(..., sharded=True), so that checkpoints and hot recovery move shards.")
        mark("state_synced")
        if state.sampler is not None:  # the global position stays; the deal changes
            state.sampler.num_replicas, state.sampler.rank = group.world_size, group.rank
        return dataclasses.replace(group, model=model), sent_from

    def before_step_applied(self, hot: bool) -> None:
        """Hot mode, sharded model: the workers of each shard group agree that all of their
        gradients arrived, so that a peer lost mid-backward leaves no node with its shards at two
        steps (:meth:`ShardedModel.agree_gradients_complete`)."""
        if self.sharded is not None and hot:
            self.sharded.agree_gradients_complete()

    def at_boundary(self, group: Group) -> None:
        if self.peer_copies is not None:
            self.peer_copies.at_boundary(self.state, self.sharded, group)

    def replica_set(self) -> int | None:
        """This worker's replica-set key for the replica check: every worker one set (DDP), the
        shard index on an HSDP mesh, None for a sharded model without replicas."""
        if self.sharded is None:
            return 0
        return self.sharded.position.index if self.sharded.replicate_dim is not None else None

    def _wrapped_in_ddp(self, model: torch.nn.Module, group: Group, reconfigured_in_place: bool) -> torch.nn.Module:
        """The default wrapping (DDP), timing this worker's own part of each step when the job
        watches for stragglers (the hook's why: elasticctl.train.watches.stragglers). On a group
        reconfigured in place the DDP it was wrapped on goes on: its reducer follows the group's
        live size (tests/process/test_torch_reconfigure.py), as long as no newcomer joined: a
        DDP's first steps run collectives of their own (the bucket order is agreed from rank 0
        after the first), so with a newcomer every member wraps anew, on the same group."""
        world = dist.group.WORLD if dist.is_initialized() else None
        if self._wrapped is not None and world is not None and self._wrapped[0] is world and self.sync.continued:
            return self._wrapped[1]
        # On a reconfigurable group no collective at the wrap: the state sync already made every
        # replica equal.
        wrapped = observe_buckets(ddp(model, group, init_sync=not reconfigured_in_place), self._bucket_observers())
        self._wrapped = (world, wrapped) if reconfigured_in_place else None
        return wrapped


def ddp(model: torch.nn.Module, group: Group, init_sync: bool = True) -> torch.nn.Module:
    """``model`` in torch's DDP on the generation's group (itself in a world of one with no group)."""
    if group.world_size == 1 and not dist.is_initialized():
        return model
    return DistributedDataParallel(model, device_ids=[group.local_rank] if group.device.type == "cuda" else None,
                                   init_sync=init_sync)

