"""Recovery with every core saturated: a kill and a join still re-form the job, in
one round each, charging no restart; a node that was only slow (frozen for less than its
node TTL) forces no round at all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from support.helpers import cli

from elasticctl.etcd.client import EtcdClient
from elasticctl.job.events import EventLog, render_line

pytestmark = pytest.mark.slow


@pytest.fixture
def saturated_cores():
    """Two busy processes per core, at the priority of everything else, stopped at the end."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(2 * (os.cpu_count() or 1))]
    yield
    for burner in burners:
        burner.kill()
        burner.wait()


def current_round(j) -> int:
    """The agents' round (restart mode), or the workers' generation (hot mode: the unit that re-forms)."""
    keys = j.registry.keys
    hot = "hot" in j.up_args
    with EtcdClient(j.etcd.client_settings()) as client:
        return json.loads(client.get(keys.generations().rdzv_round if hot else keys.rdzv_round).value)["round"]


def node_tree(node) -> list[psutil.Process]:
    root = psutil.Process(node.process.pid)
    return [root, *root.children(recursive=True)]


# A node TTL of 2 s (keep-alives every 0.67 s) holds under this load too: no lease of a live
# process expires, in either mode, so the TTL can go to 2 s without false alarms.
MODES = pytest.mark.parametrize("extra", [
    pytest.param(("--node-ttl", "2"), id="restart-ttl2"),
    pytest.param(("--node-ttl", "2", "--recovery", "hot"), id="hot-ttl2"),
])


@MODES
def test_a_kill_and_a_join_under_cpu_overload_reform_once_each(job, saturated_cores, extra):  # noqa: F811
    j = job(nnodes="1:3", extra=extra)
    started = j.start("a", "b", "c", timeout=300)
    before = current_round(j)

    since = max(r["time"] for r in j.records())
    for proc in node_tree(started["c"]):
        proc.kill()
    j.wait_world(2, {"a", "b"}, timeout=300, since=since)
    after_kill = current_round(j)

    since = max(r["time"] for r in j.records())
    started["d"] = j.join("d")
    steps = j.wait_world(3, {"a", "b", "d"}, timeout=300, since=since)
    after_join = current_round(j)

    # One round per event: a slow machine must not make rounds cycle (live leases expiring,
    # a round sealed before everybody arrived).
    history = "\n".join(render_line(e) for e in EventLog(j.client, j.registry.keys).read())
    assert after_kill - before == 1, f"the kill took rounds {before} -> {after_kill}:\n{history}"
    assert after_join - after_kill == 1, f"the join took rounds {after_kill} -> {after_join}:\n{history}"
    assert {r["restart"] for r in steps} == {0}
    charged = {n: m.get("restarts") for n, m in j.registry.members().items() if m.get("restarts")}
    assert not charged, f"restarts charged under load: {charged}"
    result = cli("down", "--etcd", j.etcd.endpoint, "--job", j.name)
    assert result.returncode == 0, result.stderr


@MODES
def test_a_node_that_was_only_slow_forces_no_round(job, saturated_cores, extra):  # noqa: F811
    j = job(nnodes="1:2", extra=extra)
    started = j.start("a", "b", timeout=300)
    before = current_round(j)

    # Frozen for 1 s, inside the 2 s node TTL: a pause, not a loss.
    tree = node_tree(started["b"])
    for proc in tree:
        proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(1.0)  # the stimulus: how long the node is frozen, not a synchronisation
    finally:
        for proc in tree:
            proc.send_signal(signal.SIGCONT)
    resumed_at = time.time()
    j.wait_world(2, {"a", "b"}, timeout=120, since=resumed_at)
    assert current_round(j) == before, "a node that was only slow forced a new round"
    result = cli("down", "--etcd", j.etcd.endpoint, "--job", j.name)
    assert result.returncode == 0, result.stderr
