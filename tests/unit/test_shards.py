"""A sharded model re-wrapped for a new generation (elasticctl.train.sharding.shards) in a world of one:
the new module continues bit for bit where the old one was (parameters, optimizer state), and
its local shards travel and load back as DTensors of the receiver's own mesh."""

from __future__ import annotations

import copy
import datetime
import types

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from elasticctl.train.sharding.local_shards import LocalShards
from elasticctl.train.sharding.shards import REPLICATE_DIM, SHARD_DIM, ShardedModel, hsdp_mesh, is_sharded
from elasticctl.train.state import State


MESH_TIMEOUT = datetime.timedelta(seconds=17)


def group():
    return types.SimpleNamespace(members=(), mesh_groups=None, world_size=1, local_world_size=1, device=torch.device("cpu"),
                                 timeout=MESH_TIMEOUT)


def shard(model, group):
    mesh = hsdp_mesh(group)
    fully_shard(model[0], mesh=mesh)
    return fully_shard(model, mesh=mesh)


def make_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    model.register_buffer("scale", torch.tensor([2.0]))
    return State(model, torch.optim.AdamW(model.parameters(), lr=0.01))


def train(state, steps):
    for step in range(steps):
        torch.manual_seed(100 + state.step)
        (state.model(torch.randn(3, 4)) * state.model.scale).sum().backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        state.step += 1


def local(model):
    return [p.to_local().detach().clone() for p in model.parameters()]


@pytest.mark.usefixtures("process_group")
def test_a_rewrapped_model_trains_on_bit_for_bit_like_the_one_it_replaces():
    reference, rewrapped = make_state(), make_state()
    for state in (reference, rewrapped):
        state.live = True
        sharded = ShardedModel(shard)
        assert sharded.rewrap(state, group()) and is_sharded(state.model)
        train(state, 3)
    original = rewrapped.model
    assert sharded.rewrap(rewrapped, group()), "the same shard of as many: kept"
    assert rewrapped.model is not original and rewrapped.live
    assert {id(p) for g in rewrapped.optimizer.param_groups for p in g["params"]} == {
        id(p) for p in rewrapped.model.parameters()}
    train(reference, 2)
    train(rewrapped, 2)
    for mine, theirs in zip(local(rewrapped.model), local(reference.model), strict=True):
        assert torch.equal(mine, theirs)
    assert torch.equal(rewrapped.model.scale, torch.tensor([2.0]))


@pytest.mark.usefixtures("process_group")
def test_local_shards_load_back_as_dtensors_of_the_receivers_mesh():
    sender, receiver = make_state(), make_state()
    for state in (sender, receiver):
        ShardedModel(shard).rewrap(state, group())
    sender.live = True
    train(sender, 2)
    received = copy.deepcopy(LocalShards(sender).state_dict())  # a transfer's copy, not views of the sender's
    assert not any(isinstance(v, DTensor) for v in received["model"].values())
    assert isinstance(received["optimizer"]["state"][0]["exp_avg"], torch.Tensor)
    LocalShards(receiver).load_state_dict(received)  # a joiner: no optimizer state of its own yet
    assert receiver.step == 2 and receiver.live
    assert all(torch.equal(a, b) for a, b in zip(local(receiver.model), local(sender.model), strict=True))
    moment = receiver.optimizer.state[next(iter(receiver.model.parameters()))]["exp_avg"]
    assert isinstance(moment, DTensor)
    train(sender, 1)
    train(receiver, 1)
    assert all(torch.equal(a, b) for a, b in zip(local(receiver.model), local(sender.model), strict=True))


@pytest.mark.usefixtures("process_group")
def test_the_mesh_groups_give_up_at_the_generations_timeout_not_torchs_default():
    """torch builds a mesh's dimension groups with its 30-minute default unless the options of
    ``DeviceMesh(backend_override=...)`` carry a timeout: pinned here, since a frozen peer stalls a
    sharded job's survivors for as long as these groups wait."""
    mesh = hsdp_mesh(group())
    for dim in (REPLICATE_DIM, SHARD_DIM):
        backend = mesh.get_group(dim)._get_backend(torch.device("cpu"))
        assert backend.options._timeout == MESH_TIMEOUT, dim


@pytest.mark.usefixtures("process_group")
def test_a_warm_up_touches_neither_the_model_nor_its_optimizer_and_leaves_no_group_behind():
    """What a joiner runs before its admission (ShardedModel.warm_up): a throwaway wrap and step."""
    import torch.distributed as dist

    state = make_state()
    train(state, 1)  # optimizer state of its own, to see that it is kept
    before = [p.detach().clone() for p in state.model.parameters()]
    optimizer_state = copy.deepcopy(state.optimizer.state_dict())
    hooks_called = []
    state.optimizer.register_step_pre_hook(lambda *args: hooks_called.append(args))
    groups_before = len(dist.distributed_c10d._world.pg_map)

    ShardedModel(shard).warm_up(state, group())

    assert all(torch.equal(a, b) for a, b in zip(before, state.model.parameters(), strict=True))
    assert not any(isinstance(p, DTensor) for p in state.model.parameters()), "the script's model stays whole"
    after = state.optimizer.state_dict()
    assert after["param_groups"] == optimizer_state["param_groups"]
    assert all(torch.equal(after["state"][i][k], v) for i, s in optimizer_state["state"].items() for k, v in s.items())
    assert hooks_called == [], "the optimizer's own hooks do not run for the throwaway step"
    assert len(dist.distributed_c10d._world.pg_map) == groups_before, "the throwaway mesh's groups are destroyed"
    # and the real wrap after it trains on as it would have
    reference = make_state()
    train(reference, 1)
    for candidate in (state, reference):
        candidate.live = True
        ShardedModel(shard).rewrap(candidate, group())
        train(candidate, 2)
    assert all(torch.equal(a, b) for a, b in zip(local(state.model), local(reference.model), strict=True))


@pytest.mark.usefixtures("process_group")
def test_a_warm_up_after_an_earlier_wrap_whose_groups_are_gone_builds_on_its_own_mesh():
    """torch's DTensor caches key on mesh equality: an earlier wrap on an equal mesh, whose groups
    were destroyed since, must not hand the warm-up's throwaway that mesh (the groups would not
    resolve: "Could not resolve the process group registered under the name N")."""
    import torch.distributed as dist

    earlier = make_state()
    earlier.live = True
    ShardedModel(shard).rewrap(earlier, group())
    train(earlier, 1)
    earlier_mesh = next(earlier.model.parameters()).device_mesh
    groups_before = len(dist.distributed_c10d._world.pg_map)
    for dim in range(earlier_mesh.ndim):
        dist.destroy_process_group(earlier_mesh.get_group(dim))
    assert len(dist.distributed_c10d._world.pg_map) == groups_before - 2

    ShardedModel(shard).warm_up(make_state(), group())

    assert len(dist.distributed_c10d._world.pg_map) == groups_before - 2, "the throwaway's own groups are destroyed"
