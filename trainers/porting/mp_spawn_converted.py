"""mp_spawn.py converted to one process per worker: what elasticctl (and torchrun) run.

What changed, and nothing else:

* no ``mp.spawn``: the launcher starts the processes, and calls the script once in each;
* the rank and world size come from the environment (RANK, WORLD_SIZE; LOCAL_RANK picks the GPU),
  not from the spawn's index and ``--nprocs``;
* ``init_process_group`` without ``init_method`` (the same as ``"env://"``): MASTER_ADDR and
  MASTER_PORT come from the launcher too, so ``--port`` is gone.

Run it::

    elasticctl up --nnodes 1 --nproc-per-node 2 trainers/porting/mp_spawn_converted.py
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def worker(steps):
    dist.init_process_group("gloo")  # was: init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=...
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        x = torch.randn(32, 16)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"rank {rank} (local rank {os.environ['LOCAL_RANK']}): trained {steps} steps at world size "
          f"{world_size}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    worker(args.steps)  # was: mp.spawn(worker, args=(args.nprocs, args.port, args.steps), nprocs=args.nprocs)
