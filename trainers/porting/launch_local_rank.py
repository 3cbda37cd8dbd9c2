"""A script written for ``python -m torch.distributed.launch``, as the tutorials wrote it: unchanged.

It reads its local rank from ``--local_rank`` (what ``torch.distributed.launch`` passed; newer
torch spells it ``--local-rank``) or, written for ``--use_env``, from the LOCAL_RANK variable,
joins the group with ``init_method="env://"``, and trains a small model with DDP and a
DistributedSampler. Run it as it is::

    elasticctl up --nnodes 1 --nproc-per-node 2 --legacy-local-rank trainers/porting/launch_local_rank.py
    elasticctl up --nnodes 1 --nproc-per-node 2 trainers/porting/launch_local_rank.py   # --use_env style

``--legacy-local-rank`` hands each worker ``--local_rank=N`` as the launcher did; without it
the script finds LOCAL_RANK in its environment, which elasticctl (torchrun) always sets. Nothing
here resumes: see ddp_resumable.py for the few lines that make it pick up where it stopped.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                    help="this worker's GPU on its node (default: $LOCAL_RANK, as with --use_env)")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=32)
args = parser.parse_args()
# Where the rank came from, so that a run shows which style it was (not part of the tutorial).
source = "--local_rank" if any(a.startswith(("--local_rank", "--local-rank")) for a in sys.argv[1:]) else "LOCAL_RANK"

if torch.cuda.is_available():
    torch.cuda.set_device(args.local_rank)
    device, backend = torch.device("cuda", args.local_rank), "nccl"
else:
    device, backend = torch.device("cpu"), "gloo"
dist.init_process_group(backend=backend, init_method="env://")
rank, world_size = dist.get_rank(), dist.get_world_size()
print(f"rank {rank} of {world_size}: local rank {args.local_rank} from {source}", flush=True)

torch.manual_seed(0)
x = torch.randn(1024, 16)
dataset = TensorDataset(x, x.sum(dim=1, keepdim=True))
sampler = DistributedSampler(dataset)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
model = DDP(model, device_ids=[args.local_rank] if device.type == "cuda" else None)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for inputs, targets in loader:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs.to(device)), targets.to(device))
        loss.backward()
        optimizer.step()
    if rank == 0:
        print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)

dist.barrier()  # every rank is past its last all-reduce before any of them closes its connections
dist.destroy_process_group()
