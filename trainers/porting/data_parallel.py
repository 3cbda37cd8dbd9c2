"""A single-process multi-GPU script with ``nn.DataParallel``, as the tutorials wrote it.

DataParallel splits each batch over the GPUs of this one process and never talks to another
process, so under elasticctl every worker (every node) trains a model of its own: it runs, and
the job's size buys nothing. elasticctl names it at the first forward, on stderr and as a
``script_warning`` event in the job's history (``elasticctl events``)::

    elasticctl: warning: nn.DataParallel only splits each batch over this process's GPUs, ...;
    replace it with model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    after torch.distributed.init_process_group() (no device_ids on the CPU).

The conversion, in this script: call ``torch.distributed.init_process_group()`` first, take
``local_rank = int(os.environ["LOCAL_RANK"])`` (and ``torch.cuda.set_device(local_rank)``), replace
the DataParallel line as the warning says, and give the DataLoader a ``DistributedSampler``
(elasticctl's ``ResumableSampler`` to resume mid-epoch: ddp_resumable.py).
"""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
model = nn.DataParallel(model).to(device)  # every GPU of this process; on the CPU it runs the model as is
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
torch.manual_seed(0)
for step in range(args.steps):
    x = torch.randn(64, 16, device=device)
    loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(f"trained {args.steps} steps, loss {loss.item():.4f}", flush=True)
