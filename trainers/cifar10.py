"""The classic CIFAR-10 tutorial CNN, made elastic.

Same network as PyTorch's "Training a classifier" tutorial (conv 3->6->16,
5x5 kernels, fc 120->84->10), trained data-parallel under ``elasticctl up`` or
plain ``torchrun``, on elasticctl's worker runtime (:mod:`elasticctl.train`).
What the usual multi-GPU version of the tutorial gets wrong under elastic
membership is handled there: it always resumes from the newest complete
checkpoint (no ``--resume``), mid-epoch and at any world size, without repeating
or skipping samples; checkpoints load onto this worker's device; SIGTERM saves a
final checkpoint and exits 0. With ``elasticctl up --recovery hot`` survivors of
a lost node keep training in their processes and joiners get the state from a
peer.

Per epoch, rank 0 reports the training loss averaged over all ranks and the
test accuracy. ``--fake-data`` trains on torchvision's FakeData for offline use.
``--sync-bn`` adds BatchNorm after each convolution and synchronises its
statistics across workers (SyncBatchNorm needs CUDA; on CPU the BatchNorm stays
per-worker, with a warning).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import itertools
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
from torch.utils.data import DataLoader, Dataset, Subset

import elasticctl.train as elastic
from elasticctl.errors import ConfigError
from elasticctl.train.sampler import ResumableSampler
from elasticctl.train.script import LR_POLICIES, plan_batches, restart_count, run_main


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
    parser.add_argument("--pg-timeout", type=float, default=None,
                        help="process-group timeout in seconds (default: 60; with --recovery hot, the node TTL)")
    parser.add_argument("--record", default=None, help="rank 0 appends one JSON line per epoch and event here")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps in total (for benchmarks)")


def check_training_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name, minimum in (("epochs", 1), ("batch_size", 1), ("workers", 0), ("checkpoint_every", 0), ("keep", 1)):
        value = getattr(args, name)
        if value < minimum:
            parser.error(f"--{name.replace('_', '-')} ({value}) must be at least {minimum}.")
    if args.lr <= 0:
        parser.error(f"--lr ({args.lr:g}) must be positive.")
    if args.pg_timeout is not None and args.pg_timeout <= 0:
        parser.error(f"--pg-timeout ({args.pg_timeout:g}) must be positive.")


def cosine(epochs: int):
    return lambda epoch: 0.5 * (1 + math.cos(math.pi * min(epoch, epochs) / epochs))


def evaluate(model: nn.Module, test_set: Dataset, group: elastic.Group, batch_size: int, workers: int,
             amp: bool) -> float:
    """Top-1 accuracy over the whole test set, each rank scoring a disjoint shard."""
    shard = Subset(test_set, range(group.rank, len(test_set), group.world_size))
    correct_total = torch.zeros(2, dtype=torch.float64, device=group.device)
    model.eval()
    with torch.no_grad(), torch.autocast(group.device.type, enabled=amp):
        for images, labels in DataLoader(shard, batch_size=batch_size, num_workers=workers):
            labels = labels.to(group.device, non_blocking=True)
            predicted = model(images.to(group.device, non_blocking=True)).argmax(dim=1)
            correct_total += torch.tensor([(predicted == labels).sum().item(), labels.numel()],
                                          dtype=torch.float64, device=group.device)
    model.train()
    dist.all_reduce(correct_total)
    return (correct_total[0] / correct_total[1]).item()


def fit(args: argparse.Namespace, model: nn.Module, train_set: Dataset, test_set: Dataset, *,
        amp: bool = False) -> None:
    """Train ``model`` for ``args.epochs`` on elasticctl's runtime (restart or hot recovery):
    resumable, elastic, checkpointed; rank 0 reports per epoch."""
    from tqdm import tqdm

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    restart = restart_count()
    record = open(args.record, "a", buffering=1) if args.record else None  # noqa: SIM115 - open for the run
    where = {"rank": 0, "world_size": 1}  # the generation (hot mode: it changes)
    before_training: list[dict] = []  # a restore happens before the first generation's ranks are known

    def write(entry: dict) -> None:
        if record is not None and where["rank"] == 0:
            record.write(json.dumps({**entry, "world_size": where["world_size"], "restart": restart,
                                     "pid": os.getpid(), "time": time.time()}) + "\n")

    def on_event(kind: str, **fields) -> None:  # the runtime's resume, checkpoint, final_checkpoint
        (before_training.append if kind == "resume" else write)({"event": kind, **fields})

    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    sampler = ResumableSampler(train_set, seed=args.seed)
    # epoch_loss: this rank's loss sum and batch count over the epoch so far
    state = elastic.State(model, optimizer, scaler=torch.amp.GradScaler(device.type, enabled=amp), sampler=sampler,
                          global_batch=args.global_batch, epoch_loss=[0.0, 0])
    criterion = nn.CrossEntropyLoss()
    schedule = cosine(args.epochs)  # per epoch, on top of the world size's LR
    started = False

    def end_of_epoch(group: elastic.Group) -> None:
        """Report the epoch, then open the next; re-entered after a failure, it runs again."""
        epoch = sampler.epoch
        loss_sum = torch.tensor(state.epoch_loss, dtype=torch.float64, device=device)
        dist.all_reduce(loss_sum)  # mean over every batch of every rank
        train_loss = (loss_sum[0] / loss_sum[1]).item() if loss_sum[1] else float("nan")
        # The bare model: shards differ in length, and DDP's forward is a collective.
        accuracy = evaluate(model, test_set, group, args.batch_size, args.workers, amp)
        if group.rank == 0:
            print(f"epoch {epoch} step {state.step} loss {train_loss:.4f} test accuracy {accuracy:.4f} "
                  f"world {group.world_size} restart {restart}", flush=True)
        write({"event": "epoch", "epoch": epoch, "step": state.step, "train_loss": train_loss,
               "test_accuracy": accuracy})
        sampler.set_epoch(epoch + 1)
        state.epoch_loss = [0.0, 0]
        state.checkpoint()

    def generation(state: elastic.State, group: elastic.Group) -> None:
        nonlocal started
        where.update(rank=group.rank, world_size=group.world_size)
        if not started:
            started = True
            for entry in before_training:
                write(entry)
            write({"event": "start", "step": state.step, "epoch": sampler.epoch})
        state.global_batch = args.global_batch or state.global_batch or args.batch_size * group.world_size
        plan = plan_batches(args.lr_policy, args.lr, args.batch_size, group.world_size, state.global_batch)
        loader = DataLoader(train_set, batch_size=plan.micro_batch, sampler=sampler, num_workers=args.workers,
                            pin_memory=device.type == "cuda")
        while sampler.epoch < args.epochs and (args.max_steps is None or state.step < args.max_steps):
            if sampler.epoch_done:
                end_of_epoch(group)
                continue
            for param_group in optimizer.param_groups:  # this world size's LR, on the epoch's schedule
                param_group["lr"] = plan.lr * schedule(sampler.epoch)
            batches = iter(tqdm(loader, desc=f"epoch {sampler.epoch}", disable=group.rank != 0, leave=False,
                                mininterval=1))
            while not sampler.epoch_done and (args.max_steps is None or state.step < args.max_steps):
                micro_batches = list(itertools.islice(batches, plan.accumulation))
                if not micro_batches:
                    break
                optimizer.zero_grad(set_to_none=True)  # a step a failure cut short left gradients behind
                loss_sum, samples = 0.0, 0
                for i, (images, labels) in enumerate(micro_batches):
                    # Gradients are all-reduced once per step, on its last micro-batch.
                    last = i == len(micro_batches) - 1
                    with contextlib.nullcontext() if last else getattr(group.model, "no_sync", contextlib.nullcontext)():
                        with torch.autocast(device.type, enabled=amp):
                            loss = criterion(group.model(images.to(device, non_blocking=True)),
                                             labels.to(device, non_blocking=True))
                        state.scaler.scale(loss / len(micro_batches)).backward()
                    loss_sum += loss.item()
                    samples += len(labels)
                state.epoch_loss = [state.epoch_loss[0] + loss_sum, state.epoch_loss[1] + len(micro_batches)]
                state.commit(samples=samples, loss=loss_sum / len(micro_batches))

    try:
        elastic.run(state, generation, checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                    keep=args.keep, async_checkpoint=args.async_checkpoint, pg_timeout=args.pg_timeout,
                    on_event=on_event)
        if sampler.epoch >= args.epochs or (args.max_steps is not None and state.step >= args.max_steps):
            write({"event": "done", "step": state.step, "epoch": sampler.epoch})
    finally:
        if record is not None:
            record.close()


def cifar10_datasets(args: argparse.Namespace) -> tuple[Dataset, Dataset]:
    import torchvision
    from torchvision import transforms

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
    if args.fake_data:
        fake = torchvision.datasets.FakeData
        return (fake(args.fake_size, (3, 32, 32), 10, transform),
                fake(max(args.fake_size // 5, 1), (3, 32, 32), 10, transform, random_offset=1 << 20))
    try:
        os.makedirs(args.data_dir, exist_ok=True)
        # One download per host: the workers of a node take turns, and the later ones find it there.
        with open(os.path.join(args.data_dir, ".download.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return (torchvision.datasets.CIFAR10(args.data_dir, train=True, transform=transform, download=True),
                    torchvision.datasets.CIFAR10(args.data_dir, train=False, transform=transform, download=True))
    except Exception as exc:
        raise ConfigError(f"CIFAR-10 is not in '{args.data_dir}' and could not be downloaded ({exc}); "
                          "use --fake-data offline.") from exc


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
    model = Net(batch_norm=args.sync_bn)
    if args.sync_bn:
        if torch.cuda.is_available():
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        elif int(os.environ.get("RANK", "0")) == 0:
            print("warning: SyncBatchNorm needs CUDA; BatchNorm statistics stay per-worker on CPU.", file=sys.stderr)
    train_set, test_set = cifar10_datasets(args)
    fit(args, model, train_set, test_set)


def main() -> None:
    run_main(train, parse_args())


if __name__ == "__main__":
    main()
