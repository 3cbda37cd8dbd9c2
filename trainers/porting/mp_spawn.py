"""A script that starts its own workers with ``torch.multiprocessing.spawn``, as the tutorials wrote it.

``python trainers/porting/mp_spawn.py`` trains on this host with ``--nprocs`` processes that meet
at ``init_method="tcp://127.0.0.1:PORT"``. Under elasticctl this cannot work: elasticctl (torchrun)
already starts one process per worker, and each of them would spawn a job of its own (on several
nodes, all waiting at one address that only rank 0's host serves). So a worker that calls
``torch.multiprocessing.spawn`` (or ``start_processes``) ends at once, saying the fix, and its node
stops instead of restarting it. mp_spawn_converted.py is this script converted.

One line more than the tutorials: each worker leaves with ``os._exit(0)`` once it is done. torch's
gloo backend can abort a process at interpreter exit ("terminate called without an active
exception", one run in five on a loaded two-core host): a gloo worker thread frees the last
gradient all-reduce, which holds a Python object from the backward pass, while Python finalizes, and
cannot take the GIL. Under elasticctl the worker entry tells such an abort after a finished script
from a failure; a script started with ``python`` has nobody to.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def worker(rank, world_size, port, steps):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = DDP(nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        x = torch.randn(32, 16)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    if rank == 0:
        print(f"trained {steps} steps at world size {world_size}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # see the module's docstring: done, and nothing of Python's teardown is needed


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--port", type=int, default=29512)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    mp.spawn(worker, args=(args.nprocs, args.port, args.steps), nprocs=args.nprocs)
