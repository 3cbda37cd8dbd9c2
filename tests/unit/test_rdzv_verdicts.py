"""Whose fault a failure was, and quarantine: table-driven on a fake clock."""

from __future__ import annotations

import pytest

from elasticctl.rendezvous.verdicts import Evidence, failure_verdict, quarantine_by_default, quarantine_due

MEMBERS = ("a", "b", "c")


def ev(**kwargs) -> Evidence:
    return Evidence(**{"node": "a", "round_members": MEMBERS, "failed_at": 100.0, "gone_at": {}, **kwargs})


@pytest.mark.parametrize(("evidence", "now", "own", "reason"), [
    # a peer's lease ended shortly after our failure: collateral, decided at once
    (ev(gone_at={"c": 104.0}), 100.1, False, "lost c"),
    # ... but not one that ended long after (another incident)
    (ev(gone_at={"c": 130.0}), 130.0, True, "on their own"),
    # a graceful leave is nobody's fault, and no excuse either
    (ev(gone_at={"c": 100.5}, departed=frozenset({"c"})), 107.0, True, "on their own"),
    (ev(cut_off=True), 100.0, False, "cut off"),
    (ev(failures=("b", "a")), 100.0, False, "b failed first"),
    # we failed first, and nobody was lost within node_ttl + 1 s: our own
    (ev(failures=("a", "b")), 105.9, None, None),
    (ev(failures=("a", "b")), 106.0, True, "on their own"),
    (ev(), 106.0, True, "on their own"),
    # a join or a re-forming was tearing the round down (a worker raised PeerLeaving)
    (ev(waiting=("x",)), 100.0, False, "re-forming for x"),
    (ev(rejoining=("b",)), 100.0, False, "re-forming for b"),
    # ... but a member that re-joined because its own workers failed is no excuse
    (ev(rejoining=("b",), failures=("a", "b")), 106.0, True, "on their own"),
    # alone in its round: nobody else to blame, decided at once
    (ev(round_members=("a",)), 100.0, True, "on their own"),
    # our own key vanishing is not a lost peer
    (ev(gone_at={"a": 101.0}), 106.0, True, "on their own"),
])
def test_failure_verdict(evidence, now, own, reason):
    verdict = failure_verdict(evidence, node_ttl=5, now=now)
    if own is None:
        assert verdict is None
    else:
        assert verdict.own is own and reason in verdict.reason


@pytest.mark.parametrize(("counted_at", "now", "due"), [
    ([], 0.0, False),
    ([10.0], 20.0, False),
    ([10.0, 500.0], 600.0, True),
    ([10.0, 700.0], 700.0, False),   # the first fell out of the 600 s window
])
def test_quarantine_due(counted_at, now, due):
    assert quarantine_due(counted_at, now, window=600, after=2) is due


@pytest.mark.parametrize(("own_budget", "min_nodes", "max_nodes", "applies"), [
    (True, 1, 1, True),     # elasticctl up: the handler keeps the budget, quarantine is part of it
    (True, 3, 3, True),
    (False, 1, 1, False),   # plain torchrun, one node: no other node to train on, only a pause
    (False, 2, 2, False),   # plain torchrun, fixed size: the others would wait for it
    (False, 1, 2, True),    # plain torchrun, elastic: the others go on without it
    (False, 2, 4, True),
])
def test_quarantine_by_default(own_budget, min_nodes, max_nodes, applies):
    assert quarantine_by_default(own_budget, min_nodes, max_nodes) is applies
