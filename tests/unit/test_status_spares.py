"""Which live nodes `status` calls spares: waiting beside a full world (table-driven, no etcd)."""

from __future__ import annotations

import pytest

from elasticctl.job.records import Round
from elasticctl.job.registry import JobView
from elasticctl.job.spec import JobSpec
from elasticctl.status import render

SPEC = JobSpec(name="j", script="train.py", min_nodes=1, max_nodes=3, rdzv_conf=(("spares", "1"),))
NODES = {n: {"host": "h", "addr": "127.0.0.1", "state": "running"} for n in "abcd"}


def hot(members: tuple[str, ...], states: dict[str, str] | None = None) -> JobView:
    return JobView(name="j", spec=SPEC, nodes=NODES, progress=None, down_requested=False,
                   members={n: {"state": (states or {}).get(n, "training")} for n in NODES},
                   generation=Round(number=4, members=members))


def restart(in_round: str, states: dict[str, str]) -> JobView:
    members = {n: {"state": "training", "round": 2} for n in in_round}
    members.update({n: {"state": s} for n, s in states.items()})
    return JobView(name="j", spec=SPEC, nodes=NODES, members=members, progress=None, down_requested=False)


@pytest.mark.parametrize(("view", "spares"), [
    # hot: a full generation; d's workers wait outside it
    (hot(("a.0", "b.0", "c.0")), ["d"]),
    # hot: room in the generation: d is joining, not a spare
    (hot(("a.0", "b.0")), []),
    # hot: d left or failed: not waiting
    (hot(("a.0", "b.0", "c.0"), {"d": "left"}), []),
    (hot(("a.0", "b.0", "c.0"), {"d": "failed"}), []),
    # restart mode: a full round; d's agent waits in the rendezvous (no member record yet)
    (restart("abc", {}), ["d"]),
    (restart("ab", {}), []),
])
def test_spares_are_live_nodes_beside_a_full_world(view, spares):
    assert view.spares() == spares
    assert view.to_dict()["spares"] == spares
    assert view.spares_expected() == 1


def test_status_says_when_fewer_spares_wait_than_expected():
    assert "spares    1 waiting warm of 1 expected" in render(hot(("a.0", "b.0", "c.0")))
    text = render(hot(("a.0", "b.0", "c.0"), {"d": "left"}))
    assert "spares    0 waiting warm of 1 expected   (1 SHORT)" in text
