"""Build the torchrun command for this node and supervise it: signals in, exit code out."""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import re
import shlex
import signal
import sys

import psutil

from elasticctl import addressing, processes
from elasticctl.errors import ConfigError
from elasticctl.job.options import up_defaults
from elasticctl.job.spec import JobSpec

log = logging.getLogger(__name__)

# elasticctl's handler keeps the real restart budget (peer losses are free); torch's
# own counter would also spend one on every collateral failure, so it gets no limit.
UNLIMITED_RESTARTS = 1_000_000
MONITOR_INTERVAL = "0.1"  # torch's default: a failed worker or a waiting node is seen within 0.1 s


def visible_gpu_count() -> int:
    """GPUs this node may use, without importing torch (the CLI stays fast)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len(glob.glob("/dev/nvidia[0-9]*"))


# torchrun's words for "--nproc-per-node": what each means on the node that runs the workers.
NPROC_WORDS = ("auto", "cpu", "gpu")


def local_world_size(value: str, gpus: int, cpus: int) -> int:
    """Workers on a node with ``gpus`` visible GPUs and ``cpus`` CPUs, for ``--nproc-per-node``
    ``value`` as torchrun means it: a number; ``gpu`` one per GPU (none visible: an error);
    ``cpu`` one per CPU; ``auto`` one per GPU, else one per CPU. A number above the visible GPUs
    is refused: two workers would share a GPU."""
    if value == "auto":
        return gpus or cpus
    if value == "cpu":
        return cpus
    if value == "gpu":
        if not gpus:
            raise ConfigError("--nproc-per-node gpu needs a GPU, and none is visible on this node.")
        return gpus
    count = int(value)
    if gpus and count > gpus:
        raise ConfigError(f"The processes per node ({count}) exceed the {gpus} GPUs visible on this node.")
    return count


def resolve_nproc(value: str) -> int:
    return local_world_size(value, visible_gpu_count(), os.cpu_count() or 1)


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def primary_address() -> str:
    """The address this host advertises to a job whose etcd runs here: the source of its
    default route (see elasticctl.addressing)."""
    return addressing.advertised_address(None, None).address


def interface_of(address: str) -> str | None:
    """The name of the interface that holds ``address``, if this host has it."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addresses):
            return name
    return None


# torchrun's --tee/--redirects: one stream code (0 none, 1 stdout, 2 stderr, 3 both) for every
# worker, or LOCAL_RANK:CODE pairs; --local-ranks-filter: local ranks, comma-separated.
_STREAMS_RE = re.compile(r"[0-3]|[0-9]{1,4}:[0-3](,[0-9]{1,4}:[0-3]){0,255}")
_RANKS_RE = re.compile(r"[0-9]{1,4}(,[0-9]{1,4}){0,255}")


@dataclasses.dataclass(frozen=True)
class WorkerLogs:
    """torchrun's options for the workers' output on this node, passed through as torchrun takes
    them (this node's own: the directory is a path on this host)."""

    log_dir: str | None = None
    tee: str | None = None
    redirects: str | None = None
    local_ranks_filter: str | None = None

    def __post_init__(self) -> None:
        for flag, value, pattern, what in (
                ("--tee", self.tee, _STREAMS_RE, "0-3, or LOCAL_RANK:CODE pairs like 0:3,1:2"),
                ("--redirects", self.redirects, _STREAMS_RE, "0-3, or LOCAL_RANK:CODE pairs like 0:3,1:2"),
                ("--local-ranks-filter", self.local_ranks_filter, _RANKS_RE, "local ranks like 0,1")):
            if value is not None and not pattern.fullmatch(value):
                raise ConfigError(f"{flag} {value!r} is not what torchrun takes ({what}).")
        if self.log_dir is not None and not self.log_dir.strip():
            raise ConfigError("--log-dir must not be empty.")

    def args(self) -> list[str]:
        return [f"--{flag.replace('_', '-')}={value}" for flag, value in dataclasses.asdict(self).items()
                if value is not None]


def torchrun_command(spec: JobSpec, endpoint: str, local_addr: str, extra_conf: dict[str, str] | None = None,
                     worker_logs: WorkerLogs = WorkerLogs()) -> list[str]:
    # `up`'s own defaults (job.options: a short last call, so that re-forming is quick), then
    # the spec's settings: each has one home there, so no key below overrides another.
    conf = {
        **up_defaults(),
        "node_ttl": str(spec.node_ttl),
        "max_restarts": str(spec.max_restarts),
        **dict(spec.rdzv_conf),
        **(extra_conf or {}),
    }
    command = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={spec.nnodes}",
        f"--nproc-per-node={resolve_nproc(spec.nproc_per_node)}",
        "--rdzv-backend=etcd3",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={spec.name}",
        "--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items()),
        f"--max-restarts={UNLIMITED_RESTARTS}",
        f"--monitor-interval={MONITOR_INTERVAL}",
        f"--local-addr={local_addr}",
        *worker_logs.args(),
    ]
    # Every worker runs its script through elasticctl's entry, which tells the handler
    # which workers finished (see elasticctl/train/entry.py); it also adds --local_rank=N if asked.
    entry = ["-m", "elasticctl.train.entry"] + (["--module"] if spec.module else [])
    if spec.legacy_local_rank:
        entry.append("--local-rank-flag")
    return [*command, *entry, spec.script, *spec.script_args]


def check_script(spec: JobSpec) -> None:
    if not spec.module and not os.path.isfile(spec.script):
        raise ConfigError(f"The training script '{spec.script}' does not exist on this host.")


def format_command(command: list[str]) -> str:
    return shlex.join(command)


def run_supervised(command: list[str], env: dict[str, str]) -> int:
    """Run torchrun until it exits; SIGINT/SIGTERM stop it and all its workers."""
    child = processes.spawn(command, env=env)
    received: list[int] = []

    def forward(signum, _frame) -> None:
        received.append(signum)
        log.info("received %s; stopping torchrun and its workers", signal.Signals(signum).name)
        processes.terminate(child, timeout=30)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        processes.terminate(child, timeout=5)
    return 128 + received[0] if received else code
