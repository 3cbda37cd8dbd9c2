"""`elasticctl doctor`: can this host run a node of the job, and what to fix if not.

Each check is a pure ``decide_*`` function (facts in, :class:`Check` out), so every
verdict is testable with a table of facts; the ``gather_*`` functions at the bottom
do the I/O (psutil, nvidia-smi, etcd, the checkpoint directory). ``up`` and ``join``
run the quick subset (:func:`run_checks` with ``quick=True``): no torch import, no
nvidia-smi, one clock sample, nothing that waits.
"""

from __future__ import annotations

import dataclasses
import email.utils
import enum
import errno
import importlib.metadata
import os
import secrets
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence

import psutil

from elasticctl import launcher
from elasticctl.etcd.client import EtcdClient, EtcdSettings
from elasticctl.etcd.retry import Backoff, poll
from elasticctl.job.registry import DEFAULT_KEY_PREFIX, Registry, read_probe

MIN_PYTHON = (3, 10)
# The rendezvous does a few etcd round trips per heartbeat and per round; on a LAN
# they take ~1 ms, and at 50 ms forming a round of many nodes takes seconds.
ETCD_LATENCY_WARN_MS = 50.0
# Leases and the timestamps in records (joined_at, progress, events) assume one clock.
CLOCK_WARN_S = 1.0
CLOCK_FAIL_S = 30.0
# Docker's default /dev/shm is 64 MiB; DataLoader workers and NCCL's shared-memory
# transport need far more (NCCL fails with "unhandled system error" when it runs out).
SHM_WARN_BYTES = 1 << 30
GPU_HOT_CELSIUS = 90
# How long a node that lost the race to claim the marker waits for the winner to write it.
MARKER_WAIT_S = 2.0

GIB = float(1 << 30)


class Status(str, enum.Enum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"


@dataclasses.dataclass(frozen=True)
class Check:
    """One verdict: ``detail`` says what was found, ``fix`` (one sentence) what to do about it."""

    name: str
    status: Status
    detail: str
    fix: str = ""

    def lines(self) -> list[str]:
        head = f"{self.status.value.upper()} {self.name}: {self.detail}"
        return [head] if self.status is Status.PASS or not self.fix else [head, f"  fix: {self.fix}"]

    def to_dict(self) -> dict:
        return {"name": self.name, "status": self.status.value, "detail": self.detail, "fix": self.fix}


def passed(name: str, detail: str) -> Check:
    return Check(name, Status.PASS, detail)


def _quoted(value: str) -> str:
    return f"'{value}'"


def _release(version: str) -> tuple[str, ...]:
    """'2.14.1+cu124' -> ('2', '14'): the part of a torch version peers must share."""
    return tuple(version.split("+")[0].split(".")[:2])


# -- pure decisions --------------------------------------------------------------------------

def decide_job(named: str | None, jobs: Mapping[str, int]) -> tuple[Check, str | None]:
    """The job to compare this host with (``jobs``: live node count per job in etcd), and why."""
    name = "job"
    if named is not None and named not in jobs:
        return Check(name, Status.WARN, f"the job '{named}' is not in etcd yet: no node to compare with",
                     "Run doctor again once the job is up, to compare this host with its nodes."), None
    if named is None and len(jobs) != 1:
        shown = f"{len(jobs)} jobs ({', '.join(jobs)})" if jobs else "no job"
        return passed(name, f"{shown} in etcd and no --job: no node to compare with"), None
    job = named if named is not None else next(iter(jobs))
    return passed(name, f"job {job}: {jobs[job]} live node(s)"), job


def decide_versions(python: Sequence[int], torch: str | None) -> Check:
    shown = ".".join(str(p) for p in python[:3])
    if tuple(python[:2]) < MIN_PYTHON:
        return Check("versions", Status.FAIL, f"Python {shown} is older than the 3.10 elasticctl needs",
                     "Run elasticctl with Python 3.10 or newer.")
    if torch is None:
        return Check("versions", Status.FAIL, f"torch is not installed for Python {shown} ({sys.executable})",
                     "Install torch into the environment elasticctl runs from (pip install torch).")
    return passed("versions", f"Python {shown}, torch {torch}")


def decide_torch_agreement(local: str | None, others: Mapping[str, str | None]) -> Check:
    """``others``: the torch version each other live node published (None: an older elasticctl)."""
    name = "torch-agreement"
    if not others:
        return passed(name, "no other live node to compare with")
    known = {node: version for node, version in others.items() if version}
    unknown = sorted(set(others) - set(known))
    note = f"; {len(unknown)} node(s) did not publish theirs ({', '.join(unknown)})" if unknown else ""
    if local is None or not known:
        return passed(name, f"nothing to compare{note}")
    apart = sorted(n for n, v in known.items() if _release(v) != _release(local))
    if apart:
        shown = ", ".join(f"{n} has {known[n]}" for n in apart)
        return Check(name, Status.FAIL, f"this host has torch {local} but {shown}",
                     "Install the same torch release on every node (the rendezvous and collectives "
                     "are not compatible across releases).")
    differ = sorted(n for n, v in known.items() if v != local)
    if differ:
        shown = ", ".join(f"{n} has {known[n]}" for n in differ)
        return Check(name, Status.WARN, f"this host has torch {local} but {shown}{note}",
                     "Install the identical torch build on every node to rule out build differences.")
    return passed(name, f"torch {local} on this host and on {len(known)} other node(s){note}")


def decide_torch_build(torch: str, cuda: str | None, cuda_usable: bool, nccl: str | None,
                       gloo: bool, gpus: int) -> Check:
    """The imported torch (``--deep`` only): can it use this host's GPUs, and gloo?"""
    name = "torch-build"
    built = f"torch {torch}, CUDA {cuda or 'none (CPU build)'}, NCCL {nccl or 'none'}"
    if not gloo:
        return Check(name, Status.FAIL, f"{built}, and gloo is not available",
                     "Install a torch build with gloo (every official build has it).")
    if gpus and cuda is None:
        return Check(name, Status.FAIL, f"{built}, but {gpus} GPU(s) are visible",
                     "Install a CUDA build of torch to train on this host's GPUs.")
    if gpus and not cuda_usable:
        return Check(name, Status.FAIL, f"{built}, but CUDA cannot use the {gpus} visible GPU(s)",
                     "Check that the NVIDIA driver is at least what this torch build's CUDA needs.")
    return passed(name, built)


@dataclasses.dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    temperature: int | None
    memory_used_mib: int | None
    memory_total_mib: int | None
    ecc_uncorrected: int | None


NVIDIA_SMI_QUERY = "index,name,temperature.gpu,memory.used,memory.total,ecc.errors.uncorrected.volatile.total"


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """The rows of ``nvidia-smi --query-gpu=NVIDIA_SMI_QUERY --format=csv,noheader,nounits``."""

    def number(value: str) -> int | None:
        try:
            return int(float(value))
        except ValueError:
            return None  # "[N/A]", "[Not Supported]"

    gpus = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 6 or number(fields[0]) is None:
            continue
        gpus.append(Gpu(number(fields[0]), fields[1], number(fields[2]), number(fields[3]),
                        number(fields[4]), number(fields[5])))
    return gpus


def decide_gpus(gpus: Sequence[Gpu] | None, smi_error: str | None, device_files: int,
                peers_with_gpus: Sequence[str] = ()) -> Check:
    """``gpus`` None: nvidia-smi is not installed; ``device_files``: /dev/nvidiaN present."""
    name = "gpus"
    if smi_error is not None:
        return Check(name, Status.FAIL, f"nvidia-smi failed: {smi_error}",
                     "Fix the NVIDIA driver (nvidia-smi must list the GPUs) or hide them with CUDA_VISIBLE_DEVICES=''.")
    if gpus is None and device_files:
        return Check(name, Status.WARN, f"{device_files} /dev/nvidia device(s) but no nvidia-smi to check them",
                     "Install the NVIDIA utilities so that the GPUs' health can be checked.")
    if not gpus:
        if peers_with_gpus:
            return Check(name, Status.WARN,
                         f"no GPU on this host, but {', '.join(peers_with_gpus)} have GPUs",
                         "Use gloo on every node, or run this job only on hosts with GPUs.")
        # A CPU node is a supported set-up (gloo), not a fault of this host.
        return passed(name, "no GPU: CPU/gloo")
    problems = [f"GPU {g.index} has {g.ecc_uncorrected} uncorrected ECC errors" for g in gpus if g.ecc_uncorrected]
    problems += [f"GPU {g.index} is at {g.temperature} C" for g in gpus
                 if g.temperature is not None and g.temperature >= GPU_HOT_CELSIUS]
    listed = ", ".join(f"{g.index}: {g.name}" for g in gpus)
    if problems:
        return Check(name, Status.WARN, f"{len(gpus)} GPU(s) ({listed}); {'; '.join(problems)}",
                     "Drain this host and have its GPUs checked before a long run.")
    return passed(name, f"{len(gpus)} GPU(s) healthy ({listed})")


@dataclasses.dataclass(frozen=True)
class RemoteNode:
    node: str
    host: str
    addr: str


@dataclasses.dataclass(frozen=True)
class InterfaceFacts:
    """Which interface gloo would use on this host, and who else is in the job."""

    local_addr: str
    interface: str | None               # the interface gloo would use, None when none matched
    addresses: tuple[str, ...]          # its addresses
    loopback: bool
    variable: str | None = None         # GLOO_SOCKET_IFNAME, when it chose the interface
    requested: str | None = None        # its value
    available: tuple[str, ...] = ()     # every interface of this host
    nccl_requested: str | None = None   # NCCL_SOCKET_IFNAME
    nccl_matches: tuple[str, ...] = ()
    remote_nodes: tuple[RemoteNode, ...] = ()


def decide_interface(facts: InterfaceFacts) -> Check:
    name = "interface"
    have = ", ".join(facts.available) or "none"
    if facts.nccl_requested is not None and not facts.nccl_matches:
        return Check(name, Status.FAIL, f"NCCL_SOCKET_IFNAME={facts.nccl_requested} matches no interface "
                     f"of this host (it has {have})", "Set NCCL_SOCKET_IFNAME to one of this host's interfaces.")
    if facts.interface is None:
        if facts.variable:
            return Check(name, Status.FAIL, f"{facts.variable}={facts.requested} names no interface of this "
                         f"host (it has {have})", f"Set {facts.variable} to one of this host's interfaces.")
        return Check(name, Status.WARN, f"the local address {facts.local_addr} is on no interface of this host "
                     "(behind NAT, the peers must be able to reach it)",
                     "Pass --local-addr with an address of this host that the other nodes can reach.")
    shown = f"{facts.interface} ({', '.join(facts.addresses) or 'no address'})"
    source = f" from {facts.variable}" if facts.variable else f" holding {facts.local_addr}"
    if facts.loopback and facts.remote_nodes:
        others = ", ".join(f"{r.node} on {r.host} ({r.addr})" for r in facts.remote_nodes)
        return Check(name, Status.FAIL, f"gloo would use the loopback interface {shown} while the job has "
                     f"nodes on other hosts: {others}",
                     "Pass --local-addr with this host's address on the network the other nodes share.")
    if facts.loopback:
        return passed(name, f"{shown}{source}: loopback, fine while every node runs on this host")
    return passed(name, f"{shown}{source}")


def decide_etcd(endpoints: str, latencies_ms: Sequence[float], error: str | None) -> Check:
    """``error``: why connecting failed, a clause naming the endpoints (from etcd.connect)."""
    name = "etcd"
    if error is not None:
        return Check(name, Status.FAIL, error,
                     "Start etcd there, or pass the right --etcd HOST:PORT (and TLS options).")
    if not latencies_ms:
        return Check(name, Status.WARN, "etcd not checked: no --etcd given and no embedded etcd runs here",
                     "Pass --etcd HOST:PORT to check the job's etcd.")
    median = statistics.median(latencies_ms)
    detail = f"{endpoints} answers, median {median:.1f} ms over {len(latencies_ms)} reads"
    if median > ETCD_LATENCY_WARN_MS:
        return Check(name, Status.WARN, f"{detail} (above {ETCD_LATENCY_WARN_MS:g} ms)",
                     "Run etcd close to the nodes (same network, not across regions).")
    return passed(name, detail)


@dataclasses.dataclass(frozen=True)
class DateSample:
    """One HTTP answer of etcd: local wall clock when sent and received, and its Date header."""

    sent: float
    received: float
    server: float  # whole seconds: the Date header has no fraction


def clock_offset_bounds(samples: Sequence[DateSample]) -> tuple[float, float]:
    """Bounds of (etcd's clock - this host's clock) consistent with every sample.

    The server read its clock between ``sent`` and ``received`` and truncated it to a
    whole second, so each sample bounds the offset to [server - received, server + 1 - sent];
    samples taken at different fractions of a second narrow the intersection.
    """
    if not samples:
        raise ValueError("clock_offset_bounds needs at least one sample")
    low = max(s.server - s.received for s in samples)
    high = min(s.server + 1 - s.sent for s in samples)
    if low > high:  # a clock stepped between samples: trust the last one alone
        last = samples[-1]
        return last.server - last.received, last.server + 1 - last.sent
    return low, high


def decide_clock(bounds: tuple[float, float] | None, error: str | None = None) -> Check:
    name = "clock"
    if bounds is None:
        return Check(name, Status.WARN, f"cannot compare this host's clock with etcd's: {error}",
                     "Check that etcd's client URL answers HTTP GET /version.")
    low, high = bounds
    # The smallest offset the samples allow: only a certain offset is reported.
    least = 0.0 if low <= 0 <= high else min(abs(low), abs(high))
    estimate = (low + high) / 2
    direction = "behind" if estimate > 0 else "ahead of"
    shown = f"{abs(estimate):.1f} s {direction}" if round(estimate, 1) else "in step with"
    detail = f"this host's clock is {shown} etcd's (±{(high - low) / 2:.1f} s)"
    fix = "Synchronise this host's clock (chrony or systemd-timesyncd against the same NTP servers as etcd's host)."
    if least > CLOCK_FAIL_S:
        return Check(name, Status.FAIL, f"{detail}: leases and record timestamps would lie", fix)
    if least > CLOCK_WARN_S:
        return Check(name, Status.WARN, detail, fix)
    return passed(name, detail)


def decide_port(addr: str, port: int | None, error: str | None) -> Check:
    name = "ports"
    if error is not None:
        return Check(name, Status.FAIL, f"cannot listen on {addr}: {error}",
                     "Free some ports (or allow this user to listen): torchrun's store needs one.")
    return passed(name, f"free port {port} listens on {addr} (torchrun's store takes one like it)")


def decide_shm(total_bytes: int | None, free_bytes: int | None) -> Check:
    name = "shm"
    if total_bytes is None or free_bytes is None:
        return Check(name, Status.WARN, "/dev/shm is missing",
                     "Mount a tmpfs on /dev/shm (in Docker: --shm-size=8g or --ipc=host).")
    detail = f"/dev/shm {total_bytes / GIB:.1f} GiB, {free_bytes / GIB:.1f} GiB free"
    if free_bytes < SHM_WARN_BYTES:
        return Check(name, Status.WARN, f"{detail}: DataLoader workers and NCCL need more",
                     "Give /dev/shm at least a few GiB (in Docker: --shm-size=8g or --ipc=host).")
    return passed(name, detail)


def decide_checkpoint_dir(path: str | None, error: str | None, free_bytes: int | None = None,
                          created_under: str | None = None) -> Check:
    """``created_under``: the path does not exist yet, and this existing ancestor lets the job
    create it (the doctor does not: a check must not change what it checks)."""
    name = "checkpoint-dir"
    if path is None:
        return passed(name, "no checkpoint directory given")
    if error is not None:
        return Check(name, Status.FAIL, f"the checkpoint directory {_quoted(path)} is not writable: {error}",
                     "Create the directory with write permission for this user, or pass another --checkpoint-dir.")
    free = "" if free_bytes is None else f", {free_bytes / GIB:.1f} GiB free"
    if created_under is not None:
        return passed(name, f"{_quoted(path)} does not exist yet; the job creates it in "
                            f"{_quoted(created_under)}, which is writable{free}")
    return passed(name, f"{_quoted(path)} is writable (write, fsync, rename, delete){free}")


def decide_checkpoint_marker(path: str, job: str, in_etcd: str | None, in_file: str | None,
                             claimed: bool) -> Check:
    """Is ``path`` the directory the job's first node marked? (``in_etcd``: its token.)"""
    name = "checkpoint-shared"
    if claimed:
        return passed(name, f"first node of job {job}: marker written to {_quoted(path)} and etcd")
    if in_etcd is None:
        return passed(name, f"no node of job {job} has marked its checkpoint directory yet: "
                            "nothing to compare with")
    if in_etcd is not None and in_file == in_etcd:
        return passed(name, f"{_quoted(path)} holds job {job}'s marker: the same directory as the other nodes")
    found = "no marker" if in_file is None else "a different marker"
    return Check(name, Status.FAIL, f"{_quoted(path)} holds {found} for job {job}: it is not the directory "
                 "the job's other nodes checkpoint to",
                 "Mount the job's shared checkpoint storage at this path on every node.")


def decide_checkpoint_health(progress: Mapping | None) -> Check:
    """Are the job's checkpoints being written? (``progress``: the record rank 0 publishes.)"""
    name = "checkpoint-writes"
    error = (progress or {}).get("checkpoint_error")
    if not error:
        return passed(name, "no failed checkpoint reported by the job's trainer")
    failures = (progress or {}).get("checkpoint_failures", 1)
    return Check(name, Status.WARN, f"the job's last {failures} checkpoint(s) failed: {error.rstrip('.')}",
                 "Free space on (or fix) the checkpoint storage: training goes on, but a restart "
                 "would resume from the last checkpoint written.")


# -- gathering: the I/O behind each decision ------------------------------------------------------

def wall_clock() -> float:
    """This host's clock (a seam: tests fake an offset by replacing it)."""
    return time.time()


def installed_torch_version() -> str | None:
    """torch's version from its package metadata: no torch import (which takes seconds)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def gather_torch_build(gpus: int) -> Check:
    import torch  # only for --deep: seconds of import time
    import torch.distributed as dist

    cuda = torch.version.cuda
    usable = bool(cuda) and torch.cuda.is_available()
    nccl = None
    if cuda and dist.is_nccl_available():
        try:  # the library's version: readable without a GPU
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except (RuntimeError, AttributeError, OSError):
            nccl = None
    return decide_torch_build(torch.__version__, cuda, usable, nccl, dist.is_gloo_available(), gpus)


def gather_gpus(peers_with_gpus: Sequence[str] = ()) -> Check:
    devices = launcher.visible_gpu_count()
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return decide_gpus(None, None, devices, peers_with_gpus)
    try:
        result = subprocess.run([smi, f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return decide_gpus(None, f"{exc}", devices, peers_with_gpus)
    if result.returncode != 0:
        reason = (result.stderr or result.stdout).strip().splitlines()
        return decide_gpus(None, f"exit code {result.returncode}: {reason[0] if reason else 'no output'}",
                           devices, peers_with_gpus)
    return decide_gpus(parse_nvidia_smi(result.stdout), None, devices, peers_with_gpus)


def _interfaces_named(value: str, names: Sequence[str], exact: bool) -> tuple[str, ...]:
    """The interfaces a *_SOCKET_IFNAME value selects: gloo takes names; NCCL takes prefixes,
    '=' for exact names and '^' to exclude."""
    if not exact and value.startswith("^"):
        excluded = [p for p in value[1:].split(",") if p]
        return tuple(n for n in names if not any(n.startswith(p) for p in excluded))
    if not exact and value.startswith("="):
        value, exact = value[1:], True
    wanted = [p.strip() for p in value.split(",") if p.strip()]
    return tuple(n for n in names if any(n == p if exact else n.startswith(p) for p in wanted))


def gather_interface(local_addr: str, nodes: Mapping[str, dict],
                     environ: Mapping[str, str] = os.environ) -> InterfaceFacts:
    addrs = psutil.net_if_addrs()
    names = tuple(sorted(addrs))
    mine = {a.address.split("%")[0] for entries in addrs.values() for a in entries}
    # The addresses are the evidence (the host name only labels them): a node on another host
    # published an address that is neither loopback nor this host's. No address: unknown.
    remote = tuple(
        RemoteNode(node, str(r.get("host", "?")), r["addr"])
        for node, r in sorted(nodes.items())
        if r.get("addr") and not launcher.is_loopback(r["addr"]) and r["addr"] not in mine
    )
    nccl = environ.get("NCCL_SOCKET_IFNAME")
    nccl_matches = _interfaces_named(nccl, names, exact=False) if nccl is not None else ()
    gloo = environ.get("GLOO_SOCKET_IFNAME")
    if gloo:
        chosen = _interfaces_named(gloo, names, exact=True)
        interface = chosen[0] if chosen else None
        variable = "GLOO_SOCKET_IFNAME"
    else:
        # What node.socket_ifname_env hands torchrun: the interface holding --local-addr.
        try:
            resolved = {info[4][0] for info in socket.getaddrinfo(local_addr, None)}
        except (socket.gaierror, UnicodeError):
            resolved = {local_addr}
        interface = next((n for n in names if any(a.address.split("%")[0] in resolved for a in addrs[n])), None)
        variable = None
    on_it = tuple(a.address.split("%")[0] for a in addrs.get(interface, ())
                  if a.family in (socket.AF_INET, socket.AF_INET6))
    loopback = bool(on_it) and all(launcher.is_loopback(a) for a in on_it)
    return InterfaceFacts(local_addr=local_addr, interface=interface, addresses=on_it, loopback=loopback,
                          variable=variable, requested=gloo or None, available=names,
                          nccl_requested=nccl, nccl_matches=nccl_matches, remote_nodes=remote)


def gather_port(addr: str = "0.0.0.0") -> Check:
    """Listen on a free port of ``addr``, as the agent's store does on every address."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((addr, 0))
            sock.listen()
            return decide_port(addr, sock.getsockname()[1], None)
    except OSError as exc:
        return decide_port(addr, None, exc.strerror or str(exc))


def gather_shm(path: str = "/dev/shm") -> Check:
    try:
        usage = psutil.disk_usage(path)
    except OSError:
        return decide_shm(None, None)
    return decide_shm(usage.total, usage.free)


def existing_ancestor(path: str) -> str:
    """The nearest ancestor of ``path`` (or ``path``) that exists: where creating it starts."""
    current = os.path.abspath(path)
    while not os.path.lexists(current):
        current = os.path.dirname(current)
    return current


def probe_creatable(path: str) -> tuple[str | None, str]:
    """Whether the job could create the missing directory ``path``: (why not, or None; the
    existing ancestor it would be created in). Nothing is created."""
    ancestor = existing_ancestor(path)
    if not os.path.isdir(ancestor):
        return os.strerror(errno.ENOTDIR), ancestor
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return os.strerror(errno.EACCES), ancestor
    return None, ancestor


def probe_writable(path: str, create: bool = True) -> str | None:
    """Write, fsync, rename and delete a file in ``path``; with ``create``, create ``path``
    first (as the checkpointer would; ``up`` and ``join``), else it must exist.

    Returns why that failed, or None.
    """
    probe = os.path.join(path, f".elasticctl-doctor-{secrets.token_hex(4)}")
    try:
        if create:
            os.makedirs(path, exist_ok=True)
        with open(probe + ".tmp", "wb") as f:
            f.write(b"elasticctl doctor\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(probe + ".tmp", probe)
        os.remove(probe)
    except OSError as exc:
        for leftover in (probe + ".tmp", probe):
            try:
                os.remove(leftover)
            except OSError:
                pass
        return exc.strerror or errno.errorcode.get(exc.errno or 0, str(exc))
    return None


def marker_path(checkpoint_dir: str, job: str) -> str:
    return os.path.join(checkpoint_dir, f".elasticctl-{job}.marker")


def _read_marker(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(200).strip()
    except OSError:
        return None


def _write_marker(path: str, token: str) -> None:
    tmp = f"{path}.{secrets.token_hex(4)}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(token + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclasses.dataclass(frozen=True)
class MarkerOutcome:
    check: Check
    claimed_token: str | None  # set when this call claimed the job's marker (up takes it back on failure)


def gather_checkpoint_marker(registry: Registry, checkpoint_dir: str) -> MarkerOutcome:
    """Claim the job's marker (the first node), or compare this directory's with the one in etcd."""
    path = marker_path(checkpoint_dir, registry.job)
    token = secrets.token_hex(16)
    claimed, in_etcd = registry.claim_checkpoint_marker(token)
    if claimed:
        try:
            _write_marker(path, token)
        except OSError:
            registry.release_checkpoint_marker(token)
            raise
        return MarkerOutcome(decide_checkpoint_marker(checkpoint_dir, registry.job, token, token, True), token)
    return compare_checkpoint_marker(registry, checkpoint_dir, in_etcd)


def read_checkpoint_marker(registry: Registry, checkpoint_dir: str) -> MarkerOutcome:
    """Compare this directory's marker with the job's in etcd, claiming nothing (``doctor``)."""
    return compare_checkpoint_marker(registry, checkpoint_dir, registry.checkpoint_marker())


def compare_checkpoint_marker(registry: Registry, checkpoint_dir: str, in_etcd: str | None) -> MarkerOutcome:
    path = marker_path(checkpoint_dir, registry.job)
    if in_etcd is None:
        return MarkerOutcome(decide_checkpoint_marker(checkpoint_dir, registry.job, None, None, False), None)
    # The first node writes its file right after claiming: give it a moment.
    in_file = poll(lambda: _read_marker(path), MARKER_WAIT_S, Backoff(0.1), until=lambda found: found == in_etcd)
    return MarkerOutcome(decide_checkpoint_marker(checkpoint_dir, registry.job, in_etcd, in_file, False), None)


def gather_etcd_latency(read: Callable[[], object], reads: int) -> list[float]:
    """Milliseconds each of ``reads`` calls of ``read`` (one etcd read) took."""
    latencies = []
    for _ in range(reads):
        start = time.perf_counter()
        read()
        latencies.append((time.perf_counter() - start) * 1000)
    return latencies


def _http_context(settings: EtcdSettings) -> ssl.SSLContext | None:
    if settings.protocol != "https":
        return None
    context = ssl.create_default_context(cafile=settings.cacert)
    if settings.cert and settings.key:
        context.load_cert_chain(settings.cert, settings.key)
    return context


def gather_clock_samples(settings: EtcdSettings, samples: int, spacing: float,
                         clock: Callable[[], float] | None = None) -> list[DateSample]:
    """Ask etcd's HTTP ``/version`` for its Date header ``samples`` times, ``spacing`` seconds apart."""
    clock = clock or wall_clock
    endpoint = settings.endpoints[0]
    url = f"{settings.protocol}://{endpoint}/version"
    context = _http_context(settings)
    found = []
    for i in range(samples):
        if i:
            time.sleep(spacing)  # spread the samples over a second, to narrow the bounds
        sent = clock()
        with urllib.request.urlopen(url, timeout=settings.read_timeout, context=context) as response:
            date = response.headers.get("Date")
        received = clock()
        if not date:
            raise ValueError(f"{url} sent no Date header")
        found.append(DateSample(sent, received, email.utils.parsedate_to_datetime(date).timestamp()))
    return found


def gather_clock(settings: EtcdSettings, samples: int, clock: Callable[[], float] | None = None) -> Check:
    try:
        found = gather_clock_samples(settings, samples, spacing=1.0 / samples, clock=clock)
    except (OSError, ValueError, urllib.error.URLError, ssl.SSLError) as exc:
        return decide_clock(None, str(getattr(exc, "reason", None) or exc))
    return decide_clock(clock_offset_bounds(found))


# -- running the checks -----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Report:
    checks: tuple[Check, ...]
    claimed_marker: str | None = None

    @property
    def failed(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if c.status is Status.FAIL)


def run_checks(*, settings: EtcdSettings | None, client: EtcdClient | None, etcd_error: str | None,
               registry: Registry | None, checkpoint_dir: str | None, local_addr: str,
               quick: bool, deep: bool = False, key_prefix: str = DEFAULT_KEY_PREFIX,
               prepare: bool = True) -> Report:
    """Every check this host can answer. ``client`` None: etcd is unreachable (``etcd_error``)
    or not given; ``registry`` None: no job to compare with. ``quick``: what up/join run.
    ``prepare``: create the checkpoint directory and claim the job's marker when this is its
    first node (up and join); without it (``elasticctl doctor``) nothing is changed but a probe
    file, removed again."""
    checks: list[Check] = [decide_versions(sys.version_info, installed_torch_version())]
    nodes: dict[str, dict] = {}
    if registry is not None:
        nodes = {n: r for n, r in registry.live_nodes().items() if r.get("pid") != os.getpid()}
        checks.append(decide_torch_agreement(installed_torch_version(),
                                             {n: r.get("torch") for n, r in nodes.items()}))
        checks.append(decide_checkpoint_health(registry.progress()))
    if deep:
        checks.append(gather_torch_build(launcher.visible_gpu_count()))
    if not quick:
        checks.append(gather_gpus(sorted(n for n, r in nodes.items() if r.get("gpus"))))
    checks.append(decide_interface(gather_interface(local_addr, nodes)))
    described = settings.describe() if settings else "(none)"
    if client is not None and settings is not None:
        read = registry.read_spec if registry else (lambda: read_probe(client, key_prefix))
        checks.append(decide_etcd(described, gather_etcd_latency(read, 3 if quick else 7), None))
        checks.append(gather_clock(settings, 1 if quick else 6))
    else:
        checks.append(decide_etcd(described, [], etcd_error))
    checks.append(gather_port())
    checks.append(gather_shm())
    claimed = None
    if checkpoint_dir is not None:
        missing = not prepare and not os.path.isdir(checkpoint_dir)
        created_under = None
        if missing:
            error, created_under = probe_creatable(checkpoint_dir)
        else:
            error = probe_writable(checkpoint_dir, create=prepare)
        free = None if error else psutil.disk_usage(created_under or checkpoint_dir).free
        checks.append(decide_checkpoint_dir(checkpoint_dir, error, free, created_under))
        if error is None and registry is not None:
            try:
                outcome = (gather_checkpoint_marker(registry, checkpoint_dir) if prepare
                           else read_checkpoint_marker(registry, checkpoint_dir))
            except OSError as exc:
                outcome = MarkerOutcome(decide_checkpoint_dir(checkpoint_dir, exc.strerror or str(exc)), None)
            checks.append(outcome.check)
            claimed = outcome.claimed_token
    else:
        checks.append(decide_checkpoint_dir(None, None))
    return Report(tuple(checks), claimed)


def refusal(report: Report, job: str) -> str | None:
    """The one sentence with which up/join refuse to join ``job``, or None when nothing failed."""
    if not report.failed:
        return None
    first = report.failed[0]
    more = f" (and {len(report.failed) - 1} more failed check(s) above)" if len(report.failed) > 1 else ""
    fix = first.fix[:1].lower() + first.fix[1:].rstrip(".")
    return f"This host cannot join job '{job}': {first.detail}{more}; {fix}."

