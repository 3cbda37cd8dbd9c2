"""A 3-node training job on loopback, run by elasticctl (restart or hot recovery) or plain torchrun, and its record.

Each "node" is one launcher process (``elasticctl up/join`` or ``torchrun``) with
its whole process tree; faults are signals sent to that tree. Every rank of the
trainer appends one JSON line per step to a shared record file, which is what
the benchmarks time and wait on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from elasticctl import processes
from elasticctl.etcd.client import EtcdClient
from elasticctl.embedded_etcd import free_port
from elasticctl.job.registry import Registry

REPO = Path(__file__).resolve().parents[1]
MLP = str(REPO / "trainers" / "mlp.py")
# elasticctl-hot: `up --recovery hot`, everything else as elasticctl (restart mode), node TTL included.
SYSTEMS = ("elasticctl", "elasticctl-hot", "torchrun")
# Both elasticctl systems run with a 2 s node TTL (it holds under the overload test);
# hot mode's freeze target is TTL + 0.5 s.
NODE_TTL = 2
LOOPBACK = "127.0.0.1"


def wait_for(predicate: Callable[[], object], timeout: float, interval: float = 0.05,
             give_up: Callable[[], bool] = lambda: False):
    """Poll ``predicate`` until it returns something truthy; None after ``timeout`` s or once ``give_up()``."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline or give_up():
            return None
        time.sleep(interval)


class Record:
    """The trainer's JSON-lines record, read incrementally (it grows by thousands of lines)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: list[dict] = []
        self._offset = 0

    def read(self) -> list[dict]:
        if self.path.exists():
            with open(self.path, "rb") as file:
                file.seek(self._offset)
                chunk = file.read()
            end = chunk.rfind(b"\n") + 1  # a line being written now is read next time
            for line in chunk[:end].splitlines():
                try:
                    self.lines.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # interleaved writes of two ranks: rare, and one step more or less does not matter
            self._offset += end
        return self.lines

    def steps(self, since: float = 0.0, world: int | None = None) -> list[dict]:
        return [r for r in self.read() if "event" not in r and r["time"] > since
                and (world is None or r["world_size"] == world)]


class Node:
    """One host's launcher and its whole process tree."""

    def __init__(self, name: str, command: list[str], log_dir: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "ELASTICCTL_NODE": name, **env}
        with open(self.log_path, "ab") as log:
            self.process = processes.spawn(command, stdout=log, stderr=subprocess.STDOUT, env=env)

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.process.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def signal_tree(self, sig: int) -> None:
        """Signal the launcher and every descendant (torchrun puts workers in sessions of their own)."""
        for proc in self.tree():
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                pass

    def stop(self) -> None:
        tree = self.tree()
        if self.process.poll() is None:
            self.signal_tree(signal.SIGCONT)  # a frozen tree cannot act on SIGTERM
            processes.terminate(self.process, timeout=5)
        for proc in tree:  # workers orphaned by a killed launcher are no longer in its tree
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(tree, timeout=10)
        if self.process.poll() is None:
            self.process.wait(10)


class Cluster:
    """One job of ``system`` on loopback: ``start(name)`` adds a node; ``close()`` removes them all.

    elasticctl: the first node runs ``up`` (publishing the job to the shared etcd),
    later ones ``join``; elasticctl-hot the same with ``up --recovery hot``. torchrun: every node runs the same c10d-rendezvous line;
    the first binds the store port and so hosts the store. With ``shared_store``
    False (the default) torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1:
    with torch's shared agent store a node that joins a running job with rank >= 1
    deadlocks in the rendezvous (DESIGN.md), so a job whose nodes start one after
    another never reaches 3 nodes and nothing else could be measured.
    """

    def __init__(self, system: str, workdir: Path, trainer_args: list[str], etcd: EtcdClient,
                 nnodes: str = "1:3", shared_store: bool = False, up_args: tuple[str, ...] = (),
                 script: str = MLP, max_restarts: int = 3) -> None:
        if system not in SYSTEMS:
            raise ValueError(f"The system '{system}' is not one of {SYSTEMS}.")
        self.system, self.workdir, self.nnodes = system, workdir, nnodes
        self.job = "-".join(workdir.parts[-2:])  # the run's directory name in it: orphans are findable
        workdir.mkdir(parents=True, exist_ok=True)
        self.record = Record(workdir / "record.jsonl")
        self.trainer = [script, *trainer_args, "--record", str(self.record.path)]
        self.etcd = etcd
        self.etcd_endpoint = etcd.settings.describe()
        self.store_port = free_port(LOOPBACK)
        self.nodes: dict[str, Node] = {}
        self.up_args = list(up_args)  # elasticctl: options of `up` before the script (--recovery hot, ...)
        self.elastic = system != "torchrun"
        self.max_restarts = max_restarts  # torchrun's --max-restarts: every lost peer spends one
        self.env = {} if self.elastic or shared_store else {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

    def _command(self, name: str, first: bool) -> list[str]:
        if self.system == "torchrun":
            return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.nnodes}",
                    "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={LOOPBACK}:{self.store_port}",
                    f"--rdzv-id={self.job}", "--rdzv-conf=last_call_timeout=1", f"--max-restarts={self.max_restarts}",
                    f"--local-addr={LOOPBACK}", *self.trainer]
        cli = [sys.executable, "-m", "elasticctl.cli"]
        if first:
            hot = ["--recovery", "hot"] if self.system == "elasticctl-hot" else []
            return [*cli, "up", "--node-id", name, "--etcd", self.etcd_endpoint, "--job", self.job,
                    "--nnodes", self.nnodes, "--node-ttl", str(NODE_TTL), *hot, *self.up_args, *self.trainer]
        return [*cli, "join", "--node-id", name, "--etcd", self.etcd_endpoint, "--job", self.job]

    def start(self, name: str, timeout: float = 60) -> Node:
        first = not self.nodes
        node = self.nodes[name] = Node(name, self._command(name, first), self.workdir, self.env)
        if first and not wait_for(self._first_node_ready, timeout):
            raise RuntimeError(f"{self.system} node {name} did not come up within {timeout:g} s; "
                               f"see {node.log_path}")
        return node

    def _first_node_ready(self) -> bool:
        """The job is joinable: its spec is in etcd (elasticctl), or the c10d store listens (torchrun)."""
        if self.elastic:
            return Registry(self.etcd, self.job).read_spec() is not None
        return any(c.laddr and c.laddr.port == self.store_port and c.status == psutil.CONN_LISTEN
                   for c in psutil.net_connections(kind="tcp"))  # the store listens dual-stack

    def wait_world(self, world: int, nodes: set[str], since: float, timeout: float,
                   give_up: Callable[[], bool] = lambda: False) -> float | None:
        """Time of the first step at ``world`` after ``since`` once every node in ``nodes`` trained there."""
        def reached():
            recent = self.record.steps(since, world)
            return recent if {r["node"] for r in recent} >= nodes else None

        recent = wait_for(reached, timeout, give_up=give_up)
        return min(r["time"] for r in recent) if recent else None

    def last_time(self) -> float:
        return max((r["time"] for r in self.record.read()), default=0.0)

    def close(self) -> None:
        for node in self.nodes.values():
            node.stop()
