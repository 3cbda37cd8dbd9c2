"""A tiny synthetic MLP trainer: the workhorse of elasticctl's tests and benchmarks.

Runs under plain ``torchrun`` or ``elasticctl``; CPU/gloo or GPU/NCCL. The
dataset is a fixed synthetic regression set (``--dataset-size`` samples) read
through elasticctl's resumable sampler, so a run that loses or gains nodes
mid-epoch continues the epoch without repeating or skipping samples.

With a checkpoint directory (``--checkpoint-dir`` or ELASTICCTL_CHECKPOINT_DIR)
it always resumes from the newest complete checkpoint there and checkpoints
every ``--checkpoint-every`` steps, at the end, and on SIGTERM (then exits 0).

``--record FILE``: every rank appends one JSON line per step (step, epoch,
rank, world size, restart count, loss, samples seen, the step's sample indices,
...) plus events (resume, checkpoint, final checkpoint, done), which tests
assert on. ``--exit-at`` schedules a failure for fault tests.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import socket
import sys
import time

import psutil
import torch
from torch import nn

try:
    import elasticctl  # noqa: F401
except ImportError:  # run from a source checkout without `pip install`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from elasticctl.checkpoint import Checkpointer
from elasticctl.progress import ProgressPublisher
from elasticctl.sampler import ResumableSampler
from elasticctl.worker import (
    LR_POLICIES,
    GracefulStop,
    checkpoint_dir,
    init,
    plan_batches,
    reduce_mean,
    run,
    shutdown,
)

EXIT_MODES = ("kill", "exception", "hang")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000, help="total optimizer steps to train, then exit 0")
    parser.add_argument("--batch-size", type=int, default=32, help="per-worker batch size")
    parser.add_argument("--dataset-size", type=int, default=4096, help="samples per epoch")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate of one worker (see --lr-policy)")
    parser.add_argument("--lr-policy", choices=LR_POLICIES, default="linear",
                        help="on resize: 'linear' scales the LR with the world size at a fixed per-worker "
                             "batch; 'constant-batch' keeps the global batch and LR via gradient accumulation")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="global batch for --lr-policy constant-batch "
                             "(default: batch size x world size at the first start)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and the per-epoch shuffle")
    parser.add_argument("--step-sleep", type=float, default=0.0,
                        help="extra seconds per step, to stretch a test run")
    parser.add_argument("--log-every", type=int, default=50, help="rank 0 prints progress every N steps (0: never)")
    parser.add_argument("--record", default=None, help="append one JSON line per rank and step here")
    parser.add_argument("--pg-timeout", type=float, default=60.0,
                        help="process-group timeout in seconds (short, so a lost peer is noticed)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="checkpoint and resume here (default: $ELASTICCTL_CHECKPOINT_DIR; none: no checkpoints)")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="checkpoint every N steps (0: only at the end)")
    parser.add_argument("--async-checkpoint", action="store_true", help="write checkpoints in a background thread")
    parser.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    parser.add_argument("--exit-at", type=int, default=None,
                        help="fault injection: at this step (first attempt only, restart count 0) ...")
    parser.add_argument("--exit-ranks", default="0", help="... these global ranks (comma-separated) ...")
    parser.add_argument("--exit-mode", choices=EXIT_MODES, default="kill",
                        help="... SIGKILL themselves, raise an exception, or hang")
    args = parser.parse_args(argv)
    for name, minimum in (("steps", 0), ("batch_size", 1), ("dataset_size", 1), ("hidden", 1),
                          ("checkpoint_every", 0), ("keep", 1), ("log_every", 0)):
        value = getattr(args, name)
        if value < minimum:
            parser.error(f"--{name.replace('_', '-')} ({value}) must be at least {minimum}.")
    if args.pg_timeout <= 0:
        parser.error(f"--pg-timeout ({args.pg_timeout:g}) must be positive.")
    if args.step_sleep < 0:
        parser.error(f"--step-sleep ({args.step_sleep:g}) must not be negative.")
    try:
        args.exit_ranks = {int(r) for r in args.exit_ranks.split(",") if r.strip()}
    except ValueError:
        parser.error(f"--exit-ranks ({args.exit_ranks}) must be comma-separated integers.")
    return args


def synthetic_dataset(size: int, seed: int) -> TensorDataset:
    """(index, x, y) with y = sum(x): the index lets the record name every sample trained."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 16, generator=generator)
    return TensorDataset(torch.arange(size), x, x.sum(dim=1, keepdim=True))


def inject_failure(mode: str, stop: GracefulStop) -> None:
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "exception":
        raise RuntimeError("fault injected by --exit-at")
    stop.restore_default()  # a hung worker still dies on the agent's SIGTERM
    while True:
        time.sleep(3600)


def train(args: argparse.Namespace) -> None:
    directory = checkpoint_dir(args.checkpoint_dir)
    ctx = init(timeout=args.pg_timeout)
    initialized = time.time()
    rank, world, device = ctx.rank, ctx.world_size, ctx.device
    stop = GracefulStop()
    record = open(args.record, "a", buffering=1) if args.record else None  # noqa: SIM115 - open for the run
    host, node = socket.gethostname(), os.environ.get("ELASTICCTL_NODE", "")
    group_rank = int(os.environ.get("GROUP_RANK", "0"))

    def write(entry: dict) -> None:
        if record is not None:
            record.write(json.dumps({**entry, "rank": rank, "world_size": world, "restart": ctx.restart,
                                     "time": time.time()}) + "\n")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    dataset = synthetic_dataset(args.dataset_size, args.seed)
    sampler = ResumableSampler(dataset, seed=args.seed)
    checkpointer = (Checkpointer(directory, keep=args.keep, async_save=args.async_checkpoint, device=device)
                    if directory else None)

    # Where a restarted worker's seconds go: process start -> torch imported, process group up.
    write({"event": "start", "process_started": psutil.Process().create_time(), "initialized": initialized})
    step, samples_seen, global_batch = 0, 0, args.global_batch
    restored = checkpointer.restore(model=model, optimizer=optimizer, sampler=sampler) if checkpointer else None
    if restored:
        step, samples_seen = restored.step, restored.extra["samples_seen"]
        global_batch = global_batch or restored.extra.get("global_batch")
        write({"event": "resume", "step": step, "epoch": sampler.epoch, "consumed": sampler.consumed,
               "from_world_size": restored.world_size, "path": str(restored.path)})
    global_batch = global_batch or args.batch_size * world
    plan = plan_batches(args.lr_policy, args.lr, args.batch_size, world, global_batch)
    for group in optimizer.param_groups:  # after restore: the LR belongs to this world size
        group["lr"] = plan.lr

    ddp = DistributedDataParallel(model, device_ids=[ctx.local_rank] if device.type == "cuda" else None)
    loader = DataLoader(dataset, batch_size=plan.micro_batch, sampler=sampler)
    progress = ProgressPublisher.from_env(rank)
    extra = {"global_batch": global_batch}

    def save(blocking: bool | None = None) -> None:
        began = time.perf_counter()
        checkpointer.save(step, sampler.epoch, model=model, optimizer=optimizer, sampler=sampler,
                          extra={**extra, "samples_seen": samples_seen}, blocking=blocking)
        if checkpointer.is_writer:  # blocked_ms: how long training stood still for this save
            write({"event": "checkpoint", "step": step, "epoch": sampler.epoch, "consumed": sampler.consumed,
                   "async": not blocking and args.async_checkpoint,
                   "blocked_ms": round((time.perf_counter() - began) * 1000, 2)})

    started, samples_at_start = time.monotonic(), samples_seen
    try:
        while step < args.steps:
            if sampler.epoch_done:
                sampler.set_epoch(sampler.epoch + 1)
            batches = iter(loader)
            while step < args.steps:
                micro_batches = list(itertools.islice(batches, plan.accumulation))
                if not micro_batches:
                    break
                if (args.exit_at is not None and step == args.exit_at and rank in args.exit_ranks
                        and ctx.restart == 0):
                    inject_failure(args.exit_mode, stop)
                consumed_before, loss_sum, indices = sampler.consumed, 0.0, []
                optimizer.zero_grad(set_to_none=True)
                for i, (index, x, y) in enumerate(micro_batches):
                    # Gradients are all-reduced once, on the last micro-batch of the step.
                    sync = contextlib.nullcontext() if i == len(micro_batches) - 1 else ddp.no_sync()
                    with sync:
                        loss = nn.functional.mse_loss(ddp(x.to(device)), y.to(device)) / len(micro_batches)
                        loss.backward()
                    loss_sum += loss.item()
                    indices += index.tolist()
                    sampler.advance(len(index))
                optimizer.step()
                samples_seen += sampler.consumed - consumed_before
                write({"step": step, "epoch": sampler.epoch, "loss": round(loss_sum, 5), "host": host,
                       "pid": os.getpid(), "node": node, "group_rank": group_rank,
                       "samples_seen": samples_seen, "consumed": sampler.consumed, "indices": indices})
                if args.log_every and (step % args.log_every == 0 or step == args.steps - 1):
                    mean_loss = reduce_mean(loss_sum, device)  # a collective: every rank takes part
                    if rank == 0:
                        print(f"step {step}/{args.steps} loss {mean_loss:.4f} world {world} restart {ctx.restart}",
                              flush=True)
                step += 1  # steps completed; a checkpoint taken now resumes at this step
                if progress:
                    elapsed = time.monotonic() - started
                    progress.publish(step=step, epoch=sampler.epoch, loss=loss_sum,
                                     samples_per_s=(samples_seen - samples_at_start) / elapsed if elapsed else None,
                                     world_size=world, last_checkpoint_step=checkpointer and checkpointer.last_step)
                if checkpointer and args.checkpoint_every and step % args.checkpoint_every == 0 and step < args.steps:
                    save()
                if stop.agreed(device):
                    if checkpointer:
                        checkpointer.wait()
                        if checkpointer.last_step != step:
                            save(blocking=True)
                        write({"event": "final_checkpoint", "step": step, "signalled": stop.requested})
                    if record is not None:
                        record.flush()
                    stop.exit()
                if args.step_sleep:
                    time.sleep(args.step_sleep)
        if checkpointer:
            checkpointer.wait()
            if checkpointer.last_step != step:
                save(blocking=True)
            checkpointer.close()
    finally:
        if progress:
            progress.close()
    write({"event": "done", "step": step, "samples_seen": samples_seen})
    if record is not None:
        record.close()
    shutdown()


def main() -> None:
    run(train, parse_args())


if __name__ == "__main__":
    main()
