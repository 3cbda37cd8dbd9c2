"""Membership changes in a row on the etcd-native rendezvous: joins and graceful leaves never
charge anyone a restart, and the ranks of the nodes that stay are kept."""

from __future__ import annotations

import pytest
from support.helpers import cli, wait_for

pytestmark = pytest.mark.slow


def test_joins_and_leaves_in_a_row_charge_no_restart(job):  # noqa: F811 - the imported fixture
    j = job(nnodes="1:4")
    a = j.up("a")
    wait_for(j.registry.read_spec, 60, "the job spec in etcd")
    j.wait_world(1, {"a"})
    started = {"a": a}
    sequence = [("join", "b"), ("join", "c"), ("leave", "b"), ("join", "d"), ("leave", "c")]
    present = {"a"}
    for action, node in sequence:
        since = max(r["time"] for r in j.records())
        if action == "join":
            started[node] = j.join(node)
            present.add(node)
        else:
            result = cli("leave", "--etcd", j.etcd.endpoint, "--job", j.name, "--node", node)
            assert result.returncode == 0, result.stderr
            assert started[node].wait(90) == 0, started[node].log()
            present.discard(node)
        steps = j.wait_world(len(present), present, since=since)
        assert {r["restart"] for r in steps} == {0}, f"{action} {node} charged a restart"
        members = j.registry.members()
        charged = {n: m.get("restarts") for n, m in members.items() if n in present and m.get("restarts")}
        assert not charged, f"after {action} {node}: {charged}"
    result = cli("down", "--etcd", j.etcd.endpoint, "--job", j.name)
    assert result.returncode == 0, result.stderr
