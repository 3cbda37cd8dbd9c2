"""A real etcd cluster of several members on free loopback ports, for the tests of what only
several members show (a failover, a version check across members)."""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
from pathlib import Path

from support.helpers import wait_for

from elasticctl import processes
from elasticctl.embedded_etcd import free_port
from elasticctl.errors import ElasticctlError
from elasticctl.etcd.client import EtcdClient, EtcdSettings, member_versions


@dataclasses.dataclass
class Cluster:
    client_endpoints: list[str]   # HOST:PORT of each member, in member order
    members: list[subprocess.Popen]

    @property
    def endpoints(self) -> str:
        return ",".join(self.client_endpoints)


@contextlib.contextmanager
def etcd_cluster(binary: str, size: int, directory: Path):
    """``size`` etcd members of ``binary`` on free loopback ports; yields the :class:`Cluster` once
    every member reports its version; every member is stopped on the way out."""
    ports = [(free_port(), free_port()) for _ in range(size)]
    initial = ",".join(f"m{i}=http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(ports))
    cluster = Cluster([f"127.0.0.1:{client}" for client, _ in ports], [])
    try:
        for i, (client_port, peer_port) in enumerate(ports):
            with open(directory / f"m{i}.log", "wb") as log:  # the member keeps its own descriptor
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

            wait_for(every_member_answers, 60, f"the {size} etcd members to answer")
        yield cluster
    finally:
        for member in cluster.members:
            processes.terminate(member, timeout=5)
