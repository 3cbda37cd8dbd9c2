"""Rendezvous at scale: N real torchrun rendezvous handlers over P processes, one round each.

Handlers are built as torchrun builds them (the registry, RendezvousParameters with
min = max = N), in threads of P = min(16, ceil(N/64)) child processes (bench/rdzv_worker.py),
so one interpreter's GIL is not what is measured. Building them (connecting) is not timed:
every child reports ready, then all get "go" at once. Per round: seconds from "go" to the
last next_rendezvous() return, etcd raft proposals and writes (its /metrics before and
after), CPU seconds of the agents' processes and of etcd, and a check that every handler
got world size N and the ranks are exactly 0..N-1. A round that does not form within the
timeout is a result ("k/N in 120 s"), not a crash.

Backends: ``etcd3`` (elasticctl's etcd-native handler), ``etcd3-dynamic`` (torch's
DynamicRendezvousHandler on elasticctl's EtcdRendezvousBackend: the previous main's etcd3,
one pickled state every agent compare-and-swaps) and ``c10d`` (torch's, a TCPStore in agent 0).
``etcd3-light`` (bench/rdzv_light.py): the etcd3 protocol's own etcd operations by simulated
agents, asyncio and one etcd connection per process, for the sizes a real handler per agent
cannot reach on one machine (10,000).

``--hot N``: a hot re-formation instead (:func:`measure_hot`): N simulated workers in a sealed
generation, one lease revoked; seconds until the survivors' generation is sealed, and the watch
events etcd delivered, with the declaration followers (``followers``) or every
member following every declaration as in the earlier protocol (``every-member``).

Run: python -m bench.rendezvous --agents 8 64 256 1000 --backends etcd3 etcd3-dynamic c10d \
         --max-agents etcd3-dynamic=64 c10d=128 --repeat 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import psutil

from elasticctl import processes as procs
from elasticctl.embedded_etcd import EmbeddedEtcd, etcd_version, find_etcd_binary, free_port
from elasticctl.job.spec import whole_number

REPO = Path(__file__).resolve().parents[1]
ETCD3, DYNAMIC, C10D, LIGHT = "etcd3", "etcd3-dynamic", "c10d", "etcd3-light"
BACKENDS = (ETCD3, DYNAMIC, C10D)  # real handlers; LIGHT is asked for by name
LIGHT_AGENTS_PER_PROCESS = 2500  # asyncio agents per process: a process per core at 10,000
LIGHT_MAX_PROCESSES = 4
FOLLOWERS, EVERY_MEMBER = "followers", "every-member"  # who follows the declarations (hot)
PREFIX = "@rdzv "  # bench.rdzv_worker's protocol lines
AGENTS_PER_PROCESS = 64
MAX_PROCESSES = 16
SETUP_TIMEOUT = 300.0  # 16 children importing torch on a loaded 2-core machine
TEARDOWN_WAIT = 20.0  # the children give their handlers' shutdown() 10 s, then exit
# etcd counters read before and after a round (the same names in 3.4.23 and 3.5.1).
COUNTERS = {
    "etcd_server_proposals_committed_total": "proposals",  # raft entries: failed CAS txns count too
    "etcd_mvcc_put_total": "puts",
    "etcd_mvcc_delete_total": "deletes",  # lease expiry and revocation included
    "etcd_mvcc_txn_total": "txns",  # transactions of more than one operation only
    "etcd_mvcc_range_total": "ranges",
    "process_cpu_seconds_total": "cpu",  # etcd's CPU when there is no pid to ask (external etcd)
    "etcd_debugging_mvcc_events_total": "events",  # watch events sent, one per event per watcher
    "etcd_debugging_lease_granted_total": "lease_grants",  # a retried grant that had been applied: 2
    "etcd_debugging_server_lease_expired_total": "lease_expiries",  # renewals that came too late
}
# Requests etcd received, by gRPC method (grpc_server_started_total): compare-and-swaps show as
# Txn requests whether or not their compare held, a failed one still a raft proposal.
GRPC_METHODS = {"Txn": "txn_requests", "Put": "put_requests", "LeaseGrant": "grant_requests",
                "Range": "range_requests"}


def parse_max_agents(items: list[str]) -> dict[str, int]:
    """["c10d=128", "etcd3-dynamic=64"] -> {"c10d": 128, "etcd3-dynamic": 64}."""
    limits = {}
    for item in items:
        backend, sep, value = item.partition("=")
        if not sep or whole_number(value) is None:  # isdigit() also takes '²' and '٨'
            raise ValueError(f"--max-agents wants BACKEND=N, not {item!r}")
        limits[backend] = int(value)
    return limits


def planned(agents: int, backends: list[str] | tuple[str, ...],
            max_agents: dict[str, int]) -> list[str]:
    """The backends that run at ``agents``: those whose limit (if any) is not below it."""
    return [b for b in backends if max_agents.get(b) is None or agents <= max_agents[b]]


def default_processes(agents: int, backend: str = ETCD3) -> int:
    if backend == LIGHT:
        return max(1, min(LIGHT_MAX_PROCESSES, math.ceil(agents / LIGHT_AGENTS_PER_PROCESS), agents))
    return max(1, min(MAX_PROCESSES, math.ceil(agents / AGENTS_PER_PROCESS), agents))


def light_spec(agents: int, timeout: float, watchers: str = "agent") -> dict:
    """What bench.rdzv_light's agents need beyond the endpoint and run id: one round of
    min = max = N, torchrun_conf's last call, leases that outlive the round (no keep-alives)."""
    return {"mode": "round", "min_nodes": agents, "max_nodes": agents, "last_call": 1.0,
            "ttl": math.ceil(timeout) + 60, "watchers": watchers}


def torchrun_conf(timeout: float) -> dict:
    """--rdzv-conf as torchrun passes it (strings, plus its own "timeout")."""
    # The handlers' own join timeout must not decide before the harness does.
    return {"join_timeout": str(math.ceil(timeout) + 60), "last_call_timeout": "1", "timeout": 900}


def etcd_counters(endpoint: str) -> dict[str, float]:
    """The COUNTERS of the etcd at ``endpoint`` (host:port) by short name; {} if unreadable."""
    try:
        with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as response:
            text = response.read().decode()
    except OSError:
        return {}
    values: dict[str, float] = {}
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in COUNTERS:  # these counters carry no labels
                values[COUNTERS[name]] = float(value)
            for method, short in GRPC_METHODS.items():
                if name.startswith("grpc_server_started_total{") and f'grpc_method="{method}"' in name:
                    values[short] = values.get(short, 0.0) + float(line.rpartition(" ")[2])
    else:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                short = COUNTERS.get(sample.name)
                if sample.name == "grpc_server_started_total":
                    short = GRPC_METHODS.get(sample.labels.get("grpc_method", ""))
                if short:
                    values[short] = values.get(short, 0.0) + sample.value
    return values


def _cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


class _Children:
    """The child processes of one round and the messages they send (one queue for all)."""

    def __init__(self, count: int, logs: Path, module: str = "bench.rdzv_worker") -> None:
        self.messages: queue.Queue = queue.Queue()
        self.popens: list[subprocess.Popen] = []
        self.logs = [logs / f"child{k}.log" for k in range(count)]
        self._readers: list[threading.Thread] = []
        self.ps: list[psutil.Process] = []
        command = [sys.executable, "-m", module]
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
        self.killed = 0
        try:
            for k in range(count):
                with open(self.logs[k], "wb") as log:
                    # spawn: a new session, and SIGTERM from the kernel if this process dies.
                    popen = procs.spawn(command, cwd=REPO, stderr=log, **pipes)
                self.popens.append(popen)
                self.ps.append(psutil.Process(popen.pid))
                reader = threading.Thread(target=self._read, args=(k, popen), daemon=True)
                reader.start()
                self._readers.append(reader)
        except BaseException:
            self.stop()
            raise

    def _read(self, k: int, popen: subprocess.Popen) -> None:
        for line in popen.stdout:
            if line.startswith(PREFIX):
                self.messages.put((k, json.loads(line[len(PREFIX):])))
        self.messages.put((k, None))  # EOF: the child is gone

    def send(self, k: int, line: str) -> None:
        try:
            self.popens[k].stdin.write(line + "\n")
            self.popens[k].stdin.flush()
        except (BrokenPipeError, ValueError):  # it already exited; its EOF says so
            pass

    def log_tail(self, k: int) -> str:
        try:
            lines = self.logs[k].read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""

    def stop(self) -> list[str]:
        """Ask every child to shut its handlers down and exit, kill the rest; returns leftovers."""
        for k in range(len(self.popens)):
            self.send(k, "stop")
            try:
                self.popens[k].stdin.close()
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + TEARDOWN_WAIT
        for popen in self.popens:
            try:
                popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.killed += 1
                procs.terminate(popen, timeout=5)
        for reader in self._readers:
            reader.join(5)
        leftover = []
        for process in self.ps:
            try:
                if process.status() != psutil.STATUS_ZOMBIE:
                    leftover.append(f"{process.pid} {' '.join(process.cmdline())[:80]}")
            except psutil.NoSuchProcess:
                pass
        return leftover


def measure_round(backend: str, etcd: EmbeddedEtcd | str | None, agents: int,
                  processes: int | None = None, timeout: float = 120.0,
                  setup_timeout: float = SETUP_TIMEOUT, watchers: str = "agent") -> dict:
    """One round of ``agents`` handlers of ``backend``: a row, also for a round that fails.

    ``etcd``: the server etcd3 uses and whose metrics are read, an EmbeddedEtcd (its CPU is
    read with psutil) or a "host:port"; None starts a fresh one for this round (none for c10d,
    which gets a free port on 127.0.0.1 and its store in agent 0).
    """
    if etcd is None and backend != "c10d":
        with EmbeddedEtcd(client_port=0, peer_port=0) as fresh:
            return measure_round(backend, fresh, agents, processes, timeout, setup_timeout, watchers)
    count = min(processes or default_processes(agents, backend), agents)
    etcd_endpoint = etcd.endpoint if isinstance(etcd, EmbeddedEtcd) else etcd
    etcd_process = psutil.Process(etcd.pid) if isinstance(etcd, EmbeddedEtcd) and etcd.pid else None
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    endpoint = f"127.0.0.1:{free_port()}" if backend == "c10d" else etcd_endpoint
    row: dict = {"backend": backend, "agents": agents, "processes": count, "run_id": run_id,
                 "timeout": timeout, "completed": False, "correct": None, "agents_done": 0,
                 "agents_failed": 0, "seconds": None, "errors": []}
    spec = {"backend": backend, "endpoint": endpoint, "run_id": run_id, "agents": agents,
            "conf": torchrun_conf(timeout)}
    if backend == LIGHT:
        spec.update(light_spec(agents, timeout, watchers))
        row["watchers"] = watchers
    logs = Path(tempfile.mkdtemp(prefix="rdzv-bench-"))
    children = _Children(count, logs, "bench.rdzv_light" if backend == LIGHT else "bench.rdzv_worker")
    try:
        _round(children, row, spec, etcd_endpoint, etcd_process, timeout, setup_timeout)
    finally:
        row["leftover"] = children.stop()
        row["processes_killed"] = children.killed  # did not exit within TEARDOWN_WAIT of "stop"
        row["pids"] = [process.pid for process in children.ps]
        row["shutdown_stuck"] = 0
        while not children.messages.empty():
            _, message = children.messages.get()
            row["shutdown_stuck"] += (message or {}).get("stuck", 0)
        shutil.rmtree(logs, ignore_errors=True)
    return row


def _counter_deltas(row: dict, before: dict, after: dict, per: int) -> None:
    """etcd's counters over a measurement into ``row``: totals, writes, and per agent (or worker)."""
    for name in ("proposals", "puts", "deletes", "txns", "ranges", "events", "lease_grants", "lease_expiries",
                 *GRPC_METHODS.values()):
        if name in before and name in after:
            row[name] = int(after[name] - before[name])
    if "puts" in row and "deletes" in row:
        row["writes"] = row["puts"] + row["deletes"]
    for name in ("proposals", "writes", "events", "lease_grants", "txn_requests"):
        if name in row:
            row[f"{name}_per_agent"] = round(row[name] / per, 2)


def _round(children: _Children, row: dict, spec: dict, etcd_endpoint: str | None,
           etcd_process: psutil.Process | None, timeout: float, setup_timeout: float) -> None:
    agents, count = spec["agents"], len(children.popens)
    # Contiguous blocks: agent 0 (c10d's store host) is built first, by child 0.
    for k in range(count):
        indices = list(range(k * agents // count, (k + 1) * agents // count))
        children.send(k, json.dumps({**spec, "indices": indices}))

    ready, rss, base_rss, setup = 0, 0, 0, 0.0
    deadline = time.monotonic() + setup_timeout
    while ready < count:
        try:
            k, message = children.messages.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            row["errors"].append(
                f"setup: {count - ready} of {count} processes not ready in {setup_timeout:g} s")
            return
        if message is None or "setup_error" in message:
            error = (message["setup_error"] if message
                     else f"exited while building: {children.log_tail(k)}")
            row["errors"].append(f"setup, process {k}: {error}")
            return
        if "ready" in message:
            ready, setup = ready + 1, max(setup, message["setup_s"])
            rss, base_rss = rss + message["rss"], base_rss + message["base_rss"]
    row["setup_s"] = round(setup, 2)
    row["rss_mb"] = round(rss / 2**20)  # all agents' processes: torch itself plus N handlers
    # What the handlers add (their etcd clients' grpc channels, c10d's store sockets):
    row["rss_per_agent_kb"] = round((rss - base_rss) / 1024 / agents)

    before = etcd_counters(etcd_endpoint) if etcd_endpoint else {}
    etcd_ps = [etcd_process] if etcd_process else []
    cpu_agents, cpu_etcd = _cpu_seconds(children.ps), _cpu_seconds(etcd_ps)
    start = time.time()
    for k in range(count):
        children.send(k, "go")
    deadline = time.monotonic() + timeout
    done: dict[int, dict] = {}
    failed: dict[int, str] = {}
    gone: set[int] = set()
    while len(done) + len(failed) < agents and len(gone) < count:
        try:
            k, message = children.messages.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if message is None:
            gone.add(k)
            row["errors"].append(f"process {k} exited during the round: {children.log_tail(k)}")
        elif "error" in message:
            failed[message["index"]] = message["error"]
        elif "rank" in message:
            done[message["index"]] = message
    # Read right after the last return: the handlers' shutdown is not part of the round.
    after = etcd_counters(etcd_endpoint) if etcd_endpoint else {}
    row["cpu_agents_s"] = round(_cpu_seconds(children.ps) - cpu_agents, 2)
    if etcd_process is not None:
        row["cpu_etcd_s"] = round(_cpu_seconds(etcd_ps) - cpu_etcd, 2)
    elif "cpu" in before and "cpu" in after:
        row["cpu_etcd_s"] = round(after["cpu"] - before["cpu"], 2)
    row["cpu_seconds"] = round(row["cpu_agents_s"] + row.get("cpu_etcd_s", 0.0), 2)
    row["load_1min"] = round(os.getloadavg()[0], 2)  # explains an outlier on a shared machine

    row["agents_done"], row["agents_failed"] = len(done), len(failed)
    row["errors"] += [f"agent {index}: {error}" for index, error in sorted(failed.items())[:5]]
    returns = sorted(message["t"] - start for message in done.values())
    if returns:
        row["first_s"], row["median_s"] = round(returns[0], 3), round(statistics.median(returns), 3)
    row["completed"] = len(done) == agents
    if row["completed"]:
        row["seconds"] = round(returns[-1], 3)
        ranks = sorted(message["rank"] for message in done.values())
        sizes = {message["world_size"] for message in done.values()}
        row["correct"] = ranks == list(range(agents)) and sizes == {agents}
        if not row["correct"]:
            row["errors"].append(
                f"wrong round: world sizes {sorted(sizes)}, ranks {_ranges(ranks)}")

    _counter_deltas(row, before, after, agents)


def hot_spec(workers: int, timeout: float, policy: str) -> dict:
    """What bench.rdzv_light's hot workers need beyond the endpoint and run id: generations of
    1..N workers re-formed with hot mode's re-form last call, one watch of ctl/ per worker,
    the last rank lost (no declaration follower, unless N <= 2)."""
    return {"mode": "hot", "min_nodes": 1, "max_nodes": workers, "last_call": 1.0,
            "ttl": math.ceil(timeout) + 60, "watchers": "agent", "policy": policy, "victim": workers - 1}


def measure_hot(etcd: EmbeddedEtcd | None, workers: int, policy: str = FOLLOWERS,
                processes: int | None = None, timeout: float = 60.0,
                setup_timeout: float = SETUP_TIMEOUT) -> dict:
    """A hot re-formation of ``workers`` simulated workers after one loss: a row.

    Not timed: the workers declare for generation 1, the harness seals it (as its claim holder
    would), the declaration followers (``policy``) load the declarations. Timed from the lost
    worker's lease revocation: ``sealed_s`` until the sealer's transaction returned, ``seconds``
    until the last survivor learned generation 2 (world N-1). ``events``: watch events etcd sent
    (its counter), ``events_received``: those the workers' watches got.
    """
    if etcd is None:
        with EmbeddedEtcd(client_port=0, peer_port=0) as fresh:
            return measure_hot(fresh, workers, policy, processes, timeout, setup_timeout)
    from elasticctl.etcd.client import EtcdClient
    from elasticctl.job.keys import JobKeys
    from elasticctl.job.rdzv_records import RoundRecords
    from elasticctl.job.records import Round

    count = min(processes or default_processes(workers, LIGHT), workers)
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    row: dict = {"scenario": "hot", "policy": policy, "workers": workers, "processes": count, "run_id": run_id,
                 "timeout": timeout, "completed": False, "correct": None, "workers_done": 0, "seconds": None,
                 "sealed_s": None, "errors": []}
    spec = {"endpoint": etcd.endpoint, "run_id": run_id, **hot_spec(workers, timeout, policy)}
    logs = Path(tempfile.mkdtemp(prefix="rdzv-hot-"))
    children = _Children(count, logs, "bench.rdzv_light")
    client = EtcdClient(etcd.client_settings())
    try:
        for k in range(count):
            indices = list(range(k * workers // count, (k + 1) * workers // count))
            children.send(k, json.dumps({**spec, "indices": indices}))
        if not _await_all(children, row, "ready", count, setup_timeout):
            return row
        members = tuple(f"agent{i}" for i in range(workers))
        generation = Round(number=1, members=members, addrs=("127.0.0.1",) * workers, sealed_at=time.time())
        RoundRecords(client, JobKeys(run_id).generations()).restore(generation, 0)
        if not _await_all(children, row, "running", count, setup_timeout):
            return row
        before = etcd_counters(etcd.endpoint)
        etcd_ps = [psutil.Process(etcd.pid)] if etcd.pid else []
        cpu_agents, cpu_etcd = _cpu_seconds(children.ps), _cpu_seconds(etcd_ps)
        for k in range(count):
            children.send(k, "go")
        done, revoked_at, sealed_at = {}, None, None
        deadline = time.monotonic() + timeout
        while len(done) < workers - 1:
            try:
                k, message = children.messages.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                row["errors"].append(f"{len(done)}/{workers - 1} survivors in generation 2 within {timeout:g} s")
                break
            if message is None:
                row["errors"].append(f"process {k} exited: {children.log_tail(k)}")
                break
            if "revoked_t" in message:
                revoked_at = message["revoked_t"]
            elif "seal_t" in message:
                sealed_at = message["seal_t"]
            elif "error" in message:  # sealed without it (it re-declared after the last call), ...
                row["workers_failed"] = row.get("workers_failed", 0) + 1
                if row["workers_failed"] <= 5:
                    row["errors"].append(f"worker {message['index']}: {message['error']}")
                if len(done) + row["workers_failed"] >= workers - 1:
                    break
            elif "rank" in message:
                done[message["index"]] = message
        after = etcd_counters(etcd.endpoint)
        row["cpu_agents_s"] = round(_cpu_seconds(children.ps) - cpu_agents, 2)
        row["cpu_etcd_s"] = round(_cpu_seconds(etcd_ps) - cpu_etcd, 2)
        row["load_1min"] = round(os.getloadavg()[0], 2)
        row["workers_done"] = len(done)
        row["completed"] = len(done) == workers - 1 and revoked_at is not None
        if row["completed"]:
            row["seconds"] = round(max(m["t"] for m in done.values()) - revoked_at, 3)
            row["sealed_s"] = None if sealed_at is None else round(sealed_at - revoked_at, 3)
            ranks = sorted(m["rank"] for m in done.values())
            sizes = {m["world_size"] for m in done.values()}
            row["correct"] = ranks == list(range(workers - 1)) and sizes == {workers - 1}
        _counter_deltas(row, before, after, workers)
    finally:
        client.close()
        row["leftover"] = children.stop()
        row["pids"] = [process.pid for process in children.ps]
        received = 0
        while not children.messages.empty():
            _, message = children.messages.get()
            received += (message or {}).get("events", 0)
        row["events_received"] = received
        shutil.rmtree(logs, ignore_errors=True)
    return row


def _await_all(children: _Children, row: dict, what: str, count: int, timeout: float) -> bool:
    """Wait for the message ``what`` from each of ``count`` processes; False (and why in
    ``row``) if one failed or the time ran out."""
    seen, deadline = 0, time.monotonic() + timeout
    while seen < count:
        try:
            k, message = children.messages.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            row["errors"].append(f"{what}: {count - seen} of {count} processes not there in {timeout:g} s")
            return False
        if message is None or "setup_error" in message:
            row["errors"].append(f"{what}, process {k}: "
                                 f"{message['setup_error'] if message else children.log_tail(k)}")
            return False
        if what in message:
            seen += 1
            if what == "ready":
                row["setup_s"] = round(max(row.get("setup_s", 0.0), message["setup_s"]), 2)
    return True


def describe_hot(row: dict) -> str:
    if row["completed"]:
        return (f"{row['seconds']:.2f} s, {row.get('events', '?')} events" if row["correct"]
                else "WRONG GENERATION")
    return f"did not complete: {row['workers_done']}/{row['workers'] - 1} in {row['timeout']:g} s"


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5, 5] -> "0-2,5,5": the ranks of a wrong round, readable."""
    parts, first = [], None
    for i, value in enumerate(values):
        first = value if first is None else first
        if i + 1 == len(values) or values[i + 1] != value + 1:
            parts.append(str(value) if first == value else f"{first}-{value}")
            first = None
    return ",".join(parts)


def describe(row: dict) -> str:
    """The outcome in a few words: "1.23 s", "17/128 in 120 s", "WRONG ROUND", "setup failed"."""
    if row["completed"]:
        return f"{row['seconds']:.2f} s" if row["correct"] else "WRONG ROUND"
    if "setup_s" not in row:
        return "setup failed"
    failed = f", {row['agents_failed']} failed" if row["agents_failed"] else ""
    return f"did not complete: {row['agents_done']}/{row['agents']} in {row['timeout']:g} s{failed}"


def table(rows: list[dict]) -> str:
    def cell(row: dict, key: str) -> str:
        value = row.get(key)
        return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)

    header = ("backend", "agents", "procs", "outcome", "proposals", "/agent", "writes", "/agent",
              "cpu s", "rss MB", "setup s")
    keys = ("proposals", "proposals_per_agent", "writes", "writes_per_agent", "cpu_seconds",
            "rss_mb", "setup_s")
    lines = [header]
    for row in rows:
        lines.append((row["backend"], str(row["agents"]), str(row["processes"]), describe(row),
                      *(cell(row, key) for key in keys)))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(text.ljust(w) if i in (0, 3) else text.rjust(w)
                               for i, (text, w) in enumerate(zip(line, widths))) for line in lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--backends", nargs="+", default=[ETCD3, C10D], help=(
        f"any of {', '.join(BACKENDS)} (or another name torchrun's registry knows)"))
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--processes", type=int, default=None, help=(
        f"agents' processes (default min({MAX_PROCESSES}, ceil(N/{AGENTS_PER_PROCESS})))"))
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds a round may take (default 120)")
    parser.add_argument("--max-agents", nargs="+", default=[], metavar="BACKEND=N", help=(
        "run a backend only up to N agents, e.g. c10d=128 etcd3-dynamic=64 (default: every size)"))
    parser.add_argument("--c10d-max-agents", type=int, default=None,
                        help="the same as --max-agents c10d=N")
    parser.add_argument("--etcd-binary", default=None,
                        help="etcd server to start (default: the one elasticctl finds)")
    parser.add_argument("--json", type=Path, default=None, help="also write every row to this file")
    parser.add_argument("--watchers", choices=("agent", "process"), default="agent", help=(
        f"{LIGHT}: a watch of ctl/ per agent (as real agents have; default) or per process"))
    parser.add_argument("--hot", type=int, nargs="+", default=[], metavar="N", help=(
        "instead of rounds: a hot re-formation of N simulated workers after one loss"))
    parser.add_argument("--policy", nargs="+", choices=(FOLLOWERS, EVERY_MEMBER), default=[FOLLOWERS],
                        help="--hot: who follows the declarations (default: followers)")
    args = parser.parse_args()
    binary = args.etcd_binary or find_etcd_binary()
    version = etcd_version(binary)
    try:
        max_agents = parse_max_agents(args.max_agents)
    except ValueError as exc:
        parser.error(str(exc))
    if args.c10d_max_agents is not None:
        max_agents[C10D] = args.c10d_max_agents
    rows = []
    if args.hot:
        for workers in args.hot:
            for policy in args.policy:
                print(f"# hot, {workers} workers, {policy}", file=sys.stderr, flush=True)
                with EmbeddedEtcd(client_port=0, peer_port=0, binary=binary) as etcd:
                    row = measure_hot(etcd, workers, policy, args.processes, min(args.timeout, 60.0))
                row["etcd_version"] = version
                rows.append(row)
                print(json.dumps(row), flush=True)
                print(f"hot {workers} {policy}: {describe_hot(row)}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        sys.exit(1 if any(row["correct"] is False or row["leftover"] for row in rows) else 0)
    for agents in args.agents:
        for backend in planned(agents, args.backends, max_agents):
            for repeat in range(args.repeat):
                print(f"# {backend}, {agents} agents, repeat {repeat + 1}", file=sys.stderr,
                      flush=True)
                if backend == C10D:
                    row = measure_round(backend, None, agents, args.processes, args.timeout)
                else:
                    # A fresh etcd per round: no lease of the last round expires into its counts.
                    with EmbeddedEtcd(client_port=0, peer_port=0, binary=binary) as etcd:
                        row = measure_round(backend, etcd, agents, args.processes, args.timeout,
                                            watchers=args.watchers)
                    row["etcd_version"] = version
                row["repeat"] = repeat + 1
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(table(rows), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if any(row["correct"] is False or row["leftover"] for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
