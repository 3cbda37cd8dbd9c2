"""A sharded job's generations admit whole nodes: who is sealed, when, and what makes the
running generation re-form, table-driven (no etcd, no torch). Members are workers ``<node>.<local rank>``;
a worker of a sharded job declares how many workers its node brings (``node_workers``), one of a
replicated (DDP) job declares 0 and is admitted on its own, as agents are."""

from __future__ import annotations

import json

import pytest

from elasticctl.job.records import MAX_NODE_WORKERS, Declaration, Round
from elasticctl.rendezvous.rounds import Settings, next_members, observed_change, seal_due, wanting, whole_nodes

SHARDED, DDP = 2, 0  # node_workers as a worker of a 2-worker node declares it


def w(name: str, wants: int, revision: int, node_workers: int = SHARDED) -> Declaration:
    return Declaration(node=name, addr="10.0.0.1", wants=wants, revision=revision, node_workers=node_workers)


def workers(names: str, wants: int, first_revision: int, node_workers: int = SHARDED) -> list[Declaration]:
    """``"a.0 a.1"`` -> their declarations, in that order of arrival."""
    return [w(name, wants, first_revision + i, node_workers) for i, name in enumerate(names.split())]


AB = Round(number=1, members=("a.0", "a.1", "b.0", "b.1"), revision=10)
# --nnodes 1:3 --nproc-per-node 2: min 2 workers, max 6
S = Settings(min_nodes=2, max_nodes=6, last_call=1.0)


@pytest.mark.parametrize(("declarations", "admitted"), [
    # a joining node with one worker declared: not admitted, the others are
    (workers("a.0 a.1 b.0 b.1 c.0", 2, 11), "a.0 a.1 b.0 b.1"),
    # both declared: admitted, in the order they came
    (workers("a.0 a.1 b.0 b.1 c.1 c.0", 2, 11), "a.0 a.1 b.0 b.1 c.1 c.0"),
    # a node with one of its workers gone: out as a whole
    (workers("a.0 b.0 b.1", 2, 11), "b.0 b.1"),
    # a replicated (DDP) job: every worker on its own, as today
    (workers("a.0 b.0 b.1 c.0", 2, 11, DDP), "a.0 b.0 b.1 c.0"),
    # the workers of a node must agree on its size, and be its local ranks 0..n-1
    ([w("c.0", 2, 11, 2), w("c.1", 2, 12, 3)], ""),
    ([w("c.0", 2, 11, 2), w("c.2", 2, 12, 2)], ""),
    (workers("c.0 c.1 c.2", 2, 11, 3), "c.0 c.1 c.2"),
    # a name that is not <node>.<local rank> cannot be a node's worker
    ([w("c", 2, 11, 1)], ""),
    ([w("c.0", 2, 11, 1)], "c.0"),
])
def test_whole_nodes(declarations, admitted):
    assert [d.node for d in whole_nodes(declarations)] == admitted.split()


@pytest.mark.parametrize(("current", "live", "members"), [
    # joiner half-declared: not admitted; the survivors go on alone
    (AB, workers("a.0 a.1 b.0 b.1 c.0", 2, 11), "a.0 a.1 b.0 b.1"),
    # joiner fully declared: admitted after the survivors, which keep their ranks
    (AB, workers("c.1 b.0 a.0 c.0 b.1 a.1", 2, 11), "a.0 a.1 b.0 b.1 c.1 c.0"),
    # a node that lost one of its workers (a.1): the whole node out, its other worker waits
    (AB, workers("a.0 b.0 b.1", 2, 11), "b.0 b.1"),
    # a DDP job keeps today's per-worker behaviour: a lone worker stays, a lone joiner comes in
    (Round(1, ("a.0", "a.1", "b.0", "b.1")), workers("a.0 b.0 b.1 c.0", 2, 11, DDP), "a.0 b.0 b.1 c.0"),
    # room for one more node at max 6: the node whose first worker came first, never half of each
    (AB, workers("a.0 a.1 b.0 b.1 c.0 d.0 d.1 c.1", 2, 11), "a.0 a.1 b.0 b.1 c.0 c.1"),
    (Round(1, ("a.0", "a.1", "b.0", "b.1")), workers("a.0 a.1 b.0 b.1 c.0 d.0 d.1 c.1", 2, 11, DDP),
     "a.0 a.1 b.0 b.1 c.0 d.0"),
])
def test_next_members_admit_whole_nodes(current, live, members):
    assert next_members(current, wanting(current, live), S.max_nodes) == tuple(members.split())


@pytest.mark.parametrize(("current", "live", "quorum_since", "now", "due"), [
    # the survivors re-declared and a joiner's second worker has not: sealed at once without it
    # (half a node is not waited for, and does not hold up the survivors)
    (AB, workers("a.0 a.1 b.0 b.1 c.0", 2, 11), 0.0, 0.0, True),
    # a survivor slow to re-declare (a.1 still in generation 1) is waited for, up to last call
    (AB, workers("a.0 b.0 b.1", 2, 11) + [w("a.1", 1, 5)], 0.0, 0.5, False),
    (AB, workers("a.0 b.0 b.1", 2, 11) + [w("a.1", 1, 5)], 0.0, 1.0, True),
    # a node that lost a worker (a.1's key gone): nobody left to wait for
    (AB, workers("a.0 b.0 b.1", 2, 11), 0.0, 0.0, True),
    # the first generation: one worker of a node is no quorum, the whole node is
    (None, workers("a.0", 1, 1), 0.0, 99.0, False),
    (None, workers("a.0 a.1", 1, 1), 0.0, 1.0, True),
    # only a joining node wants it while the survivors train: they re-form when they see it
    (AB, workers("c.0 c.1", 2, 11) + workers("a.0 a.1 b.0 b.1", 1, 1), 0.0, 99.0, False),
    # a DDP job as today: the lone joiner counts, everyone live wants it, sealed at once
    (Round(1, ("a.0", "a.1", "b.0", "b.1")), workers("a.0 a.1 b.0 b.1 c.0", 2, 11, DDP), 0.0, 0.0, True),
    (Round(1, ("a.0", "a.1", "b.0", "b.1")), workers("a.0 b.0 b.1", 2, 11, DDP) + [w("a.1", 1, 5, DDP)],
     0.0, 0.5, False),
])
def test_seal_due_counts_whole_nodes(current, live, quorum_since, now, due):
    assert seal_due(current, live, S, quorum_since, now) is due


@pytest.mark.parametrize(("live", "max_nodes", "expected"), [
    # a joiner half-declared is no reason to re-form (its other worker is still starting)
    (workers("a.0 a.1 b.0 b.1", 1, 1) + workers("c.0", 2, 11), 6, {}),
    # fully declared: the survivors re-form for it at their next boundary
    (workers("a.0 a.1 b.0 b.1", 1, 1) + workers("c.0 c.1", 2, 11), 6, {"waiting": ("c.0", "c.1")}),
    # only whole nodes that fit: room for one node at max 6
    (workers("a.0 a.1 b.0 b.1", 1, 1) + workers("c.0 d.0 d.1 c.1", 2, 11), 6, {"waiting": ("c.0", "c.1")}),
    (workers("a.0 a.1 b.0 b.1", 1, 1) + workers("c.0 c.1", 2, 11), 5, {}),
    # a node that lost a worker: the loss re-forms the generation (and the seal leaves a.0 out)
    (workers("a.0 b.0 b.1", 1, 1), 6, {"lost": ("a.1",)}),
    # a DDP job: a lone joining worker is waited for at once, as today
    (workers("a.0 a.1 b.0 b.1", 1, 1, DDP) + workers("c.0", 2, 11, DDP), 6, {"waiting": ("c.0",)}),
])
def test_observed_change_sees_whole_nodes_waiting(live, max_nodes, expected):
    change = observed_change(AB, {d.node: d for d in live}, max_nodes)
    assert (change.lost, change.moved_on, change.waiting) == (
        expected.get("lost", ()), expected.get("moved_on", ()), expected.get("waiting", ()))


def test_node_workers_round_trip_and_default():
    sharded = Declaration(node="a.1", addr="10.0.0.1", wants=3, node_workers=2)
    assert Declaration.from_json(sharded.to_json().encode(), 7) == Declaration(
        node="a.1", addr="10.0.0.1", wants=3, node_workers=2, revision=7)
    alone = Declaration(node="a", addr="10.0.0.1", wants=3)
    assert "node_workers" not in alone.to_json()  # agents' and DDP workers' declarations as before
    assert Declaration.from_json(alone.to_json().encode(), 7).node_workers == 0


@pytest.mark.parametrize("node_workers", [-1, 1.5, "2", True, None, MAX_NODE_WORKERS + 1])
def test_a_bad_node_workers_from_etcd_is_no_declaration(node_workers):
    raw = json.dumps({"node": "a.0", "addr": "10.0.0.1", "wants": 1, "node_workers": node_workers})
    assert Declaration.from_json(raw.encode(), 1) is None


@pytest.mark.parametrize(("node", "node_workers"), [("a", 2), ("a.x", 2), ("a.2", 2), (".1", 2)])
def test_a_node_worker_must_be_named_node_dot_local_rank(node, node_workers):
    raw = json.dumps({"node": node, "addr": "10.0.0.1", "wants": 1, "node_workers": node_workers})
    assert Declaration.from_json(raw.encode(), 1) is None
