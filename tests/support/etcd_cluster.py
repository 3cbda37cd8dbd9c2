"""A real etcd cluster of several members on free loopback ports, for the tests of what only
several members show (a failover, a version check across members)."""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
from pathlib import Path

from bench import harness

from elasticctl import processes
from elasticctl.embedded_etcd import free_port, port_taken
from elasticctl.errors import ElasticctlError
from elasticctl.etcd.client import EtcdClient, EtcdSettings, member_versions

# Tries with new ports when a member found one of its ports taken: the ports are chosen free, but
# another process (the other pytest worker's etcd, a job's store) may bind one before the member
# does, and six members' ports stay open to that for seconds on a loaded machine.
ATTEMPTS = 3
ANSWER_TIMEOUT = 60.0


@dataclasses.dataclass
class Cluster:
    client_endpoints: list[str]   # HOST:PORT of each member, in member order
    members: list[subprocess.Popen]

    @property
    def endpoints(self) -> str:
        return ",".join(self.client_endpoints)

    def stop(self) -> None:
        for member in self.members:
            processes.terminate(member, timeout=5)


def distinct_free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


@contextlib.contextmanager
def etcd_cluster(binary: str, size: int, directory: Path):
    """``size`` etcd members of ``binary`` on free loopback ports; yields the :class:`Cluster` once
    every member reports its version; every member is stopped on the way out. A start that
    fails (a member exits, or they do not all answer in time) fails the test with each member's
    log tail; one that lost a port to another process is tried again on new ports."""
    for attempt in range(1, ATTEMPTS + 1):
        cluster, failure = _start(binary, size, directory / f"attempt-{attempt}")
        if cluster is not None:
            break
        if not port_taken(failure) or attempt == ATTEMPTS:
            raise AssertionError(failure)
    try:
        yield cluster
    finally:
        cluster.stop()


def _start(binary: str, size: int, directory: Path) -> tuple[Cluster | None, str]:
    """The cluster once every member answers, else (None, why, with the members' log tails)."""
    directory.mkdir(parents=True)
    ports = distinct_free_ports(2 * size)
    pairs = list(zip(ports[::2], ports[1::2]))
    initial = ",".join(f"m{i}=http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(pairs))
    cluster = Cluster([f"127.0.0.1:{client}" for client, _ in pairs], [])
    logs = [directory / f"m{i}.log" for i in range(size)]
    for i, (client_port, peer_port) in enumerate(pairs):
        with open(logs[i], "wb") as log:  # the member keeps its own descriptor
            cluster.members.append(processes.spawn([
                binary, "--name", f"m{i}", "--data-dir", str(directory / f"m{i}"),
                "--listen-client-urls", f"http://127.0.0.1:{client_port}",
                "--advertise-client-urls", f"http://127.0.0.1:{client_port}",
                "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
                "--initial-cluster", initial, "--initial-cluster-state", "new", "--log-level", "warn",
            ], stdout=log, stderr=subprocess.STDOUT))

    with EtcdClient(EtcdSettings.from_string(cluster.endpoints, retry_timeout=2, read_timeout=2)) as client:
        def every_member_answers() -> bool:
            try:
                found = member_versions(client)
            except ElasticctlError:
                return False
            return len(found) == size and all(m.version for m in found)

        def a_member_exited() -> bool:
            return any(member.poll() is not None for member in cluster.members)

        if harness.wait_for(every_member_answers, ANSWER_TIMEOUT, interval=0.1, give_up=a_member_exited):
            return cluster, ""
    exited = [f"m{i} (exit {m.returncode})" for i, m in enumerate(cluster.members) if m.poll() is not None]
    cluster.stop()
    tails = "\n".join(f"--- m{i}.log:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-8:])
                      for i, log in enumerate(logs))
    why = (f"{', '.join(exited)} exited" if exited else
           f"the {size} etcd members did not all answer within {ANSWER_TIMEOUT:g} s")
    return None, f"{why} (ports {ports}):\n{tails}"
