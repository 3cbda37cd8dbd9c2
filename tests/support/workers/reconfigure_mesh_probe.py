"""One worker of tests/process/test_torch_reconfigure.py's HSDP mesh test: a 2-D mesh of
reconfigurable groups that outlives a node's join and its leave, with the FSDP2 module wrapped on
it once.

    reconfigure_mesh_probe.py COORD_PORT NAME        (NAME: a0 a1 b0 b1: node, then local rank)

Every worker starts alone, as a hot-mode worker does: its default group
(elasticctl.train.groups.reconfigure.ReconfigurableGroup) and its two mesh groups
(elasticctl.train.groups.reconfigure.MeshGroups: made alone with ``new_group`` on that group, whose
``enable_reconfigure`` they inherit). Each generation reconfigures all three in place, the mesh
groups over the generation's HSDP layout (elasticctl.train.sharding.shards.hsdp_layout), on a store the
generation's host keeps:

1. node a (a0 a1): the world and the shard group over a0 a1, each replicate group over one of
   them; the mesh made from the two groups (``DeviceMesh.from_group``), ``fully_shard`` on it,
   one step;
2. node b joins: the world over all four, replicate group i over a_i b_i, b's shard group over
   b0 b1; b wraps on a mesh from its own groups; the replicas' shards go to b over the replicate
   group (``group_src``: group ranks, as the mapping torch keeps from global ranks is the one the
   group was made with); one step;
3. node b leaves: a's groups reconfigured over a alone (each replicate group over one worker
   again); one step on the mesh and module of generation 1.

Each step's gradient is the mean of rank + 1 over the data-parallel workers, so its value says over
how many FSDP2 averaged (torch takes both divide factors from the live groups' sizes). Results go
to the coordination store under ``result/<NAME>/<what>`` as JSON.
"""

from __future__ import annotations

import datetime
import json
import sys

import torch
import torch.distributed as dist
from torch import nn

from elasticctl.train.groups.reconfigure import (
    MeshDim,
    MeshGroups,
    ReconfigurableGroup,
    handles_of,
    mesh_handles_of,
)
from elasticctl.train.sharding.shards import hsdp_layout

TIMEOUT = datetime.timedelta(seconds=30)
RANKS = {"a0": 0, "a1": 1, "b0": 2, "b1": 3}
WORKERS_PER_NODE = 2


def main() -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    port, name = int(sys.argv[1]), sys.argv[2]
    node = name[0]
    coord = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)

    def result(what: str, value) -> None:
        coord.set(f"result/{name}/{what}", json.dumps(value))

    world = ReconfigurableGroup("gloo", TIMEOUT)
    mesh_groups = MeshGroups(world)
    replicate, shard = mesh_groups.groups[MeshDim.REPLICATE], mesh_groups.groups[MeshDim.SHARD]
    result("inherit", [dist._supports_reconfigure(replicate), dist._supports_reconfigure(shard)])
    stores = []

    def form(number: int, members: list[str]) -> None:
        """Generation ``number`` of ``members`` (rank = position) on a store a0 hosts (it never
        leaves here): the world, then both mesh groups, over the generation's HSDP layout."""
        if name == "a0":
            stores.append(dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT, wait_for_workers=False))
            coord.set(f"store/{number}", str(stores[-1].port))
            store = stores[-1]
        else:
            store = dist.TCPStore("127.0.0.1", int(coord.get(f"store/{number}")), is_master=False, timeout=TIMEOUT)
        prefixed = dist.PrefixStore(f"generation-{number}", store)
        rank = members.index(name)
        world.reconfigure(number, handles_of(prefixed, rank, len(members), world.handle), prefixed)
        rows = hsdp_layout([f"{member[0]}.{member[1]}" for member in members], len(members), WORKERS_PER_NODE)
        mesh_groups.reconfigure(number, rows, rank,
                                mesh_handles_of(prefixed, rank, len(members), mesh_groups.handles()), prefixed)

    def step(model: nn.Module, optimizer: torch.optim.Optimizer, number: int) -> None:
        model.zero_grad()
        model(torch.full((1, 8), float(dist.get_rank() + 1))).sum().backward()
        result(f"grad{number}", sorted({round(v, 4) for v in model.weight.grad.to_local().flatten().tolist()}))
        optimizer.step()
        result(f"weights{number}", round(model.weight.full_tensor().sum().item(), 5))

    def wrap(rows: int):
        layout = torch.arange(rows * WORKERS_PER_NODE).reshape(rows, WORKERS_PER_NODE)
        mesh = DeviceMesh.from_group([replicate, shard], "cpu", mesh=layout, mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        model = nn.Linear(8, 4, bias=False)
        fully_shard(model, mesh=mesh)
        return mesh, model, torch.optim.SGD(model.parameters(), lr=0.1)

    if node == "a":  # generation 1: node a alone
        form(1, ["a0", "a1"])
        mesh, model, optimizer = wrap(1)
        kept = (id(mesh), id(model))
        step(model, optimizer, 1)
        coord.set(f"g1-done/{name}", "1")
    else:
        coord.wait(["g1-done/a0", "g1-done/a1"])

    form(2, list(RANKS))  # generation 2: node b joins
    if node == "b":
        mesh, model, optimizer = wrap(2)
    # torch's own map of each group's members, kept true by MeshGroups (b's groups were made alone)
    result("bookkeeping2", [dist.get_rank(replicate), dist.get_rank(shard),
                            dist.get_process_group_ranks(replicate), dist.get_process_group_ranks(shard)])
    dist.broadcast(model.weight.to_local(), group=replicate, group_src=0)  # a's shard to b's same shard index
    step(model, optimizer, 2)
    if node == "b":
        coord.set(f"g2-done/{name}", "1")
        return
    coord.wait(["g2-done/b0", "g2-done/b1"])

    form(3, ["a0", "a1"])  # generation 3: node b has left
    step(model, optimizer, 3)
    result("kept", (id(mesh), id(model)) == kept)
    result("sizes", [dist.get_world_size(), replicate.size(), shard.size()])
    coord.set(f"g3-done/{name}", "1")
    coord.wait(["g3-done/a0", "g3-done/a1"])  # a0 hosts the stores: it leaves last
    world.destroy()


if __name__ == "__main__":
    main()
