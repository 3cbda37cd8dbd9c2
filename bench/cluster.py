"""A 3-node training job on loopback, run by elasticctl (restart or hot recovery) or plain torchrun, and its record.
Its nodes, record and waits are the harness the tests share (:mod:`bench.harness`).

Each "node" is one launcher process (``elasticctl up/join`` or ``torchrun``) with
its whole process tree; faults are signals sent to that tree. Every rank of the
trainer appends one JSON line per step to a shared record file, which is what
the benchmarks time and wait on.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from bench.harness import Node, Record, stop_nodes, trained_together, wait_for
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


class Cluster:
    """One job of ``system`` on loopback: ``start(name)`` adds a node; ``close()`` removes them all.

    elasticctl: the first node runs ``up`` (publishing the job to the shared etcd),
    later ones ``join``; elasticctl-hot the same with ``up --recovery hot``. torchrun: every node runs the same c10d-rendezvous line;
    the first binds the store port and so hosts the store. With ``shared_store``
    False (the default) torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1:
    with torch's shared agent store a node that joins a running job with rank >= 1
    deadlocks in the rendezvous (DESIGN.md), so a job whose nodes start one after
    another never reaches 3 nodes and nothing else could be measured.

    ``clock`` is the clock the record's lines are stamped with (the trainers write ``time.time()``):
    a measurement takes "now" from it, so that a test's made-up job can run on a clock of its own.
    """

    clock: Callable[[], float] = staticmethod(time.time)

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
        """When every node in ``nodes`` had trained a step at ``world`` after ``since``: the latest of
        their first such steps. Not the earliest line: where the world before and after is the same
        size (a spare in a lost node's place), a survivor's step in flight at the signal can be written
        just after it, at the old world, and read as a recovery in no time."""
        recent = wait_for(lambda: trained_together(self.record.read(), world, nodes, since=since), timeout,
                          give_up=give_up)
        return first_together(recent, nodes) if recent else None

    def last_time(self) -> float:
        return max((r["time"] for r in self.record.read()), default=0.0)

    def close(self) -> None:
        stop_nodes(self.nodes.values())


def first_together(lines: list[dict], nodes: set[str]) -> float:
    """The moment every node in ``nodes`` had written one of ``lines``: the latest of their first lines."""
    firsts: dict[str, float] = {}
    for line in lines:
        if line["node"] in nodes:
            firsts[line["node"]] = min(firsts.get(line["node"], line["time"]), line["time"])
    return max(firsts.values())
