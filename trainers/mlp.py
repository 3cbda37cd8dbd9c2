"""A tiny synthetic MLP trainer: the workhorse of elasticctl's tests and benchmarks.

Runs under plain ``torchrun`` or ``elasticctl``; CPU/gloo or GPU/NCCL. The
dataset is a fixed synthetic regression set (``--dataset-size`` samples) read
through elasticctl's resumable sampler, so a run that loses or gains nodes
mid-epoch continues the epoch without repeating or skipping samples.

It runs on elasticctl's worker runtime (:mod:`elasticctl.train`): in restart
mode (plain torchrun, or elasticctl without ``--recovery hot``) and in hot mode
alike. With a checkpoint directory (``--checkpoint-dir`` or
ELASTICCTL_CHECKPOINT_DIR) it resumes from the newest complete checkpoint there
and checkpoints every ``--checkpoint-every`` steps, at the end, and on SIGTERM
(then exits 0).

``--record FILE``: every rank appends one JSON line per step (step, epoch,
rank, world size, restart count, loss, samples seen, the step's sample indices,
...) plus events (resume, checkpoint, final checkpoint, done), which tests
assert on. ``--record-params`` adds to each step line the generation and a short
digest of the parameters before the step (equal on every replica: soaks check it).
``--exit-at`` schedules a failure for fault tests. ``--slow-node NODE=SECONDS[@FROM:TO]`` (a
test and bench knob, repeatable) makes that node's workers sleep SECONDS in each step (steps
FROM to TO-1 only, if given), a straggler: every node runs the same job spec, so the node is
named by its elasticctl node id rather than slowed by a flag of its own. ``--flip-bit STEP:RANK``
(a test knob) flips one bit of one parameter on that rank of the generation right after step
STEP's commit, once per process: silent corruption, for the replica check (``--replica-check``).
``--nan-at STEP:RANK[:WHAT]`` (a test knob) makes a NaN on that rank in step STEP, in its loss or
its gradients alone, before the all-reduce: for the non-finite check (``--skip-non-finite``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable

import psutil
import torch
from torch import nn

try:
    import elasticctl  # noqa: F401
except ImportError:  # run from a source checkout without `pip install`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch.utils.data import DataLoader, TensorDataset

import elasticctl.train as elastic
from elasticctl.job.environment import WorkerEnvironment
from elasticctl.train.script import LR_POLICIES, plan_batches, reduce_mean, restart_count, run_main

EXIT_MODES = ("kill", "exception", "hang")


def build_parser(description: str = __doc__) -> argparse.ArgumentParser:
    """The flags of this trainer, which trainers/lm.py shares (it adds its own)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    parser.add_argument("--slow-node", action="append", default=[], metavar="NODE=SECONDS[@FROM:TO]",
                        help="test/bench knob (repeatable): the workers of this node id sleep SECONDS in "
                             "each step (steps FROM to TO-1 only, if given): a straggler")
    parser.add_argument("--flip-bit", default=None, metavar="STEP:RANK",
                        help="test knob: the worker of this rank (of its generation) flips one bit of one "
                             "parameter right after step STEP's commit, once: silent corruption of one replica")
    parser.add_argument("--nan-at", default=None, metavar="STEP:RANK[:WHAT]",
                        help="test knob: the worker of this rank (of its generation) makes a NaN in step STEP, "
                             "once: in its loss (WHAT loss, the default; its gradients follow) or in its "
                             "gradients alone (WHAT gradients), before the all-reduce")
    parser.add_argument("--log-every", type=int, default=50, help="rank 0 prints progress every N steps (0: never)")
    parser.add_argument("--record", default=None, help="append one JSON line per rank and step here")
    parser.add_argument("--record-params", action="store_true",
                        help="add to each step line the generation and a sha256 digest (16 hex digits) "
                             "of the parameters before the step")
    parser.add_argument("--pg-timeout", type=float, default=None,
                        help="process-group timeout in seconds, short so a lost peer is noticed "
                             "(default: 60; with --recovery hot, the node TTL)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="checkpoint and resume here (default: $ELASTICCTL_CHECKPOINT_DIR; none: no checkpoints)")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="checkpoint every N steps (0: only at the end)")
    parser.add_argument("--async-checkpoint", action="store_true", help="write checkpoints in a background thread")
    parser.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    parser.add_argument("--exit-at", type=int, default=None,
                        help="fault injection: at this step (first attempt only: restart count 0, "
                             "and once per process) ...")
    parser.add_argument("--exit-ranks", default="0", help="... these global ranks (comma-separated) ...")
    parser.add_argument("--exit-mode", choices=EXIT_MODES, default="kill",
                        help="... SIGKILL themselves, raise an exception, or hang")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    return check_args(parser, parser.parse_args(argv))


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the shared flags checked (parser.error on a bad one) and decoded."""
    for name, minimum in (("steps", 0), ("batch_size", 1), ("dataset_size", 1), ("hidden", 1),
                          ("checkpoint_every", 0), ("keep", 1), ("log_every", 0)):
        value = getattr(args, name)
        if value < minimum:
            parser.error(f"--{name.replace('_', '-')} ({value}) must be at least {minimum}.")
    if args.pg_timeout is not None and args.pg_timeout <= 0:
        parser.error(f"--pg-timeout ({args.pg_timeout:g}) must be positive.")
    if args.step_sleep < 0:
        parser.error(f"--step-sleep ({args.step_sleep:g}) must not be negative.")
    args.slow_node = [_slow_node(parser, text) for text in args.slow_node]
    args.flip_bit = None if args.flip_bit is None else _flip_bit(parser, args.flip_bit)
    args.nan_at = None if args.nan_at is None else _nan_at(parser, args.nan_at)
    try:
        args.exit_ranks = {int(r) for r in args.exit_ranks.split(",") if r.strip()}
    except ValueError:
        parser.error(f"--exit-ranks ({args.exit_ranks}) must be comma-separated integers.")
    return args


def _slow_node(parser: argparse.ArgumentParser, text: str) -> tuple[str, float, range | None]:
    """``NODE=SECONDS[@FROM:TO]`` as (node, seconds, the steps slowed or None: every one)."""
    node, _, rest = text.partition("=")
    seconds, _, steps = rest.partition("@")
    try:
        value = float(seconds)
        first, _, last = steps.partition(":")
        slowed = range(int(first), int(last)) if steps else None
    except ValueError:
        value, slowed = -1.0, None
    if not node or not 0 <= value < 3600:
        parser.error(f"--slow-node ({text}) must be NODE=SECONDS[@FROM:TO] with 0 <= SECONDS < 3600 "
                     "and whole steps.")
    return node, value, slowed


def _flip_bit(parser: argparse.ArgumentParser, text: str) -> tuple[int, int]:
    """``STEP:RANK`` as (step, rank)."""
    step, colon, rank = text.partition(":")
    try:
        flip = int(step), int(rank)
    except ValueError:
        flip = (-1, -1)
    if not colon or min(flip) < 0:
        parser.error(f"--flip-bit ({text}) must be STEP:RANK, two whole numbers of at least 0.")
    return flip


NAN_PLACES = ("loss", "gradients")


def _nan_at(parser: argparse.ArgumentParser, text: str) -> tuple[int, int, str]:
    """``STEP:RANK[:WHAT]`` as (step, rank, what)."""
    step, _, rest = text.partition(":")
    rank, _, what = rest.partition(":")
    try:
        at = int(step), int(rank)
    except ValueError:
        at = (-1, -1)
    what = what or "loss"
    if min(at) < 0 or what not in NAN_PLACES:
        parser.error(f"--nan-at ({text}) must be STEP:RANK[:WHAT], two whole numbers of at least 0 and WHAT "
                     f"one of {', '.join(NAN_PLACES)}.")
    return (*at, what)


@contextlib.contextmanager
def make_nan(model: nn.Module, loss: torch.Tensor, what: str | None):
    """``loss``, made NaN (``what`` "loss": its gradients follow), or with a hook that makes the
    first parameter's gradient NaN as the backward computes it (``what`` "gradients": before DDP
    all-reduces it; the loss stays finite); ``loss`` as it is for None."""
    if what == "loss":
        yield loss * float("nan")
        return
    handle = next(model.parameters()).register_hook(lambda g: g * float("nan")) if what == "gradients" else None
    try:
        yield loss
    finally:
        if handle is not None:
            handle.remove()


# The bit --flip-bit flips in the first parameter's first element: bit 16 of a float32, a
# mantissa bit worth about 1% of the value. Enough that no later update rounds the two replicas
# back together, too little for the loss to show it (the fault the replica check is for).
FLIPPED_BIT = 16


def flip_one_bit(model: nn.Module) -> None:
    """Flip :data:`FLIPPED_BIT` of the first element of ``model``'s first parameter (of its local
    shard, for a sharded model), in place, as a faulty device's memory would."""
    parameter = next(model.parameters())
    local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
    with torch.no_grad():
        raw = local.detach().view(torch.uint8).view(-1)
        byte, bit = divmod(FLIPPED_BIT % (8 * local.element_size()), 8)
        raw[byte] ^= 1 << bit


def synthetic_dataset(size: int, seed: int) -> TensorDataset:
    """(index, x, y) with y = sum(x): the index lets the record name every sample trained."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 16, generator=generator)
    return TensorDataset(torch.arange(size), x, x.sum(dim=1, keepdim=True))


def params_digest(model: nn.Module) -> str:
    """Short sha256 of the parameters (of a sharded model: this worker's local shards): bit-identical
    replicas give the same digest."""
    sha = hashlib.sha256()
    for tensor in model.parameters():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's own shard
        sha.update(local.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()[:16]


@dataclasses.dataclass
class Task:
    """What a trainer trains: the model, its optimizer, the dataset of (index, input, target), the
    loss of (output, target), and how the runtime wraps the model (default: DDP)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    dataset: TensorDataset
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    run_options: dict = dataclasses.field(default_factory=dict)  # wrap, sharded: elasticctl.train.run's
    state_options: dict = dataclasses.field(default_factory=dict)  # peer_copies: elasticctl.train.State's


def mlp_task(args: argparse.Namespace, device: torch.device) -> Task:
    model = nn.Sequential(nn.Linear(16, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1)).to(device)
    return Task(model, torch.optim.SGD(model.parameters(), lr=args.lr), synthetic_dataset(args.dataset_size, args.seed),
                nn.functional.mse_loss)


def inject_failure(mode: str) -> None:
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "exception":
        raise RuntimeError("fault injected by --exit-at")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a hung worker still dies on the agent's SIGTERM
    while True:
        time.sleep(3600)


def train(args: argparse.Namespace, make_task: Callable[[argparse.Namespace, torch.device], Task] = mlp_task) -> None:
    record = open(args.record, "a", buffering=1) if args.record else None  # noqa: SIM115 - open for the run
    environment = WorkerEnvironment.from_env()  # elasticctl's part of this worker's environment, read once
    host, node = socket.gethostname(), environment.node
    group_rank = int(os.environ.get("GROUP_RANK", "0"))
    restart = restart_count(environment)
    where = {"rank": 0, "world_size": 1}  # the generation the lines belong to (hot mode: it changes)
    before_training: list[dict] = []  # a restore happens before the first generation's ranks are known

    def write(entry: dict) -> None:
        if record is not None:
            record.write(json.dumps({**entry, **where, "restart": restart, "time": time.time()}) + "\n")

    def on_event(kind: str, **fields) -> None:  # the runtime's resume, checkpoint, state_restored, ...
        entry = {"event": kind, "node": node, "pid": os.getpid(), **fields}
        if kind == "resume":
            before_training.append(entry)
        else:
            write(entry)

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    task = make_task(args, device)
    optimizer, dataset = task.optimizer, task.dataset
    sharded = task.run_options.get("sharded", False)
    sampler = elastic.ResumableSampler(dataset, seed=args.seed)
    # global_batch: chosen at the first start (or by the flag), then fixed across world sizes.
    state = elastic.State(task.model, optimizer, sampler=sampler, samples_seen=0, global_batch=args.global_batch,
                          **task.state_options)
    started = False
    injected = False
    flipped = False
    made_nan = False

    def generation(state: elastic.State, group: elastic.Group) -> None:
        nonlocal started, injected, flipped, made_nan
        where.update(rank=group.rank, world_size=group.world_size)
        if not started:  # where a restarted worker's seconds go: process start -> first generation formed
            started = True
            write({"event": "start", "process_started": psutil.Process().create_time(),
                   "initialized": time.time()})
            for entry in before_training:
                write(entry)
        state.global_batch = args.global_batch or state.global_batch or args.batch_size * group.world_size
        plan = plan_batches(args.lr_policy, args.lr, args.batch_size, group.world_size, state.global_batch)
        for param_group in optimizer.param_groups:  # the LR belongs to this world size
            param_group["lr"] = plan.lr
        loader = DataLoader(dataset, batch_size=plan.micro_batch, sampler=sampler)
        while state.step < args.steps:
            if sampler.epoch_done:
                sampler.set_epoch(sampler.epoch + 1)
            batches = iter(loader)
            while state.step < args.steps:
                micro_batches = list(itertools.islice(batches, plan.accumulation))
                if not micro_batches:
                    break
                step = state.step
                if (args.exit_at == step and group.rank in args.exit_ranks and restart == 0 and not injected):
                    injected = True  # hot mode re-enters this function in the same process: inject once
                    inject_failure(args.exit_mode)
                # Before the step: a replica's digest here is the state every rank starts it from
                # (sharded: every replica of this worker's shard).
                extra = {"generation": group.number, "params": params_digest(group.model)} if args.record_params else {}
                if sharded:
                    extra["shard"] = group.shard
                loss_sum, indices = 0.0, []
                optimizer.zero_grad(set_to_none=True)  # a step a failure cut short left gradients behind
                nan = None  # --nan-at: what this rank makes a NaN of in this step
                if args.nan_at is not None and args.nan_at[:2] == (step, group.rank) and not made_nan:
                    made_nan, nan = True, args.nan_at[2]  # hot mode re-enters this function: once per process
                    write({"event": "nan_made", "step": step, "what": nan, "node": node, "pid": os.getpid()})
                for i, (index, x, y) in enumerate(micro_batches):
                    # Gradients are all-reduced once, on the last micro-batch of the step.
                    last = i == len(micro_batches) - 1
                    with contextlib.nullcontext() if last else getattr(group.model, "no_sync", contextlib.nullcontext)():
                        loss = task.loss(group.model(x.to(device)), y.to(device)) / len(micro_batches)
                        with make_nan(group.model, loss, nan if last else None) as loss:
                            loss.backward()
                    loss_sum += loss.item()
                    indices += index.tolist()
                # The line is written before commit, which may end the generation: the sampler
                # position commit's advance will reach (every rank trained as many samples).
                consumed = min(sampler.dataset_size, sampler.consumed + len(indices) * group.world_size)
                state.samples_seen += consumed - sampler.consumed
                write({"step": step, "epoch": sampler.epoch, "loss": round(loss_sum, 5), "host": host,
                       "pid": os.getpid(), "node": node, "group_rank": group_rank,
                       "samples_seen": state.samples_seen, "consumed": consumed, "indices": indices, **extra})
                if args.log_every and (step % args.log_every == 0 or step == args.steps - 1):
                    mean_loss = reduce_mean(loss_sum, device)  # a collective: every rank takes part
                    if group.rank == 0:
                        print(f"step {step}/{args.steps} loss {mean_loss:.4f} world {group.world_size} "
                              f"restart {restart}", flush=True)
                state.commit(samples=len(indices), loss=loss_sum)
                if args.flip_bit == (step, group.rank) and not flipped:
                    flipped = True  # hot mode re-enters this function in the same process: flip once
                    flip_one_bit(group.model)
                    write({"event": "bit_flipped", "step": step, "node": node, "pid": os.getpid()})
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                # The straggler knob: after commit, so it counts in this node's own time for the
                # next step (elasticctl.train.watches.stragglers), as a slow GPU's compute would.
                for slow_node, seconds, slowed in args.slow_node:
                    if slow_node == node and (slowed is None or step in slowed):
                        time.sleep(seconds)

    try:
        elastic.run(state, generation, checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                    keep=args.keep, async_checkpoint=args.async_checkpoint, pg_timeout=args.pg_timeout,
                    on_event=on_event, **task.run_options)
        if state.step >= args.steps:  # not a worker that was told to stop
            write({"event": "done", "step": state.step, "samples_seen": state.samples_seen})
    finally:
        if record is not None:
            record.close()


def main() -> None:
    run_main(train, parse_args())


if __name__ == "__main__":
    main()
