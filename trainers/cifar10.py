"""The classic CIFAR-10 tutorial CNN, made elastic.

Same network as PyTorch's "Training a classifier" tutorial (conv 3->6->16,
5x5 kernels, fc 120->84->10), trained data-parallel under ``elasticctl up`` or
plain ``torchrun``. What the usual multi-GPU version of the tutorial gets wrong
under elastic membership is handled by elasticctl's worker library: it always
resumes from the newest complete checkpoint (no ``--resume``), mid-epoch and at
any world size, without repeating or skipping samples; checkpoints load onto
this worker's device; SIGTERM saves a final checkpoint and exits 0.

Per epoch, rank 0 reports the training loss averaged over all ranks and the
test accuracy. ``--fake-data`` trains on torchvision's FakeData for offline use.
``--sync-bn`` adds BatchNorm after each convolution and synchronises its
statistics across workers (SyncBatchNorm needs CUDA; on CPU the BatchNorm stays
per-worker, with a warning).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

import torch
from torch import nn

try:
    import elasticctl  # noqa: F401
except ImportError:  # run from a source checkout without `pip install`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset

from elasticctl.checkpoint import Checkpointer
from elasticctl.errors import ConfigError
from elasticctl.progress import ProgressPublisher
from elasticctl.sampler import ResumableSampler
from elasticctl.worker import (
    LR_POLICIES,
    GracefulStop,
    WorkerContext,
    checkpoint_dir,
    init,
    plan_batches,
    run,
    shutdown,
)


class Net(nn.Module):
    """The tutorial's CNN; ``batch_norm`` adds BatchNorm after each convolution."""

    def __init__(self, batch_norm: bool = False) -> None:
        super().__init__()
        norm = nn.BatchNorm2d if batch_norm else (lambda channels: nn.Identity())
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 5), norm(6), nn.ReLU(), nn.MaxPool2d(2, 2),
            nn.Conv2d(6, 16, 5), norm(16), nn.ReLU(), nn.MaxPool2d(2, 2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def add_training_flags(parser: argparse.ArgumentParser, batch_size: int, lr: float, epochs: int) -> None:
    """Flags shared by the epoch-based trainers (this one and resnet.py)."""
    parser.add_argument("--epochs", type=int, default=epochs, help="epochs to train in total")
    parser.add_argument("--batch-size", type=int, default=batch_size, help="per-worker batch size")
    parser.add_argument("--lr", type=float, default=lr, help="learning rate of one worker (see --lr-policy)")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--lr-policy", choices=LR_POLICIES, default="linear",
                        help="on resize: 'linear' scales the LR with the world size at a fixed per-worker "
                             "batch; 'constant-batch' keeps the global batch and LR via gradient accumulation")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="global batch for constant-batch (default: batch size x world size at first start)")
    parser.add_argument("--workers", type=int, default=2, help="data-loading processes per worker")
    parser.add_argument("--seed", type=int, default=0, help="seed of the per-epoch shuffle")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="checkpoint and resume here (default: $ELASTICCTL_CHECKPOINT_DIR; none: no checkpoints)")
    parser.add_argument("--checkpoint-every", type=int, default=200,
                        help="also checkpoint every N steps within an epoch (0: only at epoch ends)")
    parser.add_argument("--async-checkpoint", action="store_true", help="write checkpoints in a background thread")
    parser.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    parser.add_argument("--pg-timeout", type=float, default=120.0, help="process-group timeout in seconds")
    parser.add_argument("--record", default=None, help="rank 0 appends one JSON line per epoch and event here")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps in total (for benchmarks)")


def check_training_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name, minimum in (("epochs", 1), ("batch_size", 1), ("workers", 0), ("checkpoint_every", 0), ("keep", 1)):
        value = getattr(args, name)
        if value < minimum:
            parser.error(f"--{name.replace('_', '-')} ({value}) must be at least {minimum}.")
    if args.lr <= 0:
        parser.error(f"--lr ({args.lr:g}) must be positive.")
    if args.pg_timeout <= 0:
        parser.error(f"--pg-timeout ({args.pg_timeout:g}) must be positive.")


def cosine(epochs: int):
    return lambda epoch: 0.5 * (1 + math.cos(math.pi * min(epoch, epochs) / epochs))


def evaluate(model: nn.Module, test_set: Dataset, ctx: WorkerContext, batch_size: int, workers: int,
             amp: bool) -> float:
    """Top-1 accuracy over the whole test set, each rank scoring a disjoint shard."""
    shard = Subset(test_set, range(ctx.rank, len(test_set), ctx.world_size))
    correct_total = torch.zeros(2, dtype=torch.float64, device=ctx.device)
    model.eval()
    with torch.no_grad(), torch.autocast(ctx.device.type, enabled=amp):
        for images, labels in DataLoader(shard, batch_size=batch_size, num_workers=workers):
            labels = labels.to(ctx.device, non_blocking=True)
            predicted = model(images.to(ctx.device, non_blocking=True)).argmax(dim=1)
            correct_total += torch.tensor([(predicted == labels).sum().item(), labels.numel()],
                                          dtype=torch.float64, device=ctx.device)
    model.train()
    dist.all_reduce(correct_total)
    return (correct_total[0] / correct_total[1]).item()


def fit(args: argparse.Namespace, ctx: WorkerContext, model: nn.Module, train_set: Dataset, test_set: Dataset,
        *, amp: bool = False, name: str = "train") -> None:
    """Train ``model`` for ``args.epochs``: resumable, elastic, checkpointed; rank 0 reports per epoch."""
    from tqdm import tqdm

    rank, world, device = ctx.rank, ctx.world_size, ctx.device
    stop = GracefulStop()
    record = open(args.record, "a", buffering=1) if args.record and rank == 0 else None  # noqa: SIM115 - open for the run

    def write(entry: dict) -> None:
        if record is not None:
            record.write(json.dumps({**entry, "world_size": world, "restart": ctx.restart, "time": time.time()}) + "\n")

    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine(args.epochs))  # stepped per epoch
    scaler = torch.amp.GradScaler(device.type, enabled=amp)
    sampler = ResumableSampler(train_set, seed=args.seed)
    directory = checkpoint_dir(args.checkpoint_dir)
    checkpointer = (Checkpointer(directory, keep=args.keep, async_save=args.async_checkpoint, device=device)
                    if directory else None)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler, "sampler": sampler}

    step, global_batch = 0, args.global_batch
    restored = checkpointer.restore(**state) if checkpointer else None
    if restored:
        step = restored.step
        global_batch = global_batch or restored.extra.get("global_batch")
        write({"event": "resume", "step": step, "epoch": sampler.epoch, "consumed": sampler.consumed,
               "from_world_size": restored.world_size})
    global_batch = global_batch or args.batch_size * world
    plan = plan_batches(args.lr_policy, args.lr, args.batch_size, world, global_batch)
    # The checkpoint's LRs belong to the world that wrote it: rebase the schedule on this one.
    scheduler.base_lrs = [plan.lr] * len(optimizer.param_groups)
    for group in optimizer.param_groups:
        group["lr"] = plan.lr * scheduler.lr_lambdas[0](scheduler.last_epoch)

    ddp = DistributedDataParallel(model, device_ids=[ctx.local_rank] if device.type == "cuda" else None)
    loader = DataLoader(train_set, batch_size=plan.micro_batch, sampler=sampler, num_workers=args.workers,
                        pin_memory=device.type == "cuda", persistent_workers=False)
    progress = ProgressPublisher.from_env(rank)
    criterion = nn.CrossEntropyLoss()

    def save(blocking: bool | None = None) -> None:
        began = time.perf_counter()
        checkpointer.save(step, sampler.epoch, extra={"global_batch": global_batch}, blocking=blocking, **state)
        write({"event": "checkpoint", "step": step, "epoch": sampler.epoch, "consumed": sampler.consumed,
               "blocked_ms": round((time.perf_counter() - began) * 1000, 2)})

    def final_checkpoint_and_exit() -> None:
        if checkpointer:
            checkpointer.wait()
            if checkpointer.last_step != step:
                save(blocking=True)
            write({"event": "final_checkpoint", "step": step})
        stop.exit()

    write({"event": "start", "step": step, "epoch": sampler.epoch})
    try:
        while sampler.epoch < args.epochs and (args.max_steps is None or step < args.max_steps):
            epoch = sampler.epoch
            loss_sum = torch.zeros(2, dtype=torch.float64, device=device)  # this rank's loss sum, batches
            started, samples_before = time.monotonic(), sampler.consumed
            batches = tqdm(loader, desc=f"epoch {epoch}", disable=rank != 0, leave=False, mininterval=1)
            pending = 0
            for images, labels in batches:
                images = images.to(device, non_blocking=True)
                labels = labels.to(device, non_blocking=True)
                pending += 1
                last_micro = pending == plan.accumulation or sampler.remaining <= plan.micro_batch * world
                # Gradients are all-reduced once per step, on its last micro-batch.
                with ddp.no_sync() if not last_micro else contextlib.nullcontext():
                    with torch.autocast(device.type, enabled=amp):
                        loss = criterion(ddp(images), labels)
                    scaler.scale(loss / plan.accumulation).backward()
                sampler.advance(len(labels))
                loss_sum += torch.tensor([loss.item(), 1.0], dtype=torch.float64, device=device)
                if not last_micro:
                    continue
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                pending, step = 0, step + 1
                if rank == 0:
                    batches.set_postfix(loss=f"{loss.item():.3f}", step=step)
                if progress:
                    elapsed = time.monotonic() - started
                    progress.publish(step=step, epoch=epoch, loss=loss.item(),
                                     samples_per_s=(sampler.consumed - samples_before) / elapsed if elapsed else None,
                                     world_size=world, last_checkpoint_step=checkpointer and checkpointer.last_step)
                if (checkpointer and args.checkpoint_every and step % args.checkpoint_every == 0
                        and not sampler.epoch_done):  # the epoch-end checkpoint follows
                    save()
                if stop.agreed(device):
                    final_checkpoint_and_exit()
                if args.max_steps is not None and step >= args.max_steps:
                    break
            if not sampler.epoch_done:  # --max-steps cut the epoch short
                break
            scheduler.step()
            dist.all_reduce(loss_sum)  # mean over every batch of every rank
            train_loss = (loss_sum[0] / loss_sum[1]).item() if loss_sum[1] else float("nan")
            # The bare model: shards differ in length, and DDP's forward is a collective.
            accuracy = evaluate(model, test_set, ctx, args.batch_size, args.workers, amp)
            sampler.set_epoch(epoch + 1)
            if rank == 0:
                print(f"epoch {epoch} step {step} loss {train_loss:.4f} test accuracy {accuracy:.4f} "
                      f"world {world} restart {ctx.restart}", flush=True)
            write({"event": "epoch", "epoch": epoch, "step": step, "train_loss": train_loss,
                   "test_accuracy": accuracy})
            if checkpointer:
                save()
            if stop.agreed(device):
                final_checkpoint_and_exit()
        if checkpointer:
            checkpointer.close()
    finally:
        if progress:
            progress.close()
    write({"event": "done", "step": step, "epoch": sampler.epoch})
    if record is not None:
        record.close()
    shutdown()


def cifar10_datasets(args: argparse.Namespace, ctx: WorkerContext) -> tuple[Dataset, Dataset]:
    import torchvision
    from torchvision import transforms

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
    if args.fake_data:
        fake = torchvision.datasets.FakeData
        return (fake(args.fake_size, (3, 32, 32), 10, transform),
                fake(max(args.fake_size // 5, 1), (3, 32, 32), 10, transform, random_offset=1 << 20))
    if ctx.local_rank == 0:  # one download per host; the others wait and read it
        try:
            torchvision.datasets.CIFAR10(args.data_dir, train=True, download=True)
            torchvision.datasets.CIFAR10(args.data_dir, train=False, download=True)
        except Exception as exc:
            raise ConfigError(f"CIFAR-10 is not in '{args.data_dir}' and could not be downloaded ({exc}); "
                              "use --fake-data offline.") from exc
    dist.barrier()
    return (torchvision.datasets.CIFAR10(args.data_dir, train=True, transform=transform),
            torchvision.datasets.CIFAR10(args.data_dir, train=False, transform=transform))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="./data", help="where CIFAR-10 is (or is downloaded to)")
    parser.add_argument("--fake-data", action="store_true", help="train on torchvision FakeData (offline)")
    parser.add_argument("--fake-size", type=int, default=5000, help="training images of --fake-data")
    parser.add_argument("--sync-bn", action="store_true", help="BatchNorm after each conv, synchronised across workers")
    add_training_flags(parser, batch_size=32, lr=0.01, epochs=10)
    args = parser.parse_args(argv)
    check_training_flags(parser, args)
    if args.fake_size < 1:
        parser.error(f"--fake-size ({args.fake_size}) must be at least 1.")
    return args


def train(args: argparse.Namespace) -> None:
    ctx = init(timeout=args.pg_timeout)
    model = Net(batch_norm=args.sync_bn)
    if args.sync_bn:
        if ctx.device.type == "cuda":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        elif ctx.rank == 0:
            print("warning: SyncBatchNorm needs CUDA; BatchNorm statistics stay per-worker on CPU.", file=sys.stderr)
    train_set, test_set = cifar10_datasets(args, ctx)
    fit(args, ctx, model, train_set, test_set)


def main() -> None:
    run(train, parse_args())


if __name__ == "__main__":
    main()
