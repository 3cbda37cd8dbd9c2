"""One worker of tests/process/test_torch_reconfigure.py's HSDP mesh test: a 2-D mesh of
reconfigurable groups that outlives a node's join and its leave, with the FSDP2 module wrapped on
it once.

    reconfigure_mesh_probe.py COORD_PORT NAME        (NAME: a0 a1 b0 b1: node, then local rank)

Every worker starts alone, as a hot-mode worker does: its default group
(elasticctl.train.reconfigure.ReconfigurableGroup) and two groups for the mesh's dimensions, each
made alone (``new_group([0], use_local_synchronization=True)`` on that group: it inherits
``enable_reconfigure``) and reconfigured alone once. Generations then reconfigure all three in
place, each over its members' handles, on a store the generation's host keeps:

1. node a (a0 a1): the world and the shard group over a0 a1, the mesh made from the two groups
   (``DeviceMesh.from_group``), ``fully_shard`` on it, one step;
2. node b joins: the world over all four, replicate group i over a_i b_i, b's shard group over
   b0 b1; b wraps on a mesh from its own groups; the replicas' shards go to b over the replicate
   group (``group_src``: group ranks, as the mapping torch keeps from global ranks is the one the
   group was made with); one step;
3. node b leaves: a's world and replicate groups reconfigured over a alone; one step.

Each step's gradient is the mean of rank + 1 over the data-parallel workers, so its value says over
how many FSDP2 averaged (torch takes both divide factors from the live groups' sizes). Results go
to the coordination store under ``result/<NAME>/<what>`` as JSON.
"""

from __future__ import annotations

import datetime
import json
import secrets
import sys

import torch
import torch.distributed as dist
from torch import nn

from elasticctl.train.reconfigure import ReconfigurableGroup

TIMEOUT = datetime.timedelta(seconds=30)
RANKS = {"a0": 0, "a1": 1, "b0": 2, "b1": 3}


def main() -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    port, name = int(sys.argv[1]), sys.argv[2]
    node, local = name[0], int(name[1])
    coord = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)

    def result(what: str, value) -> None:
        coord.set(f"result/{name}/{what}", json.dumps(value))

    world = ReconfigurableGroup("gloo", TIMEOUT)
    replicate = dist.new_group([0], use_local_synchronization=True, timeout=TIMEOUT)
    shard = dist.new_group([0], use_local_synchronization=True, timeout=TIMEOUT)
    result("inherit", [dist._supports_reconfigure(replicate), dist._supports_reconfigure(shard)])
    for group in (replicate, shard):  # a group that never reconfigured hands over (rank 0, no uuid), as every other
        dist._reconfigure(secrets.randbits(40) + (1 << 41), [dist._get_reconfigure_handle(group)], group=group,
                          timeout=TIMEOUT).wait()
    stores = []

    def store_of(number: int) -> dist.Store:
        """Generation ``number``'s store, hosted by a0 (which never leaves here)."""
        if name == "a0":
            stores.append(dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT, wait_for_workers=False))
            coord.set(f"store/{number}", str(stores[-1].port))
            return stores[-1]
        return dist.TCPStore("127.0.0.1", int(coord.get(f"store/{number}")), is_master=False, timeout=TIMEOUT)

    def reconfigure(group, what: str, members: list[str], uuid: int, store: dist.Store) -> None:
        """``group`` re-formed over ``members`` (rank = position); each group's exchange under a prefix of its own."""
        coord.set(f"handle/{what}/{name}", dist._get_reconfigure_handle(group))
        handles = [coord.get(f"handle/{what}/{member}").decode() for member in members]
        world.store.point_at(dist.PrefixStore(what, store))
        dist._reconfigure(uuid, handles, group=group, timeout=TIMEOUT).wait()

    def reconfigure_world(number: int, members: list[str], store: dist.Store) -> None:
        coord.set(f"handle/{number}/{name}", world.handle)
        world.reconfigure(number, [coord.get(f"handle/{number}/{member}").decode() for member in members],
                          dist.PrefixStore(f"g{number}", store))

    def step(model: nn.Module, optimizer: torch.optim.Optimizer, number: int) -> None:
        model.zero_grad()
        model(torch.full((1, 8), float(dist.get_rank() + 1))).sum().backward()
        result(f"grad{number}", sorted({round(v, 4) for v in model.weight.grad.to_local().flatten().tolist()}))
        optimizer.step()
        result(f"weights{number}", round(model.weight.full_tensor().sum().item(), 5))

    def wrap(layout: torch.Tensor):
        mesh = DeviceMesh.from_group([replicate, shard], "cpu", mesh=layout, mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        model = nn.Linear(8, 4, bias=False)
        fully_shard(model, mesh=mesh)
        return mesh, model, torch.optim.SGD(model.parameters(), lr=0.1)

    if node == "a":  # generation 1: node a alone
        store = store_of(1)
        reconfigure_world(1, ["a0", "a1"], store)
        reconfigure(shard, "g1-shard", ["a0", "a1"], 11, store)
        mesh, model, optimizer = wrap(torch.arange(2).reshape(1, 2))
        kept = (id(mesh), id(model))
        step(model, optimizer, 1)
        coord.set(f"g1-done/{name}", "1")
    else:
        coord.wait(["g1-done/a0", "g1-done/a1"])

    store = store_of(2)  # generation 2: node b joins
    reconfigure_world(2, list(RANKS), store)
    reconfigure(replicate, f"g2-replicate-{local}", [f"a{local}", f"b{local}"], 20 + local, store)
    if node == "b":
        reconfigure(shard, "g2-shard-b", ["b0", "b1"], 22, store)
        mesh, model, optimizer = wrap(torch.arange(4).reshape(2, 2))
    dist.broadcast(model.weight.to_local(), group=replicate, group_src=0)  # a's shard to b's same shard index
    step(model, optimizer, 2)
    if node == "b":
        coord.set(f"g2-done/{name}", "1")
        return
    coord.wait(["g2-done/b0", "g2-done/b1"])

    store = store_of(3)  # generation 3: node b has left
    reconfigure_world(3, ["a0", "a1"], store)
    reconfigure(replicate, f"g3-replicate-{local}", [name], 30 + local, store)
    step(model, optimizer, 3)
    result("kept", (id(mesh), id(model)) == kept)
    result("sizes", [dist.get_world_size(), replicate.size(), shard.size()])
    coord.set(f"g3-done/{name}", "1")
    coord.wait(["g3-done/a0", "g3-done/a1"])  # a0 hosts the stores: it leaves last
    world.destroy()


if __name__ == "__main__":
    main()
