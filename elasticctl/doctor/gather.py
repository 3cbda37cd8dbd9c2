"""The doctor's I/O: what each decision of ``checks.py`` is made from (psutil,
nvidia-smi, etcd, the checkpoint directory and its marker, etcd's clock)."""

from __future__ import annotations

import contextlib
import dataclasses
import email.utils
import re
import shlex
import sys
import errno
import importlib.metadata
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence

import psutil

from elasticctl import addressing, launcher
from elasticctl.doctor.checks import (
    NVIDIA_SMI_QUERY,
    AdvertisedFacts,
    Check,
    DateSample,
    EtcdMember,
    InterfaceFacts,
    RemoteNode,
    clock_offset_bounds,
    decide_checkpoint_marker,
    decide_clock,
    decide_code,
    decide_custom,
    decide_devices,
    decide_etcd_members,
    decide_gpus,
    decide_port,
    decide_shm,
    decide_torch_build,
    parse_device_probe,
    parse_nvidia_smi,
)
from elasticctl.doctor.code import hash_code, hash_file, script_file
from elasticctl.errors import ConfigError, ElasticctlError
from elasticctl.etcd.client import Endpoint, EtcdClient, EtcdSettings, member_versions
from elasticctl.etcd.retry import Backoff, poll
from elasticctl.job.registry import Registry
from elasticctl.job.spec import JobSpec


# The admission checks that run a process: each bounded (and all of them by the caller's budget).
DEVICE_PROBE_TIMEOUT_S = 8.0
CUSTOM_CHECK_TIMEOUT_S = 10.0
# A checkpoint as elasticctl.train writes them (checkpoint.py, checkpoints/sharded.py): a file
# complete once its digest is there, or a directory renamed into place complete.
_CHECKPOINT_FILE_RE = re.compile(r"step-([0-9]{8,})\.pt")
_CHECKPOINT_DIR_RE = re.compile(r"step-([0-9]{8,})")
_CHECKPOINT_DIGEST_SUFFIX = ".sha256"

# How long a node that lost the race to claim the marker waits for the winner to write it.
MARKER_WAIT_S = 2.0


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


def _reached_on_this_host(addr: str, mine: set[str]) -> bool:
    """Whether a published address is loopback or this host's. A name counts by what it resolves to
    here: several nodes on one host may advertise names that all resolve to loopback (several
    slurmd on one machine, each node advertising its Slurm node name); a name that does not
    resolve counts as remote."""
    if launcher.is_loopback(addr) or addr in mine:
        return True
    try:
        resolved = {info[4][0].split("%")[0] for info in socket.getaddrinfo(addr, None)}
    except (socket.gaierror, UnicodeError):
        return False
    return any(launcher.is_loopback(a) or a in mine for a in resolved)


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
        if r.get("addr") and not _reached_on_this_host(r["addr"], mine)
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


def gather_advertised(local_addr: str, etcd: Endpoint | None, timeout: float = 1.0) -> AdvertisedFacts:
    """Where ``local_addr`` lives on this host, and the local address of a TCP connection to
    ``etcd`` (the address etcd sees this host connect from; etcd has no cheap way to say it)."""
    try:
        resolved = tuple(dict.fromkeys(info[4][0].split("%")[0] for info in socket.getaddrinfo(local_addr, None)))
    except (socket.gaierror, UnicodeError):
        resolved = (local_addr,)
    holder = next((i for i in addressing.gather_interfaces() if set(i.addresses) & set(resolved)), None)
    source = None
    if etcd is not None:
        try:
            with socket.create_connection((etcd.host, etcd.port), timeout=timeout) as connection:
                source = connection.getsockname()[0].split("%")[0].removeprefix("::ffff:")
        except (OSError, UnicodeError):
            source = None  # unreachable: the etcd check says so
    return AdvertisedFacts(local_addr=local_addr, addresses=resolved,
                           interface=holder.name if holder else None, kind=holder.kind if holder else None,
                           local_only=bool(holder and holder.local_only),
                           etcd_endpoint=str(etcd) if etcd is not None else None, etcd_source=source)


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


def gather_etcd_members(client: EtcdClient, timeout: float = 2.0) -> Check:
    """The job's etcd members and the version each reports (``timeout``: per member)."""
    try:
        members = member_versions(client, timeout)
    except ElasticctlError as exc:
        return decide_etcd_members([], str(exc)[:1].lower() + str(exc)[1:].rstrip("."))
    return decide_etcd_members([EtcdMember(m.name, m.version, m.error) for m in members])


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


def newest_checkpoint_bytes(checkpoint_dir: str) -> int | None:
    """The size on disk of the newest complete checkpoint in ``checkpoint_dir`` (a file with its
    digest, or a sharded checkpoint's directory, its files summed), or None when it holds none."""
    newest: tuple[int, str, bool] | None = None
    try:
        with os.scandir(checkpoint_dir) as entries:
            for entry in entries:
                as_file = _CHECKPOINT_FILE_RE.fullmatch(entry.name)
                as_dir = _CHECKPOINT_DIR_RE.fullmatch(entry.name)
                if as_file and entry.is_file() and os.path.exists(entry.path + _CHECKPOINT_DIGEST_SUFFIX):
                    found = (int(as_file[1]), entry.path, False)
                elif as_dir and entry.is_dir(follow_symlinks=False):
                    found = (int(as_dir[1]), entry.path, True)
                else:
                    continue
                if newest is None or found[0] > newest[0]:
                    newest = found
        if newest is None:
            return None
        _, path, is_dir = newest
        if not is_dir:
            return os.stat(path).st_size
        total = 0
        for root, _dirs, files in os.walk(path):
            for name in files:
                total += os.lstat(os.path.join(root, name)).st_size
        return total
    except OSError:
        return None  # unreadable: the writability probe says what is wrong


def gather_code(spec: JobSpec, host: str | None = None) -> Check:
    """This host's digests of the job's script and ``--code-hash`` paths, against its spec's."""
    host = host or socket.gethostname()
    found_script = found_code = error = None
    try:
        if spec.script_sha256 is not None:
            found_script = hash_file(script_file(spec.script, spec.module))
        if spec.code_sha256 is not None:
            found_code = hash_code(spec.code_paths)
    except ConfigError as exc:
        error = str(exc)
    except OSError as exc:
        error = f"{exc.filename or spec.script}: {exc.strerror or exc}"
    return decide_code(host, spec.script, spec.script_sha256, found_script, spec.code_paths,
                       spec.code_sha256, found_code, error)


def gather_devices(visible: int, timeout: float = DEVICE_PROBE_TIMEOUT_S) -> Check:
    """The ``devices`` check: the probe (a matmul on each GPU, an all-reduce across them) in its
    own bounded process; none without a visible GPU."""
    if visible <= 0:
        return decide_devices(visible, None)
    command = [sys.executable, "-m", "elasticctl.doctor.device_probe"]
    try:
        returncode, stdout, stderr = run_bounded(command, timeout, merge_stderr=False)
    except subprocess.TimeoutExpired:
        return decide_devices(visible, None, f"it did not finish within {timeout:.3g} s (a hung GPU or driver)")
    except OSError as exc:
        return decide_devices(visible, None, f"it cannot start: {exc.strerror or exc}")
    try:
        probe = parse_device_probe(stdout)
    except ValueError as exc:
        said = (stderr.strip().splitlines() or [""])[-1][:200]
        why = f"it exited with status {returncode} and {exc}" + (f" ({said})" if said else "")
        return decide_devices(visible, None, why)
    return decide_devices(visible, probe)


def gather_custom(command: str, timeout: float = CUSTOM_CHECK_TIMEOUT_S) -> Check:
    """A user's ``--check CMD``: run (shlex-split, no shell) with a timeout; exit 0 passes."""
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        return decide_custom(command, None, "", f"cannot be read as a command: {exc}")
    if not argv:
        return decide_custom(command, None, "", "is empty")
    if timeout <= 0:
        return decide_custom(command, None, "", "was not run: the admission checks' time was spent")
    try:
        returncode, output, _ = run_bounded(argv, timeout, merge_stderr=True)
    except subprocess.TimeoutExpired:
        return decide_custom(command, None, "", f"did not finish within {timeout:.3g} s")
    except OSError as exc:
        return decide_custom(command, None, "", f"cannot be run: {exc.strerror or exc}")
    return decide_custom(command, returncode, output)


def run_bounded(argv: Sequence[str], timeout: float, merge_stderr: bool) -> tuple[int, str, str]:
    """Run ``argv`` (no shell) in a session of its own and return (status, stdout, stderr), at
    most 1 MiB of each; past ``timeout`` the whole session is killed (a child it left behind
    holding the output open included) and TimeoutExpired raised."""
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.communicate(timeout=1.0)
        raise
    finally:
        if process.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def text(raw: bytes | None) -> str:
        return (raw or b"")[: 1 << 20].decode("utf-8", "replace")

    return process.returncode, text(stdout), text(stderr)
