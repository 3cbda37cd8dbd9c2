"""Generations of one HSDP mesh shape in which the two workers swap ranks (as after a lost node
re-forms the survivors), with a generation whose layout is refused between them (its workers
named as two half nodes): each wraps its model with elasticctl's ShardedModel.rewrap, trains a
step, and prints one JSON line per generation (its rank, shard index, or the error).

    python mesh_generations.py WORKER PORT1 PORT2 PORT3 [--keep-caches]

``--keep-caches`` leaves torch's DTensor caches as the previous generation left them (what
rewrap did before it emptied them): the guard must then refuse the stale mesh."""

from __future__ import annotations

import datetime
import json
import sys
import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from elasticctl.train.sharding import shards
from elasticctl.train.sharding.shards import ShardedModel, hsdp_mesh
from elasticctl.train.state import State


def wrap(model, group):
    return fully_shard(model, mesh=hsdp_mesh(group))


def generation(number: int, rank: int, port: int, sharded: ShardedModel, state: State,
               members: tuple[str, ...]) -> dict:
    store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0, wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"generation-{number}", store), rank=rank, world_size=2)
    group = types.SimpleNamespace(members=members, mesh_groups=None, world_size=2, local_world_size=2,
                                  device=torch.device("cpu"), timeout=datetime.timedelta(seconds=60))
    try:
        sharded.rewrap(state, group)
        state.model(torch.ones(3, 4)).sum().backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        return {"generation": number, "rank": rank, "shard": sharded.position.index}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"generation": number, "rank": rank, "error": type(exc).__name__, "message": str(exc)}
    finally:
        dist.destroy_process_group()


def main() -> None:
    worker, ports = int(sys.argv[1]), [int(port) for port in sys.argv[2:5]]
    if "--keep-caches" in sys.argv:
        shards.forget_earlier_meshes = lambda: None
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    state = State(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    state.live = True
    sharded = ShardedModel(wrap)
    whole, halves = ("a.0", "a.1"), ("a.0", "b.0")
    for number, rank, members in ((1, worker, whole), (2, worker, halves), (3, 1 - worker, whole)):
        print(json.dumps(generation(number, rank, ports[number - 1], sharded, state, members)), flush=True)


if __name__ == "__main__":
    main()
