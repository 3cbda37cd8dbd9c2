"""Hosts made of Linux network namespaces: a bridge, one namespace per host, links that can be cut.

The compose topology without containers: namespace ``<prefix>-br`` holds a bridge;
every host ``h`` gets namespace ``<prefix>-h`` with loopback up and ``eth0``, the end
of a veth pair whose other end (``v-h``) is a port of the bridge. The pair is
created inside the bridge namespace with its peer placed straight into the host's,
so the root namespace never sees an interface, address or route of ours.

Each topology records its owner's pid under STATE_DIR; a later run deletes the
namespaces (and ends the processes inside) of an owner that died without cleaning
up, e.g. a pytest killed by a CI timeout.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Self

import psutil
from support.helpers import Node

from elasticctl import processes

STATE_DIR = Path("/tmp/elasticctl-netns")
# A private range unlikely to be routed anywhere; it only ever exists inside our namespaces.
DEFAULT_SUBNET = "10.213.57"
IFNAME = "eth0"  # a host's interface: the same name in every host namespace
# grpc (the etcd client) would send our private addresses to a proxy of the real network.
PROXY_VARS = ("http_proxy", "https_proxy", "grpc_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


class NetnsError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result


def unavailable_reason() -> str | None:
    """Why this machine cannot build namespace topologies, or None if it can (probes for real)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the 'ip' binary (iproute2) is not installed"
    probe = Topology(hosts=["p"])
    try:
        probe.create()
    except NetnsError as exc:
        return f"cannot build a namespace topology here: {exc}"
    finally:
        probe.destroy()
    return None


def sweep_stale() -> None:
    """Remove the namespaces of topologies whose owner process is gone."""
    if not STATE_DIR.is_dir():
        return
    existing = set(_ip("netns", "list", check=False).stdout.split())
    for owner_file in STATE_DIR.glob("*.pid"):
        try:
            pid = int(owner_file.read_text().strip())
            written = owner_file.stat().st_mtime
        except (OSError, ValueError):
            continue
        if _owner_alive(pid, written):
            continue
        prefix = owner_file.stem
        for ns in sorted(n for n in existing if n.startswith(prefix + "-")):
            _kill_inside(ns)
            _ip("netns", "del", ns, check=False)
        owner_file.unlink(missing_ok=True)


def _owner_alive(pid: int, written: float) -> bool:
    """Whether the process that wrote an owner file at ``written`` still runs (not a zombie, not a reused pid)."""
    try:
        owner = psutil.Process(pid)
        return owner.status() != psutil.STATUS_ZOMBIE and owner.create_time() <= written + 1
    except psutil.NoSuchProcess:
        return False


def _kill_inside(ns: str) -> None:
    """SIGKILL, by pid, every process still inside namespace ``ns`` (only ours ever run there)."""
    for _ in range(3):
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split() if p.isdigit()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        psutil.wait_procs([p for p in map(_process, pids) if p], timeout=5)


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


class Topology:
    """A bridge namespace plus one namespace per host, addressed ``<subnet>.<10+i>/24``."""

    def __init__(self, hosts: list[str], subnet: str = DEFAULT_SUBNET, prefix: str | None = None) -> None:
        # "ec" + 6 hex: unique per run, and "v-<host>" stays within IFNAMSIZ (15).
        self.prefix = prefix or "ec" + secrets.token_hex(3)
        self.hosts = list(hosts)
        for host in self.hosts:
            if len(f"v-{host}") > 15 or not host.replace("-", "").isalnum():
                raise ValueError(f"The host name '{host}' must be short and alphanumeric.")
        self.bridge_ns = f"{self.prefix}-br"
        self._addresses = {host: f"{subnet}.{10 + i}" for i, host in enumerate(self.hosts)}
        self._created: list[str] = []
        self.processes: list[HostProcess] = []
        self._owner_file = STATE_DIR / f"{self.prefix}.pid"

    # -- names -----------------------------------------------------------------------------

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def addr(self, host: str) -> str:
        return self._addresses[host]

    def exec_prefix(self, host: str) -> list[str]:
        """Prefix a command with this to run it on ``host`` (ip execs in place: the pid stays the same)."""
        return ["ip", "netns", "exec", self.ns(host)]

    # -- lifecycle -------------------------------------------------------------------------

    def create(self) -> Topology:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self._owner_file.write_text(str(os.getpid()))
        try:
            self._add_ns(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "lo", "up")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            for host in self.hosts:
                ns, port = self.ns(host), f"v-{host}"
                self._add_ns(ns)
                _ip("-n", self.bridge_ns, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", ns)
                _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0")
                _ip("-n", self.bridge_ns, "link", "set", port, "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", IFNAME)
                _ip("-n", ns, "link", "set", "lo", "up")  # localhost inside the host, not the root's
                _ip("-n", ns, "link", "set", IFNAME, "up")
        except BaseException:
            self.destroy()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._created.append(ns)

    def spawn(self, host: str, name: str, command: list[str], log_dir: Path, env: dict | None = None) -> HostProcess:
        """Run ``command`` on ``host``; the topology ends it (and everything it started) in destroy()."""
        process = HostProcess(name, [*self.exec_prefix(host), *command], log_dir, env)
        self.processes.append(process)
        return process

    def destroy(self) -> None:
        """Delete every namespace this topology made (with its interfaces), ending what still runs there."""
        for process in self.processes:
            process.signal_tree(signal.SIGKILL)  # a test teardown: no graceful leave needed
        for process in self.processes:
            process.stop()
        self.processes.clear()
        for ns in reversed(self._created):
            _kill_inside(ns)
            _ip("netns", "del", ns, check=False)
        self._created.clear()
        self._owner_file.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self.create()

    def __exit__(self, *exc_info) -> None:
        self.destroy()

    # -- faults ----------------------------------------------------------------------------

    def cut(self, host: str) -> None:
        """Pull the host's cable at the switch: its packets vanish, nobody gets a reset."""
        _ip("-n", self.bridge_ns, "link", "set", f"v-{host}", "down")

    def heal(self, host: str) -> None:
        _ip("-n", self.bridge_ns, "link", "set", f"v-{host}", "up")

    # -- probes ----------------------------------------------------------------------------

    def run(self, host: str, command: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([*self.exec_prefix(host), *command], check=False, capture_output=True,
                              text=True, timeout=timeout, env=host_env())

    def connects(self, src: str, dst_addr: str, port: int, timeout: float = 1.0) -> bool:
        """Whether ``src`` opens a TCP connection to ``dst_addr:port`` within ``timeout``."""
        code = f"import socket; socket.create_connection(({dst_addr!r}, {port}), timeout={timeout}).close()"
        return self.run(src, [sys.executable, "-c", code], timeout=timeout + 30).returncode == 0

    def tcp_peers(self, host: str) -> set[str]:
        """Remote addresses of the established TCP connections of ``host``."""
        out = self.run(host, ["ss", "-Htn", "state", "established"]).stdout
        peers = {line.split()[-1].rsplit(":", 1)[0].strip("[]") for line in out.splitlines() if line.strip()}
        return {p.removeprefix("::ffff:") for p in peers}  # IPv4 peers of dual-stack listeners

    def namespaces(self) -> list[str]:
        return list(self._created)


def existing_namespaces(prefix: str) -> list[str]:
    return [n for n in _ip("netns", "list", check=False).stdout.split() if n.startswith(prefix + "-")]


def host_env(extra: dict | None = None) -> dict[str, str]:
    """The environment of a process on a host: ours, minus proxies.

    No GLOO_SOCKET_IFNAME: the shared hostname resolves to 127.0.0.1 here, so the
    job forms only because elasticctl points gloo at the --local-addr interface.
    """
    env = {k: v for k, v in os.environ.items() if k not in PROXY_VARS and k != "GLOO_SOCKET_IFNAME"}
    env["PYTHONUNBUFFERED"] = "1"
    return {**env, **(extra or {})}


class HostProcess(Node):
    """helpers.Node with the host environment (Node itself adds os.environ wholesale)."""

    def __init__(self, name: str, command: list[str], log_dir: Path, env: dict | None = None) -> None:
        self.name = name
        self.command = command
        self.log_path = log_dir / f"{name}.log"
        with open(self.log_path, "ab") as log:
            self.process = processes.spawn(command, stdout=log, stderr=subprocess.STDOUT,
                                           env=host_env({"ELASTICCTL_NODE": name, **(env or {})}))
