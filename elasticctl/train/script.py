"""Helpers for training scripts run by ``elasticctl up`` or plain ``torchrun``.

A script needs only its environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
... from torchrun; elasticctl's part decoded by :mod:`elasticctl.job.environment`)::

    ctx = elasticctl.train.script.init(timeout=60)
    sampler = ResumableSampler(dataset)                      # elasticctl.train.sampler
    ckpt = Checkpointer(checkpoint_dir(args.checkpoint_dir), device=ctx.device)
    restored = ckpt.restore(model=model, optimizer=opt, sampler=sampler)
    stop = GracefulStop()                                    # SIGTERM -> final checkpoint, exit 0
    ...
    for batch in loader:
        ...
        if stop.agreed():
            ckpt.save(step, epoch, model=model, optimizer=opt, sampler=sampler, blocking=True)
            stop.exit()
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import signal
import sys

import torch
import torch.distributed as dist

from elasticctl.train import entry as worker_entry
from elasticctl.errors import ConfigError, ElasticctlError
from elasticctl.job.environment import WorkerEnvironment

LR_POLICIES = ("linear", "constant-batch")


@dataclasses.dataclass(frozen=True)
class WorkerContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    restart: int  # restarts this node has spent (see restart_count)

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def restart_count(environment: WorkerEnvironment | None = None) -> int:
    """Restarts this node has actually spent.

    elasticctl makes restarts caused by a lost peer free and says so in the worker
    environment's ``restarts``; torchrun's own TORCHELASTIC_RESTART_COUNT counts those too.
    ``environment``: the worker's, if the caller decoded it already.
    """
    environment = environment or WorkerEnvironment.from_env()
    if environment.restarts is not None:
        return environment.restarts
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0")


def local_device() -> tuple[int, torch.device, str]:
    """This worker's local rank (LOCAL_RANK), its device (the GPU of that index, made current,
    where there are GPUs; else the CPU) and the backend for it (NCCL on a GPU, else gloo)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return local_rank, torch.device("cuda", local_rank), "nccl"
    return local_rank, torch.device("cpu"), "gloo"


def init(timeout: float = 60.0, backend: str | None = None,
         environment: WorkerEnvironment | None = None) -> WorkerContext:
    """Join the process group described by the environment and pick this worker's device.

    Backend: NCCL when CUDA is available (device ``cuda:LOCAL_RANK``), else gloo on
    the CPU. ``timeout`` (seconds) bounds every collective: short, so a peer that
    hangs is noticed and the job re-forms instead of waiting torch's default 30
    minutes. Without torchrun's variables the script runs as a world of one.
    ``environment``: elasticctl's part of it, if the caller decoded it already.
    """
    if timeout <= 0:
        raise ConfigError(f"The process-group timeout ({timeout:g} s) must be positive.")
    local_rank, device, default_backend = local_device()
    backend = backend or default_backend
    pg_timeout = datetime.timedelta(seconds=timeout)
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=pg_timeout,
                                    device_id=device if device.type == "cuda" else None)
        else:  # plain `python script.py`: a world of one, no rendezvous
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=pg_timeout)
    worker_entry.note_joined()
    return WorkerContext(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                         device=device, backend=backend, restart=restart_count(environment))


def shutdown() -> None:
    """Leave the process group cleanly.

    The barrier lets every rank finish its last collective before gloo tears its
    pairs down; without it a fast rank's exit can abort a slower one.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def checkpoint_dir(flag: str | None, environment: WorkerEnvironment | None = None) -> str | None:
    """The checkpoint directory: the trainer's flag, else the one elasticctl hands out, else none.
    ``environment``: the worker's, if the caller decoded it already."""
    if flag:
        return flag
    return (environment or WorkerEnvironment.from_env()).checkpoint_dir or None


def reduce_mean(value: float | torch.Tensor, device: torch.device | None = None) -> float:
    """The mean of a scalar over all ranks (e.g. the loss to report)."""
    tensor = torch.as_tensor(value, dtype=torch.float64, device=device).detach().clone().reshape(1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
        tensor /= dist.get_world_size()
    return float(tensor.item())


class GracefulStop:
    """SIGTERM (``elasticctl leave``/``down``, preemption) turns into a clean stop at a step boundary.

    The handler only sets a flag; :meth:`agreed` all-reduces it so every rank
    learns at the same step that some rank was told to stop, saves the same
    final checkpoint, then :meth:`exit` ends the signalled ranks with status 0.
    Ranks that were not signalled (their node stays) raise :class:`PeerLeaving`
    instead, so their agent re-forms the job without the leaving node and the
    workers resume from that final checkpoint.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self.requested = False
        self._signals = signals
        for sig in signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True
        worker_entry.note_stop_request()

    def agreed(self, device: torch.device | None = None) -> bool:
        """True on every rank once any rank was signalled (a collective: call it on all ranks)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.requested
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore_default(self) -> None:
        for sig in self._signals:
            signal.signal(sig, signal.SIG_DFL)

    def exit(self) -> None:
        """After the final checkpoint: exit 0 if this rank was signalled, else raise PeerLeaving."""
        if dist.is_initialized():
            dist.barrier()  # the final checkpoint is committed before anyone leaves
        if not self.requested:
            raise PeerLeaving("A peer is leaving the job; restarting to re-form without it.")
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(0)


class PeerLeaving(ElasticctlError, RuntimeError):
    """Raised on ranks whose peers were told to stop: the agent restarts them in the smaller world.

    Also a ``RuntimeError``, as it always was: a script may catch it as one."""


def run_main(main, *args) -> None:
    """Call ``main(*args)`` as a script's main: a peer leaving or a user mistake exits in one line.

    (Not the elastic runtime: that is :func:`elasticctl.train.run`.)

    PeerLeaving exits 1 (the agent re-forms the job without the leaver); an
    ElasticctlError (bad flag, unreadable checkpoint directory) exits 2.
    """
    prog = os.path.basename(sys.argv[0])
    try:
        main(*args)
    except PeerLeaving as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        sys.exit(1)
    except ElasticctlError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        sys.exit(2)


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step is made at the current world size."""

    lr: float
    micro_batch: int  # per worker, per forward/backward
    accumulation: int  # micro-batches per optimizer step

    def global_batch(self, world_size: int) -> int:
        return self.micro_batch * self.accumulation * world_size


def plan_batches(policy: str, base_lr: float, batch_size: int, world_size: int,
                 global_batch: int | None = None) -> BatchPlan:
    """Learning rate and batching for ``world_size`` under an LR policy.

    ``linear``: keep the per-worker batch and scale the LR with the world size
    (``base_lr * world_size``, Goyal et al.; ``base_lr`` is the LR for one worker).
    ``constant-batch``: keep the global batch (``global_batch``) and the LR fixed
    by accumulating gradients over as many micro-batches of at most
    ``batch_size`` as needed; when it does not divide evenly the global batch is
    rounded up to the nearest size the world can make.
    """
    if policy not in LR_POLICIES:
        raise ConfigError(f"The learning-rate policy '{policy}' must be one of {', '.join(LR_POLICIES)}.")
    if batch_size < 1:
        raise ConfigError(f"The batch size ({batch_size}) must be at least 1.")
    if policy == "linear":
        return BatchPlan(lr=base_lr * world_size, micro_batch=batch_size, accumulation=1)
    if global_batch is None or global_batch < 1:
        raise ConfigError(f"The global batch size ({global_batch}) must be at least 1.")
    accumulation = max(1, math.ceil(global_batch / (batch_size * world_size)))
    micro_batch = math.ceil(global_batch / (world_size * accumulation))
    return BatchPlan(lr=base_lr, micro_batch=micro_batch, accumulation=accumulation)
