"""Plain DDP + DistributedSampler, made resumable with elasticctl's helpers.

The script is the DDP tutorial's: ``init_process_group``, a DistributedSampler, DDP, a loop over
epochs. Without a checkpoint every change of membership (a node lost, a node joining) restarts it
from step 0. The lines marked ``# elasticctl`` make it resume from the newest checkpoint instead:

* ``ResumableSampler`` for ``DistributedSampler`` (a subclass, same arguments): its position in
  the epoch is one global count, so it resumes mid-epoch at any world size;
* ``checkpoint_dir``: the script's flag, else the job's ``--checkpoint-dir``;
* ``Checkpointer``: ``restore`` at the start (every rank gets the same newest complete
  checkpoint), ``save`` every ``--checkpoint-every`` steps (rank 0 writes);
* ``GracefulStop``: SIGTERM (a membership change in restart mode, ``leave``, ``down``) ends the
  step, writes a final checkpoint and exits, so nothing trained is lost;
* ``run_main``: a peer leaving or a bad flag exits in one line instead of a traceback.

Run it::

    elasticctl up --nnodes 1:2 --checkpoint-dir /shared/ckpt trainers/porting/ddp_resumable.py
    elasticctl join --etcd HOST:2379              # on a second node (or in a second terminal)

Rank 0 prints where it started (``resumed from step S`` or ``starting at step 0``), each
checkpoint it saved and, every ``--log-every`` steps, the step, epoch, loss and world size.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

try:
    import elasticctl  # noqa: F401
except ImportError:  # run from a source checkout without `pip install`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from elasticctl.train.checkpoint import Checkpointer  # elasticctl
from elasticctl.train.sampler import ResumableSampler  # elasticctl: was DistributedSampler
from elasticctl.train.script import GracefulStop, checkpoint_dir, run_main  # elasticctl


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--dataset-size", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--log-every", type=int, default=20, help="rank 0 prints every N steps")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="checkpoint and resume here (default: the job's --checkpoint-dir)")  # elasticctl
    parser.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")  # elasticctl
    parser.add_argument("--step-sleep", type=float, default=0.0,
                        help="seconds to sleep after each step, to watch a short run (tests use it)")
    args = parser.parse_args()
    for name in ("epochs", "batch_size", "dataset_size", "log_every", "checkpoint_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be at least 1.")
    return args


def main(args):
    if torch.cuda.is_available():
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        local_rank, device, backend = 0, torch.device("cpu"), "gloo"
    dist.init_process_group(backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    x = torch.randn(args.dataset_size, 16)
    dataset = TensorDataset(x, x.sum(dim=1, keepdim=True))
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    sampler = ResumableSampler(dataset)  # elasticctl: was DistributedSampler(dataset)

    directory = checkpoint_dir(args.checkpoint_dir)  # elasticctl
    checkpoints = Checkpointer(directory, device=device) if directory else None  # elasticctl
    restored = checkpoints.restore(model=model, optimizer=optimizer, sampler=sampler) if checkpoints else None  # elasticctl
    step = restored.step if restored else 0  # elasticctl
    stop = GracefulStop()  # elasticctl
    if rank == 0:
        print(f"resumed from step {step} (epoch {sampler.epoch}) at world size {world_size}" if restored
              else f"starting at step 0 at world size {world_size}", flush=True)

    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    while sampler.epoch < args.epochs:
        for inputs, targets in loader:  # a resumed epoch deals only the samples not trained yet
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(inputs.to(device)), targets.to(device))
            loss.backward()
            optimizer.step()
            sampler.advance(len(inputs))  # elasticctl: the position a checkpoint saves
            step += 1
            if rank == 0 and step % args.log_every == 0:
                print(f"step {step} epoch {sampler.epoch} loss {loss.item():.4f} world {world_size}", flush=True)
            stopping = stop.agreed()  # elasticctl: some rank got SIGTERM; every rank stops at this step
            if checkpoints and (stopping or step % args.checkpoint_every == 0):  # elasticctl
                checkpoints.save(step, sampler.epoch, model=model, optimizer=optimizer, sampler=sampler)
                if rank == 0:
                    print(f"saved a {'final ' if stopping else ''}checkpoint at step {step}", flush=True)
            if stopping:  # elasticctl
                stop.exit()  # exits 0 where SIGTERM arrived; elsewhere run_main exits 1 and the agent restarts it
            time.sleep(args.step_sleep)
        sampler.set_epoch(sampler.epoch + 1)
    if rank == 0:
        print(f"done: {args.epochs} epochs, step {step}", flush=True)
    dist.barrier()  # every rank is past its last all-reduce before any of them closes its connections
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main, parse_args())  # elasticctl: was main(parse_args())
