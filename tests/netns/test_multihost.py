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

import itertools
import json
import os
import shutil
import signal
import sys
import time

import pytest
from support.helpers import MLP, read_records, trained_together, wait_for
from support.netns import NetnsError, Topology, existing_namespaces, sweep_stale, unavailable_reason

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
            *ELASTICCTL, "-v", "up", *common, "--nnodes", "2:3", "--node-ttl", str(NODE_TTL), "--node-id", "a",
            "--local-addr", self.topology.addr("a"), *TRAIN, "--record", str(self.record),
        ], self.workdir)
        for node in ("b", "c"):
            # --wait: the job spec appears once `up` on a has published it.
            self.nodes[node] = self.topology.spawn(node, node, [
                *ELASTICCTL, "-v", "join", *common, "--wait", "60", "--node-id", node,
                "--local-addr", self.topology.addr(node),
            ], self.workdir)

    def records(self) -> list[dict]:
        return read_records(self.record)

    def wait_world(self, world: int, nodes: set[str], since: float, timeout: float = 150) -> list[dict]:
        """Every node in ``nodes`` trained a step at ``world`` after ``since``; returns those steps."""
        def reached():
            return trained_together(self.records(), world, nodes, since=since)

        try:
            # Polled gently: the record grows by ~60 lines/s and the machine has 2 cores.
            return wait_for(reached, timeout, f"nodes {sorted(nodes)} training at world size {world}", interval=0.25)
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
def netns_usable():
    sweep_stale()
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def topology(netns_usable):
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


LISTEN = """
import socket, sys
servers = [socket.create_server((host, 7000)) for host in sys.argv[1:]]
print("listening", flush=True)
while True:
    for server in servers:
        server.settimeout(0.05)
        try:
            server.accept()[0].close()
        except TimeoutError:
            pass
"""


def test_harness_isolates_cuts_and_removes_what_it_made(netns_usable, tmp_path):
    topo = Topology(hosts=["x", "y"]).create()
    try:
        listener = topo.spawn("y", "listener", [sys.executable, "-c", LISTEN, topo.addr("y"), "127.0.0.1"],
                              tmp_path)
        wait_for(lambda: "listening" in listener.log(), 30, "the listener on y")
        assert topo.connects("x", topo.addr("y"), 7000)
        assert not topo.connects("x", "127.0.0.1", 7000), "x must have a loopback of its own"
        topo.cut("y")
        assert not topo.connects("x", topo.addr("y"), 7000)
        topo.heal("y")
        assert topo.connects("x", topo.addr("y"), 7000)
        assert existing_namespaces(topo.prefix) and listener.process.poll() is None
    finally:
        topo.destroy()
    assert existing_namespaces(topo.prefix) == []
    assert listener.process.poll() is not None

    # A topology that fails half-way (an invalid address) removes what it had made.
    broken = Topology(hosts=["x"], subnet="10.213.999")
    with pytest.raises(NetnsError):
        broken.create()
    assert existing_namespaces(broken.prefix) == []


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
    # A partition is nobody's own failure: not the survivors', not the cut-off node's.
    assert {r["restart"] for r in whole} == {0}
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
    since_kill = steps(cluster.records(), since=killed_at)
    assert {r["node"] for r in since_kill if r["time"] < back_at} == set(NODES), "no training while etcd was down"
    assert {r["world_size"] for r in since_kill} == {3}
    assert {r["restart"] for r in since_kill} == {0}
    # The very same worker processes: nothing was restarted, not even for free.
    assert {(r["node"], r["rank"]): r["pid"] for r in after} == workers
    times = sorted(r["time"] for r in since_kill if r["node"] == "a")
    report("longest pause between two steps of a since etcd was killed", max(b - a for a, b in itertools.pairwise(times)))
    assert cluster.alive() == {n: True for n in NODES}
    status = cluster.status()
    assert status["round"] == round_before and status["world_size"] == 3
    assert {n["id"] for n in status["nodes"]} == set(NODES)
