"""The resumable DDP script of docs/porting.md ("DDP with DistributedSampler, made resumable"),
filled in.

Above the marker: what the page leaves to the reader (the imports, a tiny model, its data, the
loss and the flags). Below it: the page's code block, as written (the guide's unit tests check
they are the same; its process tests run this file under `python` and under `elasticctl up` in
restart mode, the mode of a script with a loop of its own).
"""

import argparse

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


generator = torch.Generator().manual_seed(0)
dataset = TensorDataset(torch.randn(256, 8, generator=generator),
                        torch.randint(0, 2, (256,), generator=generator))
loss_fn = nn.CrossEntropyLoss()


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    parser.add_argument("--checkpoint-dir", default=None, help="default: the one elasticctl hands out")
    return parser.parse_args()


# -- the page's code block --------------------------------------------------------------------
from elasticctl.train.checkpoint import Checkpointer
from elasticctl.train.sampler import ResumableSampler
from elasticctl.train.script import GracefulStop, checkpoint_dir, init, run_main

def main(args):
    ctx = init(timeout=60)                       # the process group from the environment; cuda:LOCAL_RANK or CPU
    model = Net().to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    sampler = ResumableSampler(dataset)          # DistributedSampler that saves its place in the epoch
    ckpt = Checkpointer(checkpoint_dir(args.checkpoint_dir), device=ctx.device)
    restored = ckpt.restore(model=model, optimizer=opt, sampler=sampler)   # None on the first start
    step, epoch = (restored.step, restored.epoch) if restored else (0, 0)
    ddp = DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None)
    stop = GracefulStop()                        # SIGTERM (leave, down, preemption): a final checkpoint
    while epoch < args.epochs:
        for x, y in DataLoader(dataset, batch_size=32, sampler=sampler):
            loss = loss_fn(ddp(x.to(ctx.device)), y.to(ctx.device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sampler.advance(len(x))
            step += 1
            if step % args.checkpoint_every == 0:
                ckpt.save(step, epoch, model=model, optimizer=opt, sampler=sampler)
            if stop.agreed(ctx.device):
                ckpt.save(step, epoch, model=model, optimizer=opt, sampler=sampler, blocking=True)
                stop.exit()                      # the leaving ranks exit 0; the others re-form without them
        epoch += 1
        sampler.set_epoch(epoch)

run_main(main, parse_args())                     # one-line errors; a bad flag exits 2 (no restart)
