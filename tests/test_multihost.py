"""A job across hosts with real addresses: Linux network namespaces on one bridge.

etcd runs on host ``etcd``; nodes a, b, c run ``elasticctl up``/``join`` on hosts of
their own, each with ``--local-addr`` its address and ``--etcd`` the etcd host's, so
the rendezvous, the c10d store (MASTER_ADDR) and gloo all go over the bridge. One
topology and one job serve the whole module (forming a 3-node job is the slow part);
each test starts by waiting for the full world, so it fails on its own terms.

Every wait is on the trainer's record or a log line, never a sleep. Measured times
are printed (``pytest -s``) rather than asserted: the machine is shared and noisy.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time

import pytest
from helpers import MLP, read_records, wait_for
from netns import Topology, sweep_stale, unavailable_reason

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="network namespaces need root"),
    pytest.mark.skipif(shutil.which("ip") is None, reason="the 'ip' binary (iproute2) is not installed"),
]

ELASTICCTL = [sys.executable, "-m", "elasticctl.cli"]
NODES = ("a", "b", "c")
ETCD_PORT = 2379  # free by construction: the etcd host is a namespace of its own
NODE_TTL = 5
TRAIN = [MLP, "--steps", "1000000", "--step-sleep", "0.05", "--log-every", "0", "--batch-size", "8"]


def steps(records: list[dict], world: int | None = None, since: float = 0.0) -> list[dict]:
    return [r for r in records if "step" in r and "event" not in r and r.get("time", 0) > since
            and (world is None or r.get("world_size") == world)]


def report(what: str, seconds: float) -> None:
    print(f"\n[multihost] {what}: {seconds:.1f} s", flush=True)


class Cluster:
    """The etcd host plus nodes a, b, c of one job on the topology."""

    def __init__(self, topology: Topology, workdir) -> None:
        self.topology = topology
        self.workdir = workdir
        self.job = "mh-" + topology.prefix
        self.record = workdir / "record.jsonl"
        self.etcd_addr = topology.addr("etcd")
        self.endpoint = f"{self.etcd_addr}:{ETCD_PORT}"
        self.etcd_data = workdir / "etcd-data"
        self.etcd = None
        self.nodes = {}

    def start_etcd(self):
        starts = self.etcd_log().count("etcd is serving at")
        self.etcd = self.topology.spawn("etcd", "etcd", [
            *ELASTICCTL, "etcd", "--listen", self.etcd_addr, "--advertise", self.etcd_addr,
            "--client-port", str(ETCD_PORT), "--peer-port", "2380", "--data-dir", str(self.etcd_data),
        ], self.workdir)
        wait_for(lambda: self.etcd_log().count("etcd is serving at") > starts or self.etcd.process.poll() is not None,
                 60, "etcd to serve on its host")
        assert self.etcd.process.poll() is None, self.etcd_log()
        return self.etcd

    def etcd_log(self) -> str:
        path = self.workdir / "etcd.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start_nodes(self) -> None:
        common = ["--etcd", self.endpoint, "--job", self.job]
        self.nodes["a"] = self.topology.spawn("a", "a", [
            *ELASTICCTL, "up", *common, "--nnodes", "2:3", "--node-ttl", str(NODE_TTL), "--node-id", "a",
            "--local-addr", self.topology.addr("a"), *TRAIN, "--record", str(self.record),
        ], self.workdir)
        for node in ("b", "c"):
            # --wait: the job spec appears once `up` on a has published it.
            self.nodes[node] = self.topology.spawn(node, node, [
                *ELASTICCTL, "join", *common, "--wait", "60", "--node-id", node,
                "--local-addr", self.topology.addr(node),
            ], self.workdir)

    def records(self) -> list[dict]:
        return read_records(self.record)

    def wait_world(self, world: int, nodes: set[str], since: float, timeout: float = 150) -> list[dict]:
        """Every node in ``nodes`` trained a step at ``world`` after ``since``; returns those steps."""
        def reached():
            recent = steps(self.records(), world, since)
            return recent if {r["node"] for r in recent} >= nodes else None

        try:
            return wait_for(reached, timeout, f"nodes {sorted(nodes)} training at world size {world}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.diagnostics()}") from None

    def status(self, host: str = "a") -> dict:
        result = self.topology.run(host, [*ELASTICCTL, "status", "--etcd", self.endpoint, "--job", self.job, "--json"])
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def alive(self) -> dict[str, bool]:
        return {name: node.process.poll() is None for name, node in self.nodes.items()}

    def diagnostics(self) -> str:
        tails = [f"--- {n}.log ---\n" + "\n".join(p.log().splitlines()[-15:]) for n, p in self.nodes.items()]
        return "\n".join([f"alive: {self.alive()}", *tails, "--- etcd.log ---", self.etcd_log()[-1500:]])


@pytest.fixture(scope="module")
def topology():
    sweep_stale()
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with Topology(hosts=["etcd", *NODES]) as topo:
        yield topo


@pytest.fixture(scope="module")
def cluster(topology, tmp_path_factory):
    c = Cluster(topology, tmp_path_factory.mktemp("multihost"))
    c.start_etcd()
    started = time.time()
    c.start_nodes()
    c.wait_world(3, set(NODES), since=0, timeout=180)
    report("3 nodes on 3 hosts: start to first step at world 3", min(
        r["time"] for r in steps(c.records(), 3)) - started)
    yield c
    # topology.destroy() kills every process it spawned, then the namespaces.


def test_job_forms_across_hosts_with_their_own_addresses(cluster, topology):
    formed = cluster.wait_world(3, set(NODES), since=time.time())
    assert {r["restart"] for r in formed} == {0}

    status = cluster.status()
    assert status["world_size"] == 3
    addresses = {n["id"]: n["addr"] for n in status["nodes"]}
    assert addresses == {n: topology.addr(n) for n in NODES}
    assert len(set(addresses.values())) == 3
    assert {n["rendezvous"] for n in status["nodes"]} == {"training"}

    # The workers' gloo mesh runs over the bridge: every host holds connections to both
    # others (on loopback, or an address the others cannot reach, the job never forms).
    for node in NODES:
        others = {topology.addr(o) for o in NODES if o != node}
        assert others <= topology.tcp_peers(node), f"{node} has no gloo connection to {others}"
    # and every host talks to etcd at the etcd host's address
    assert topology.addr("etcd") in topology.tcp_peers("a")


def test_partitioned_host_drops_out_and_rejoins_when_the_link_returns(cluster, topology):
    cluster.wait_world(3, set(NODES), since=time.time())

    cut_at = time.time()
    topology.cut("c")
    try:
        smaller = cluster.wait_world(2, {"a", "b"}, since=cut_at)
        report("link of c cut -> a and b train at world 2", min(r["time"] for r in smaller) - cut_at)
        assert {r["node"] for r in smaller} == {"a", "b"}
        assert {r["restart"] for r in smaller} == {0}, "a lost peer must not spend a restart"
        # c is alive but cut off: it must not have trained a step in any world since
        # the survivors re-formed.
        assert not [r for r in steps(cluster.records(), since=max(r["time"] for r in smaller))
                    if r["node"] == "c"]
        assert cluster.alive()["c"]
    finally:
        healed_at = time.time()
        topology.heal("c")

    whole = cluster.wait_world(3, set(NODES), since=healed_at)
    report("link of c restored -> a, b, c train at world 3", min(r["time"] for r in whole) - healed_at)
    by_node = {n: {r["restart"] for r in whole if r["node"] == n} for n in NODES}
    assert by_node["a"] == by_node["b"] == {0}
    print(f"[multihost] restarts spent by c after the partition: {by_node['c']}")
    assert cluster.alive() == {n: True for n in NODES}
    status = cluster.status()
    assert status["world_size"] == 3
    assert {n["id"]: n["addr"] for n in status["nodes"]} == {n: topology.addr(n) for n in NODES}


def test_etcd_host_restart_within_the_client_tolerance_does_not_stop_training(cluster, topology):
    before = cluster.wait_world(3, set(NODES), since=time.time())
    workers = {(r["node"], r["rank"]): r["pid"] for r in before}
    round_before = cluster.status()["round"]

    killed_at = time.time()
    cluster.etcd.signal_tree(signal.SIGKILL)  # etcd host's etcd, no clean shutdown
    cluster.etcd.wait(30)
    # Training goes on without etcd: every node steps at least 3 s after the kill.
    cluster.wait_world(3, set(NODES), since=killed_at + 3, timeout=60)
    cluster.start_etcd()
    back_at = time.time()
    report("etcd down (kill -> serving again)", back_at - killed_at)

    # Past a whole node TTL after etcd's return, so an expired lease would have shown.
    after = cluster.wait_world(3, set(NODES), since=back_at + NODE_TTL + 1)
    during = steps(cluster.records(), since=killed_at)
    assert {r["world_size"] for r in during} == {3}
    assert {r["restart"] for r in during} == {0}
    # The very same worker processes: nothing was restarted, not even for free.
    assert {(r["node"], r["rank"]): r["pid"] for r in after} == workers
    assert max(r["time"] for r in during) - killed_at > back_at - killed_at
    assert cluster.alive() == {n: True for n in NODES}
    status = cluster.status()
    assert status["round"] == round_before and status["world_size"] == 3
    assert {n["id"] for n in status["nodes"]} == set(NODES)
