"""The doctor's pure decisions: facts in, a :class:`Check` (pass, warn or fail, and the
one-sentence fix) out; no I/O, so every verdict is table-tested."""

from __future__ import annotations

import dataclasses
import enum
import re
import statistics
import sys
from collections.abc import Mapping, Sequence

from elasticctl.errors import quote

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
# etcd 3.5.0 to 3.5.2 stored a member's applied index ahead of the writes it stood for: a member
# restarted after a crash under load could skip committed writes, and its data then silently
# differed from the other members' (etcd's v3.5 data-inconsistency postmortem). Fixed in 3.5.3.
INCONSISTENT_ETCD = ((3, 5, 0), (3, 5, 2))
# An etcd server version as a member reports it: '3.5.1', '3.6.0-rc.3'. A pre-release counts as
# its release. ASCII digits only, bounded: the text comes from the network.
_ETCD_VERSION_RE = re.compile(r"([0-9]{1,4})\.([0-9]{1,4})\.([0-9]{1,4})(?:[-+][0-9A-Za-z.+-]{1,40})?")

GIB = float(1 << 30)
# Free space on the checkpoint storage, in sizes of the job's newest checkpoint: below the first
# the next checkpoint may not fit (a FAIL), below the second a few more will not (a WARN).
CHECKPOINT_ROOM_FAIL = 2
CHECKPOINT_ROOM_WARN = 5
# The device probe: a matmul on each GPU against the CPU's (relative to the result's largest value).
DEVICE_MATMUL_TOLERANCE = 1e-3
DEVICE_PROBE_MAX_DEVICES = 64


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


def skipped(name: str, why: str) -> Check:
    """A check not run (``--skip-check``, no GPU): it passes, saying so."""
    return Check(name, Status.PASS, f"skipped: {why}")


def size_text(count: int) -> str:
    """Bytes in the unit that reads best: '512 B', '3.0 MiB', '1.5 GiB'."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def _printable(text: str, limit: int = 200) -> str:
    """Untrusted text as part of one line: control characters escaped, bounded."""
    text = text[:limit]
    return text if text.isprintable() else repr(text)[1:-1]


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


@dataclasses.dataclass(frozen=True)
class AdvertisedFacts:
    """The address this node advertises, where it lives, and where etcd sees this host come from."""

    local_addr: str
    addresses: tuple[str, ...]          # what local_addr resolves to
    interface: str | None = None        # the interface holding it, None when none does
    kind: str | None = None             # that interface's kind (elasticctl.addressing)
    local_only: bool = False            # a kind other hosts usually cannot reach (a bridge, docker0, ...)
    etcd_endpoint: str | None = None
    etcd_source: str | None = None      # the local address of a TCP connection to etcd; None: unknown


def _loopback_address(address: str) -> bool:
    return address == "localhost" or address.startswith("127.") or address == "::1"


def decide_advertised(facts: AdvertisedFacts) -> Check:
    """Warn when the advertised address is one other hosts are unlikely to reach: on a
    host-local virtual interface, or not the address etcd sees this host connect from."""
    name = "address"
    problems = []
    if facts.interface is not None and facts.local_only:
        problems.append(f"the advertised address {facts.local_addr} is on {facts.interface}, a {facts.kind} "
                        "interface that other hosts usually cannot reach")
    mine = facts.addresses or (facts.local_addr,)
    seen = facts.etcd_source
    both_loopback = seen is not None and _loopback_address(seen) and all(_loopback_address(a) for a in mine)
    if seen is not None and seen not in mine and not both_loopback:
        problems.append(f"etcd at {facts.etcd_endpoint} sees this host connect from {seen}, not from the "
                        f"advertised {facts.local_addr}")
    if problems:
        return Check(name, Status.WARN, "; ".join(problems),
                     "Pass --local-addr with this host's address on the network the other nodes share "
                     "(the one it reaches etcd from, unless a separate training network is meant).")
    where = f" on {facts.interface} ({facts.kind})" if facts.interface else ""
    agreed = ", the address etcd sees this host connect from" if seen is not None else ""
    return passed(name, f"advertising {facts.local_addr}{where}{agreed}")


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


def parse_etcd_version(text: object) -> tuple[int, int, int] | None:
    """``text`` as an etcd server version (major, minor, patch), else None."""
    match = _ETCD_VERSION_RE.fullmatch(text) if isinstance(text, str) else None
    return (int(match[1]), int(match[2]), int(match[3])) if match else None


@dataclasses.dataclass(frozen=True)
class EtcdMember:
    """A member of the job's etcd cluster: its name and the version it reported, both text from
    the network; ``version`` None: not read, and ``error`` says why."""

    name: str
    version: str | None
    error: str | None = None


def _member(member: EtcdMember) -> str:
    return quote(member.name, 40) if member.name else "an unnamed member"


def _why_unknown(member: EtcdMember) -> str:
    why = (member.error or "not asked").rstrip(".")[:200]
    return why if why.isprintable() else repr(why)[1:-1]  # control characters escaped: one line


def decide_etcd_members(members: Sequence[EtcdMember], error: str | None = None) -> Check:
    """Warn when the job's etcd has several members and any runs 3.5.0-3.5.2 (``error``: why the
    member list could not be read). One member has no other to disagree with."""
    name = "etcd-version"
    if error is not None:
        return Check(name, Status.WARN, f"cannot list the etcd members to check their versions: {error}",
                     "Let this etcd user list the cluster's members (etcdctl member list).")
    if not members:
        return passed(name, "etcd listed no member: nothing to check")
    low, high = INCONSISTENT_ETCD
    read = {m: parse_etcd_version(m.version) for m in members}
    shown = ", ".join(
        f"{_member(m)} {m.version}" if read[m] else
        f"{_member(m)} unknown ({_why_unknown(m)})" if m.version is None else
        f"{_member(m)} unreadable version {quote(m.version, 40)}"
        for m in sorted(members, key=lambda m: m.name))
    if len(members) == 1:
        return passed(name, f"1 member ({shown}): the etcd 3.5.0-3.5.2 data-inconsistency bug needs "
                            "several members to disagree")
    affected = [m for m in members if read[m] and low <= read[m] <= high]
    if affected:
        return Check(name, Status.WARN,
                     f"{len(affected)} of the {len(members)} etcd members run 3.5.0-3.5.2 ({shown}): a member "
                     "restarted after a crash under load can silently lose committed writes the others keep",
                     "Upgrade the etcd members to 3.5.3 or later.")
    return passed(name, f"{len(members)} members ({shown})")


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
                          created_under: str | None = None, newest_checkpoint_bytes: int | None = None) -> Check:
    """``created_under``: the path does not exist yet, and this existing ancestor lets the job
    create it (the doctor does not: a check must not change what it checks).
    ``newest_checkpoint_bytes``: the size on disk of the job's newest checkpoint in it (None or 0:
    none yet). The next checkpoint is written beside it before the oldest is pruned: free space
    below :data:`CHECKPOINT_ROOM_FAIL` times its size fails, below :data:`CHECKPOINT_ROOM_WARN`
    times warns."""
    name = "checkpoint-dir"
    if path is None:
        return passed(name, "no checkpoint directory given")
    if error is not None:
        return Check(name, Status.FAIL, f"the checkpoint directory {_quoted(path)} is not writable: {error}",
                     "Create the directory with write permission for this user, or pass another --checkpoint-dir.")
    free = "" if free_bytes is None else f", {free_bytes / GIB:.1f} GiB free"
    if newest_checkpoint_bytes and free_bytes is not None:
        room = (f"{_quoted(path)} has {size_text(free_bytes)} free and the job's newest checkpoint takes "
                f"{size_text(newest_checkpoint_bytes)}")
        fix = (f"Free space on the checkpoint storage: at least {CHECKPOINT_ROOM_FAIL}x the newest checkpoint "
               f"for the next one to be written, {CHECKPOINT_ROOM_WARN}x to keep a few.")
        if free_bytes < CHECKPOINT_ROOM_FAIL * newest_checkpoint_bytes:
            return Check(name, Status.FAIL, f"{room}: no room for {CHECKPOINT_ROOM_FAIL} more", fix)
        if free_bytes < CHECKPOINT_ROOM_WARN * newest_checkpoint_bytes:
            return Check(name, Status.WARN, f"{room}: room for fewer than {CHECKPOINT_ROOM_WARN} more", fix)
        free += f", room for {free_bytes // newest_checkpoint_bytes} checkpoint(s) of the newest one's size"
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


# -- admission checks: the code, the devices, the user's own ----------------------------------

SAME_CODE_FIX = ("Install the same code on every host (the job's script and its --code-hash paths), "
                 "then start this node again.")


def _digest(value: object) -> str | None:
    return value if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) else None


def decide_code(host: str, script: str, expected_script: str | None, found_script: str | None,
                code_paths: Sequence[str] = (), expected_code: str | None = None,
                found_code: str | None = None, error: str | None = None) -> Check:
    """Does this host run the job's code? ``expected_*``: the digests in the job's spec (None: it
    records none: published by an older elasticctl, or no --code-hash); ``found_*``: this host's;
    ``error``: why this host's files could not be hashed (a sentence's clause)."""
    name = "code"
    expected_script, expected_code = _digest(expected_script), _digest(expected_code)
    if expected_script is None and expected_code is None:
        return passed(name, "the job's spec records no digest of its code (an older elasticctl published it): "
                            "nothing to compare")
    if error is not None:
        return Check(name, Status.FAIL, f"cannot hash the job's code on host {host}: {error.rstrip('.')}",
                     SAME_CODE_FIX)
    differ = []
    if expected_script is not None and found_script != expected_script:
        differ.append(f"the script {_quoted(script)} differs on host {host}: sha256 "
                      f"{(found_script or 'none')[:12]} here, {expected_script[:12]} in the job's spec")
    paths = ", ".join(code_paths)
    if expected_code is not None and found_code != expected_code:
        differ.append(f"the code under {paths} differs on host {host}: sha256 "
                      f"{(found_code or 'none')[:12]} here, {expected_code[:12]} in the job's spec")
    if differ:
        return Check(name, Status.FAIL, "; ".join(differ), SAME_CODE_FIX)
    what = [f"script {_quoted(script)} ({expected_script[:12]})"] if expected_script else []
    what += [f"code under {paths} ({expected_code[:12]})"] if expected_code else []
    return passed(name, f"{' and '.join(what)} as in the job's spec")


@dataclasses.dataclass(frozen=True)
class DeviceResult:
    """One GPU's matmul against the CPU's: ``error`` the largest difference relative to the
    result's largest value, ``failure`` why it could not be computed."""

    index: int
    name: str
    error: float | None
    failure: str | None = None


@dataclasses.dataclass(frozen=True)
class DeviceProbe:
    """What ``python -m elasticctl.doctor.device_probe`` found (:func:`parse_device_probe`).
    ``failure``: why it checked no device at all (no CUDA in torch); ``collective``: 'pass',
    'fail' or 'skipped', and why."""

    devices: tuple[DeviceResult, ...] = ()
    failure: str | None = None
    collective: str = "skipped"
    collective_detail: str = ""


def parse_device_probe(text: str) -> DeviceProbe:
    """The probe's one JSON line (its last line of output: untrusted, like anything a subprocess
    prints). ValueError, naming what is wrong, when it is not the probe's document."""
    import json

    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError("it printed nothing")
    try:
        data = json.loads(lines[-1][:100_000])
    except ValueError:
        raise ValueError(f"it printed {_printable(lines[-1], 80)!r}, not its JSON line") from None
    if not isinstance(data, dict):
        raise ValueError("its JSON line is not an object")

    def text_of(value: object, what: str) -> str:
        if not isinstance(value, str):
            raise ValueError(f"its {what} is not text")
        return _printable(value)

    failure = data.get("failure")
    devices = data.get("devices", [])
    if not isinstance(devices, list) or len(devices) > DEVICE_PROBE_MAX_DEVICES:
        raise ValueError("its device list is malformed")
    results = []
    for item in devices:
        if not isinstance(item, dict):
            raise ValueError("a device of its list is not an object")
        index, error = item.get("index"), item.get("error")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < DEVICE_PROBE_MAX_DEVICES:
            raise ValueError("a device's index is malformed")
        if error is not None and (isinstance(error, bool) or not isinstance(error, (int, float))
                                  or not error >= 0):  # NaN fails this too
            raise ValueError(f"GPU {index}'s matmul difference is malformed")
        bad = item.get("failure")
        results.append(DeviceResult(index, text_of(item.get("name", ""), "device name"),
                                    None if error is None else float(error),
                                    None if bad is None else text_of(bad, "device failure")))
        if results[-1].error is None and results[-1].failure is None:
            raise ValueError(f"GPU {index} has neither a result nor a failure")
    collective = data.get("collective", {})
    if not isinstance(collective, dict) or collective.get("status", "skipped") not in ("pass", "fail", "skipped"):
        raise ValueError("its collective result is malformed")
    return DeviceProbe(tuple(results), None if failure is None else text_of(failure, "failure"),
                       collective.get("status", "skipped"),
                       text_of(collective.get("detail", ""), "collective detail"))


def decide_devices(visible: int, probe: DeviceProbe | None, error: str | None = None,
                   tolerance: float = DEVICE_MATMUL_TOLERANCE) -> Check:
    """Do this host's GPUs compute? ``visible``: GPUs this node may use (none: nothing to probe);
    ``probe``: what the probe found, or ``error``: why it gave no answer (it crashed, timed out,
    printed something else)."""
    name = "devices"
    if visible <= 0:
        return skipped(name, "no GPU visible")
    fix = "Drain this host and have its GPUs checked (or hide a bad one with CUDA_VISIBLE_DEVICES)."
    if error is not None or probe is None:
        return Check(name, Status.FAIL, f"the probe of the {visible} visible GPU(s) failed: "
                     f"{(error or 'no answer').rstrip('.')}",
                     "Check the GPUs with nvidia-smi and that torch is a CUDA build that can use them.")
    if probe.failure is not None:
        return Check(name, Status.FAIL, f"the {visible} visible GPU(s) cannot be used: {probe.failure.rstrip('.')}",
                     "Install a CUDA build of torch that this host's driver supports.")
    problems = [f"GPU {d.index} failed a matmul: {d.failure.rstrip('.')}" for d in probe.devices if d.failure]
    problems += [f"GPU {d.index}'s matmul differs from the CPU's by {d.error:.2g} (above {tolerance:g})"
                 for d in probe.devices if d.error is not None and d.error > tolerance]
    if len(probe.devices) != visible:
        problems.append(f"torch sees {len(probe.devices)} of the {visible} visible GPU(s)")
    if probe.collective == "fail":
        problems.append(f"an all-reduce across the GPUs failed: {probe.collective_detail.rstrip('.')}")
    if problems:
        return Check(name, Status.FAIL, "; ".join(problems), fix)
    worst = max((d.error for d in probe.devices if d.error is not None), default=0.0)
    collective = ("an all-reduce across them agrees" if probe.collective == "pass"
                  else f"all-reduce not checked ({probe.collective_detail or 'skipped'})")
    names = ", ".join(f"{d.index}: {d.name}" for d in probe.devices)
    return passed(name, f"{len(probe.devices)} GPU(s) ({names}) compute a matmul as the CPU does "
                        f"(largest difference {worst:.2g}); {collective}")


def first_line(output: str) -> str:
    """The first non-blank line of a command's output, as one bounded printable line."""
    for line in output.splitlines():
        if line.strip():
            return _printable(line.strip())
    return ""


def decide_custom(command: str, returncode: int | None, output: str, error: str | None = None) -> Check:
    """A user's own admission check (``--check CMD``): exit 0 passes; anything else fails with
    its first line of output. ``error``: it could not be run or did not finish."""
    name = "custom"
    shown = quote(command, 80)
    if error is not None:
        return Check(name, Status.FAIL, f"the check {shown} {error.rstrip('.')}",
                     "Fix the check or this host (or skip it with --skip-check custom).")
    said = first_line(output)
    if returncode != 0:
        return Check(name, Status.FAIL, f"the check {shown} exited with status {returncode}"
                     + (f": {said}" if said else " and printed nothing"),
                     "Fix what the check reports on this host, then start this node again.")
    return passed(name, f"the check {shown} passed" + (f": {said}" if said else ""))
