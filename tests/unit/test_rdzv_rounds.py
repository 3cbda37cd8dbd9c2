"""The etcd-native rendezvous's decisions, table-driven on a fake clock (no etcd, no torch)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticctl.job.records import Claim, Declaration, Reform, Round, preferred_round
from elasticctl.rendezvous.rounds import (
    Change,
    Settings,
    change_for,
    change_from_reform,
    declaration_followers,
    complete_nodes,
    count,
    counted_by,
    has_quorum,
    node_of,
    next_members,
    observed_change,
    publishes_changes,
    reform_due,
    reform_record,
    seal_due,
    last_call_for,
    to_probe,
    wanting,
    without_dead,
)


def d(node: str, wants: int, revision: int) -> Declaration:
    return Declaration(node=node, addr="10.0.0.1", wants=wants, revision=revision)


R1 = Round(number=1, members=("a", "b", "c"), revision=10)
S = Settings(min_nodes=2, max_nodes=4, last_call=1.0)


@pytest.mark.parametrize(("current", "live", "quorum_since", "now", "due"), [
    # nobody, or fewer than min_nodes, want round 1
    (None, [], None, 0.0, False),
    (None, [d("a", 1, 1)], 0.0, 99.0, False),
    # the first round waits last call for nodes still starting, unless it is full
    (None, [d("a", 1, 1), d("b", 1, 2)], 0.0, 0.5, False),
    (None, [d("a", 1, 1), d("b", 1, 2)], 0.0, 1.0, True),
    (None, [d(n, 1, i) for i, n in enumerate("abcd")], 0.0, 0.0, True),
    # after a round: every live node wants the next one, nobody to wait for
    (R1, [d("a", 2, 11), d("b", 2, 12)], 0.0, 0.0, True),
    # a live node still in round 1 (training, or frozen with its lease alive): wait for last call
    (R1, [d("a", 2, 11), d("b", 2, 12), d("c", 1, 5)], 0.0, 0.5, False),
    (R1, [d("a", 2, 11), d("b", 2, 12), d("c", 1, 5)], 0.0, 1.0, True),
    # full at max_nodes: at once
    (R1, [d("a", 2, 11), d("b", 2, 12), d("c", 2, 13), d("x", 2, 14), d("y", 1, 3)], None, 0.0, True),
    # only newcomers want round 2 while members of round 1 train: wait for the members,
    # who re-form as soon as they see them (never supersede a training job)
    (R1, [d("x", 2, 11), d("a", 1, 1), d("b", 1, 2), d("c", 1, 3)], 0.0, 99.0, False),
    (R1, [d("x", 2, 11), d("y", 2, 12), d("z", 2, 13), d("w", 2, 14), d("a", 1, 1)], 0.0, 99.0, False),
    # ... but once one member wants it too, the usual rules
    (R1, [d("x", 2, 11), d("a", 2, 12), d("b", 1, 2), d("c", 1, 3)], 0.0, 0.5, False),
    (R1, [d("x", 2, 11), d("a", 2, 12), d("b", 1, 2), d("c", 1, 3)], 0.0, 1.0, True),
    # ... and with no member of round 1 alive, newcomers form round 2 after last call
    (R1, [d("x", 2, 11), d("y", 2, 12)], 0.0, 1.0, True),
    # declarations for an older round do not count
    (R1, [d("a", 1, 1), d("b", 1, 2)], 0.0, 99.0, False),
])
def test_seal_due(current, live, quorum_since, now, due):
    assert seal_due(current, live, S, quorum_since, now) is due


@pytest.mark.parametrize(("current", "candidates", "max_nodes", "members"), [
    (None, [d("b", 1, 2), d("a", 1, 1)], 4, ("b", "a")),  # arrival order as given (sorted by caller)
    (R1, wanting(R1, [d("x", 2, 11), d("c", 2, 12), d("a", 2, 13)]), 4, ("a", "c", "x")),  # old ranks first
    (R1, wanting(R1, [d("x", 2, 11), d("y", 2, 12), d("b", 2, 13), d("a", 2, 14)]), 3, ("a", "b", "x")),
])
def test_next_members_keep_ranks_then_arrival(current, candidates, max_nodes, members):
    assert next_members(current, candidates, max_nodes) == members


@pytest.mark.parametrize(("live", "max_nodes", "expected"), [
    ({"a": d("a", 1, 1), "b": d("b", 1, 2), "c": d("c", 1, 3)}, 4, {}),
    ({"a": d("a", 1, 1), "b": d("b", 1, 2)}, 4, {"lost": ("c",)}),
    ({"a": d("a", 1, 1), "b": d("b", 2, 20), "c": d("c", 1, 3)}, 4, {"moved_on": ("b",)}),
    ({"a": d("a", 1, 1), "b": d("b", 1, 2), "c": d("c", 1, 3), "x": d("x", 2, 9)}, 4, {"waiting": ("x",)}),
    # a full round has no room: a newcomer waits without disturbing it
    ({"a": d("a", 1, 1), "b": d("b", 1, 2), "c": d("c", 1, 3), "x": d("x", 2, 9)}, 3, {}),
])
def test_change_for_a_member(live, max_nodes, expected):
    change = change_for("a", 1, R1, live, max_nodes)
    assert (change.lost, change.moved_on, change.waiting) == (
        expected.get("lost", ()), expected.get("moved_on", ()), expected.get("waiting", ()))
    assert change.count == sum(len(v) for v in expected.values())


@pytest.mark.parametrize(("live", "finished", "expected"), [
    # a member that finished (its agent shut down, its declaration withdrawn) is not lost
    ({"a": d("a", 1, 1), "b": d("b", 1, 2)}, {"c"}, {}),
    # ... nor counted when another member is: only that one is
    ({"a": d("a", 1, 1)}, {"c"}, {"lost": ("b",)}),
    # finished and still declared (it is shutting down): nothing changed
    ({"a": d("a", 1, 1), "b": d("b", 1, 2), "c": d("c", 1, 3)}, {"c"}, {}),
    # finished members do not hide a newcomer waiting with room
    ({"a": d("a", 1, 1), "b": d("b", 1, 2), "x": d("x", 2, 9)}, {"c"}, {"waiting": ("x",)}),
])
def test_a_finished_member_is_never_lost(live, finished, expected):
    change = change_for("a", 1, R1, live, 4, frozenset(finished))
    assert (change.lost, change.moved_on, change.waiting) == (
        expected.get("lost", ()), expected.get("moved_on", ()), expected.get("waiting", ()))
    assert change.count == sum(len(v) for v in expected.values())


@pytest.mark.parametrize(("my_round", "current"), [
    (1, Round(number=2, members=("b", "c"))),   # sealed without us
    (1, Round(number=1, members=("b", "c"))),   # not a member of it
    (1, None),
])
def test_a_node_outside_the_current_round_is_superseded(my_round, current):
    assert change_for("a", my_round, current, {}, 4).superseded


@given(raw=st.binary(max_size=300), revision=st.integers(0, 2**40))
def test_records_from_untrusted_bytes_are_none_or_valid(raw, revision):
    declaration = Declaration.from_json(raw, revision)
    if declaration is not None:
        assert Declaration.from_json(declaration.to_json().encode(), revision) == declaration
    sealed = Round.from_json(raw, revision)
    if sealed is not None:
        assert Round.from_json(sealed.to_json().encode(), revision) == sealed


def test_records_round_trip():
    assert Declaration.from_json(d("a", 3, 7).to_json().encode(), 7) == d("a", 3, 7)
    sealed = Round(number=4, members=("a", "b"), addrs=("h1", "h2"), revision=9)
    assert Round.from_json(sealed.to_json().encode(), 9) == sealed
    assert Round.from_json(b'{"round": 1, "members": ["a", "a"]}', 1) is None
    assert Round.from_json(b'{"round": 1, "members": ["a/b"]}', 1) is None


# -- a missing round record while members of the job are alive ------------------------------

def _decl(node: str, wants: int, revision: int) -> Declaration:
    return Declaration(node, f"addr-{node}", wants, revision=revision)


@pytest.mark.parametrize("current, live, unreadable, due", [
    # the record of round 4 is gone (deleted, expired) while its members live: a newcomer alone
    # must not seal a round 1 beside them, full or not
    (None, [_decl("a", 4, 1), _decl("b", 4, 2), _decl("c", 1, 3)], 0, False),
    (None, [_decl("a", 2, 1), _decl("c", 1, 3)], 0, False),
    # live declarations this node cannot read (another secret, another run): no first round
    (None, [_decl("c", 1, 3)], 1, False),
    # a cold start with every declaration readable: sealed once full
    (None, [_decl("a", 1, 1), _decl("b", 1, 2), _decl("c", 1, 3)], 0, True),
    # a running round is not held up by an unreadable declaration
    (Round(3, ("a", "b")), [_decl("a", 4, 5), _decl("b", 4, 6)], 1, True),
])
def test_no_round_is_sealed_beside_live_members_it_cannot_see(current, live, unreadable, due):
    settings = Settings(min_nodes=1, max_nodes=3, last_call=30)
    assert seal_due(current, live, settings, quorum_since=None, now=0.0, unreadable=unreadable) is due


@pytest.mark.parametrize("known, candidate, believed", [
    # rounds only go forward
    (Round(2, ("a",), sealed_at=5.0), Round(3, ("a", "b"), sealed_at=9.0), "candidate"),
    (Round(3, ("a",), sealed_at=5.0), Round(2, ("a", "b"), sealed_at=9.0), "known"),
    # a restored copy of the same round is that round (at its new revision)
    (Round(3, ("a",), sealed_at=5.0), Round(3, ("a",), sealed_at=5.0, revision=99), "candidate"),
    # a forged record of the same number (no seal time, or a later one) never wins
    (Round(3, ("a", "b"), sealed_at=5.0), Round(3, ("x",)), "known"),
    (Round(3, ("a", "b"), sealed_at=5.0), Round(3, ("a", "b", "c"), sealed_at=6.0), "known"),
    # ... and a node that believed the late one settles on the round sealed first
    (Round(3, ("a", "b", "c"), sealed_at=6.0), Round(3, ("a", "b"), sealed_at=5.0), "candidate"),
    # unreadable
    (Round(3, ("a",), sealed_at=5.0), None, "known"),
    (None, Round(1, ("a",)), "candidate"),
])
def test_preferred_round(known, candidate, believed):
    assert preferred_round(known, candidate) is (candidate if believed == "candidate" else known)


def p(node: str, wants: int, revision: int, alive_port: int = 7000) -> Declaration:
    return Declaration(node=node, addr="10.0.0.1", wants=wants, revision=revision, alive_port=alive_port)


@pytest.mark.parametrize(("current", "live", "known", "at_most", "probed"), [
    # no round yet: nobody to wait for by name, nothing to probe
    (None, [p("a", 1, 1), p("b", 1, 2)], {}, 8, []),
    # a and b re-declared; c (a member) is silent: probe c
    (R1, [p("a", 2, 11), p("b", 2, 12), p("c", 1, 5)], {}, 8, ["c"]),
    # early in a re-formation two members are silent: both probed (a survivor answers, cached)
    (R1, [p("a", 2, 11), p("b", 1, 4), p("c", 1, 5)], {}, 8, ["b", "c"]),
    # more silent members than at_most: nobody probed yet (they will re-declare within ms)
    (R1, [p("a", 2, 11), p("b", 1, 4), p("c", 1, 5)], {}, 1, []),
    # already probed at this revision: not again; a new declaration is a new revision
    (R1, [p("a", 2, 11), p("b", 2, 12), p("c", 1, 5)], {("c", 5): True}, 8, []),
    (R1, [p("a", 2, 11), p("b", 2, 12), p("c", 1, 6)], {("c", 5): True}, 8, ["c"]),
    # a process that listens on no liveness port (an older version, another host's NAT): not probed
    (R1, [p("a", 2, 11), p("b", 2, 12), p("c", 1, 5, alive_port=0)], {}, 8, []),
    # a newcomer (not a member) is never probed: it is not waited for
    (R1, [p("a", 2, 11), p("b", 2, 12), p("c", 2, 13), p("x", 1, 9)], {}, 8, []),
])
def test_to_probe_only_the_few_silent_members(current, live, known, at_most, probed):
    assert [x.node for x in to_probe(current, live, known, at_most)] == probed


def test_a_member_found_gone_is_not_waited_for():
    live = [p("a", 2, 11), p("b", 2, 12), p("c", 1, 5)]
    assert not seal_due(R1, live, S, 0.0, 0.0)  # c's lease lives: wait for it
    gone = without_dead(live, {("c", 5): False})
    assert [x.node for x in gone] == ["a", "b"]
    assert seal_due(R1, gone, S, 0.0, 0.0)  # c's process is gone: seal now, without it
    # alive, or probed at an older revision only: still waited for
    assert without_dead(live, {("c", 5): True}) == live
    assert without_dead(live, {("c", 4): False}) == live
    assert without_dead(live, {("c", 5): None}) == live  # not known (frozen, cut off): waited for


@pytest.mark.parametrize(("live", "known", "last_call"), [
    # c silent and answering its probe: it runs, slow to notice; wait for it up to its lease
    ([p("a", 2, 11), p("b", 2, 12), p("c", 1, 5)], {("c", 5): True}, 2.0),
    # c silent and not answering (frozen) or not probed yet: the short last call
    ([p("a", 2, 11), p("b", 2, 12), p("c", 1, 5)], {("c", 5): None}, 0.5),
    ([p("a", 2, 11), p("b", 2, 12), p("c", 1, 5)], {}, 0.5),
    # one of two silent members answers, the other not: the short last call
    ([p("a", 2, 11), p("b", 1, 4), p("c", 1, 5)], {("b", 4): True, ("c", 5): None}, 0.5),
    # nobody silent (the dead already left out): the short last call (never waited: all want it)
    ([p("a", 2, 11), p("b", 2, 12)], {("c", 5): False}, 0.5),
])
def test_a_running_member_slow_to_declare_is_waited_for_longer(live, known, last_call):
    assert last_call_for(R1, live, known, 0.5, 2.0) == last_call
    assert last_call_for(None, live, known, 0.5, 2.0) == 0.5  # a first round: nobody known by name


# -- a few members follow the declarations and publish changes for the others ----------------

@pytest.mark.parametrize(("members", "addrs", "followers"), [
    (("a",), ("h1",), ("a",)),
    (("a", "b"), ("h1", "h2"), ("a", "b")),
    (("a", "b", "c", "d"), (), ("a", "b", "c")),  # no addresses (an older record): ranks 0 to 2
    (("a", "b", "c", "d"), ("h1", "h1", "h1", "h1"), ("a", "b", "c")),  # one host: ranks 0 to 2
    # workers of one node share its address: the others follow from other nodes, so that the node
    # of rank 0 dying (all its workers with it), or it and one more, is still seen
    (("a.0", "a.1", "b.0", "b.1", "c.0", "c.1"), ("h1", "h1", "h2", "h2", "h3", "h3"), ("a.0", "b.0", "c.0")),
    (("a.0", "a.1", "b.0", "b.1"), ("h1", "h1", "h2", "h2"), ("a.0", "a.1", "b.0")),
    (("a.0", "a.1", "a.2", "a.3"), ("h1", "h1", "h1", "h1"), ("a.0", "a.1", "a.2")),
])
def test_declaration_followers_are_rank_0_and_two_more_elsewhere(members, addrs, followers):
    assert declaration_followers(Round(number=3, members=members, addrs=addrs)) == followers


R3 = Round(number=3, members=("a", "b", "c", "d", "e"))


@pytest.mark.parametrize(("node", "current", "claim", "publishes"), [
    ("a", R3, None, True),
    ("b", R3, None, True),
    ("c", R3, None, True),
    ("d", R3, None, False),
    ("x", R3, None, False),
    # the holder of the claim to seal the next round follows them anyway (re-declared members stop)
    ("d", R3, Claim("d", 4), True),
    ("x", R3, Claim("x", 4), True),
    ("d", R3, Claim("d", 3), False),  # a stale claim
    ("a", None, Claim("a", 1), False),  # no running round: nothing to publish
])
def test_who_publishes_changes(node, current, claim, publishes):
    assert publishes_changes(node, current, claim) is publishes


def _reform(round_number=3, **reasons) -> Reform:
    return Reform(round=round_number, **{k: tuple(v) for k, v in reasons.items()})


@pytest.mark.parametrize(("seen", "published", "closed", "due"), [
    (Change(), None, False, False),
    (Change(lost=("c",)), None, False, True),
    (Change(waiting=("x",)), None, False, True),
    (Change(lost=("c",)), _reform(2, lost="c"), False, True),  # a record of an older round
    (Change(lost=("c",)), _reform(lost="c"), False, False),
    # once it says "re-form", members moving on and newcomers arriving do not rewrite it
    # (N rewrites of a record N members follow would be the N² this record avoids) ...
    (Change(lost=("c",), moved_on=("a", "b")), _reform(lost="c"), False, False),
    (Change(moved_on=("a", "b", "d")), _reform(moved_on="a"), False, False),
    (Change(lost=("c",), waiting=("x", "y")), _reform(lost="c", waiting="x"), False, False),
    # ... but the lost members do (each agent tells a lost member from a finished one)
    (Change(lost=("c", "d")), _reform(lost="c"), False, True),
    (Change(moved_on=("c",)), _reform(lost="c"), False, True),  # it came back
    # a newcomer that waited withdrew before anyone moved on: nothing to re-form for any more
    (Change(), _reform(waiting="x"), False, True),
    (Change(waiting=("x",)), _reform(), False, True),
    (Change(), _reform(), False, False),
    # closed: members withdraw as they finish, which is no loss
    (Change(lost=("c",)), None, True, False),
])
def test_when_a_follower_rewrites_the_reform_record(seen, published, closed, due):
    assert reform_due(seen, R3, published, closed) is due


@pytest.mark.parametrize(("current", "published", "finished", "expected"), [
    (R3, None, (), Change()),
    (R3, _reform(2, lost="c"), (), Change()),  # about an older round
    (R3, _reform(lost="c", moved_on="b"), (), Change(lost=("c",), moved_on=("b",))),
    (R3, _reform(lost="cd"), ("c",), Change(lost=("d",))),  # c finished: not lost
    (R3, _reform(waiting="x"), (), Change(waiting=("x",))),
    (Round(number=4, members=("b", "c")), _reform(lost="c"), (), Change(superseded=True)),
    (None, None, (), Change(superseded=True)),
])
def test_change_of_a_member_that_reads_the_reform_record(current, published, finished, expected):
    assert change_from_reform("a", 3, current, published, frozenset(finished)) == expected


def test_what_a_follower_publishes_is_what_the_others_read():
    live = {"a": d("a", 4, 20), "b": d("b", 3, 2), "x": d("x", 4, 21)}
    seen = observed_change(R3, live, max_nodes=8)
    assert seen == Change(lost=("c", "d", "e"), moved_on=("a",), waiting=("x",))
    published = reform_record(seen, R3, "b")
    assert published.seen_by == "b" and reform_due(seen, R3, published) is False
    assert change_from_reform("d", 3, R3, published) == change_for("b", 3, R3, live, 8) == seen


def test_reform_records_round_trip_and_refuse_bad_names():
    reform = Reform(round=7, lost=("a.0",), moved_on=("b.1", "c.0"), waiting=("x",), seen_by="b.1", revision=5)
    assert Reform.from_json(reform.to_json("k", b"s").encode(), 5, "k", b"s") == reform
    assert Reform.from_json(reform.to_json("k", b"s").encode(), 5, "other", b"s") is None
    assert Reform.from_json(b'{"round": 7, "lost": ["a/b"]}', 1) is None
    assert Reform.from_json(b'{"round": 7, "lost": "abc"}', 1) is None
    assert Reform.from_json(b'{"round": 7, "seen_by": 0}', 1) is None
    assert Reform.from_json(b'{"round": 7}', 1) == Reform(round=7, revision=1)


FULL = Round(number=1, members=("a", "b", "c"), revision=10)


@pytest.mark.parametrize(("current", "live", "min_nodes", "quorum"), [
    # the first round: enough nodes want it
    (None, [d("a", 1, 1)], 1, True),
    (None, [d("a", 1, 1)], 2, False),
    # a spare waits beside a full running round: alone it is no quorum, whatever min_nodes
    (FULL, [d("a", 1, 1), d("b", 1, 2), d("c", 1, 3), d("s", 2, 4)], 1, False),
    # a member of the running round wants the next one: the re-formation has begun
    (FULL, [d("a", 2, 5), d("b", 1, 2), d("s", 2, 4)], 1, True),
    (FULL, [d("a", 2, 5), d("b", 1, 2), d("s", 2, 4)], 3, False),
    # every member of the running round is gone: newcomers make the quorum alone
    (FULL, [d("s", 2, 4), d("t", 2, 6)], 2, True),
])
def test_has_quorum(current, live, min_nodes, quorum):
    assert has_quorum(current, live, min_nodes) is quorum


def test_a_waiting_spare_does_not_seal_before_the_survivors_re_declare():
    """A spare has waited 100 s beside the full round a, b, c (MIN 1, MAX 3); c dies (a probe found it
    gone) and a re-declares at once. The last call counts from a's declaration, as the claim holder
    tracks it (:func:`has_quorum`), so b, a moment slower, is not left out of the next round."""
    settings = Settings(min_nodes=1, max_nodes=3, last_call=1.0)
    before = [d("a", 1, 1), d("b", 1, 2), d("c", 1, 3), d("s", 2, 4)]
    assert not has_quorum(FULL, before, settings.min_nodes)  # 100 s of waiting start no timer
    a_re_declared = [d("a", 2, 5), d("b", 1, 2), d("s", 2, 4)]
    quorum_since = 100.0  # when a re-declared
    assert not seal_due(FULL, a_re_declared, settings, quorum_since, now=100.05)
    all_re_declared = [d("a", 2, 5), d("b", 2, 6), d("s", 2, 4)]
    assert seal_due(FULL, all_re_declared, settings, quorum_since, now=100.06)
    assert next_members(FULL, wanting(FULL, all_re_declared), settings.max_nodes) == ("a", "b", "s")


WORKERS = Settings(min_nodes=1, max_nodes=3, last_call=1.0, members_are_workers=True)
BY_NODE = counted_by(WORKERS)
WORLD = Round(number=1, members=("a.0", "b.0", "c.0"), revision=10)


def w(name: str, wants: int, revision: int, node_size: int = 1) -> Declaration:
    return Declaration(node=name, addr="10.0.0.1", wants=wants, revision=revision, node_size=node_size)


def test_members_that_are_workers_count_as_their_nodes():
    assert [node_of(n) for n in ("a.0", "a.1", "host.example.3", "agent")] == ["a", "a", "host.example", "agent"]
    assert count(("a.0", "a.1", "b.0"), BY_NODE) == 2 and count(("a.0", "a.1", "b.0")) == 3
    assert counted_by(Settings(min_nodes=1, max_nodes=3, last_call=1.0))("a.0") == "a.0"


@pytest.mark.parametrize(("current", "candidates", "members"), [
    # beside a full world of three one-worker nodes, a node of two workers is no fourth node
    (WORLD, [w("a.0", 2, 1), w("b.0", 2, 2), w("c.0", 2, 3), w("d.0", 2, 4, 2), w("d.1", 2, 5, 2)],
     ("a.0", "b.0", "c.0")),
    # a member lost: both of its workers take the place
    (WORLD, [w("a.0", 2, 1), w("b.0", 2, 2), w("d.0", 2, 4, 2), w("d.1", 2, 5, 2)], ("a.0", "b.0", "d.0", "d.1")),
    # a restarted worker of a node in the world takes no second place
    (Round(number=1, members=("a.0", "b.0", "c.0"), revision=10),
     [w("a.0", 2, 1, 2), w("b.0", 2, 2), w("c.0", 2, 3), w("a.1", 2, 6, 2)], ("a.0", "b.0", "c.0", "a.1")),
])
def test_next_members_count_nodes_when_members_are_workers(current, candidates, members):
    assert next_members(current, candidates, WORKERS.max_nodes, BY_NODE) == members


def test_a_node_of_more_workers_beside_a_full_world_is_no_change():
    live = {d.node: d for d in (w("a.0", 1, 1), w("b.0", 1, 2), w("c.0", 1, 3), w("d.0", 2, 4, 2), w("d.1", 2, 5, 2))}
    assert observed_change(WORLD, live, WORKERS.max_nodes, counted=BY_NODE) == Change()
    # counted in workers, the same declarations would make room for d.0 and d.1 beside MAX 3 x 2 workers
    assert observed_change(WORLD, live, 6).waiting == ("d.0", "d.1")
    # a worker of a node already in the world fits whatever the room
    live["a.1"] = w("a.1", 2, 6, 2)
    assert observed_change(WORLD, live, WORKERS.max_nodes, counted=BY_NODE).waiting == ("a.1",)


@pytest.mark.parametrize(("declarations", "complete"), [
    ([], True),
    ([w("a.0", 1, 1, 2), w("a.1", 1, 2, 2), w("b.0", 1, 3)], True),
    ([w("a.0", 1, 1, 2), w("b.0", 1, 3)], False),  # a's second worker has not declared yet
    ([d("agent", 1, 1)], True),  # declarations that say no node size are whole as they are
])
def test_complete_nodes(declarations, complete):
    assert complete_nodes(declarations) is complete


def test_a_first_round_of_workers_is_full_once_max_nodes_came_with_all_their_workers():
    some = [w("a.0", 1, 1, 2), w("b.0", 1, 2), w("c.0", 1, 3)]
    assert not seal_due(None, some, WORKERS, quorum_since=None, now=0.0)  # a.1 still to come
    assert seal_due(None, [*some, w("a.1", 1, 4, 2)], WORKERS, quorum_since=None, now=0.0)
    # MIN counts nodes too: two workers of one node are no quorum of two nodes
    two = Settings(min_nodes=2, max_nodes=3, last_call=1.0, members_are_workers=True)
    assert not has_quorum(None, [w("a.0", 1, 1, 2), w("a.1", 1, 2, 2)], two.min_nodes, counted_by(two))


def test_a_declarations_node_size_round_trips_and_is_checked():
    declaration = w("d.1", 2, 7, 2)
    assert Declaration.from_json(declaration.to_json().encode(), 7) == declaration
    # a worker's local rank must be below its node's worker count; an absurd count is no declaration
    assert Declaration.from_json(w("d.2", 2, 7, 2).to_json().encode(), 7) is None
    assert Declaration.from_json(w("d.0", 2, 7, 10**6).to_json().encode(), 7) is None


@pytest.mark.parametrize(("nodes", "min_nodes", "gathered_by", "expected"), [
    (["a"], 2, None, "round 1: waiting for 1 more node (have a; min 2)"),
    ([], 3, None, "round 1: waiting for 3 more nodes (have none; min 3)"),
    (["b", "a", "a"], 2, None, "round 1: 2 nodes here (a, b; min 2); sealing soon"),
    ([], 2, "a", "round 1: waiting for the nodes to gather (node a counts them; min 2)"),
])
def test_what_a_waiting_node_says(nodes, min_nodes, gathered_by, expected):
    from elasticctl.rendezvous.rounds import waiting_line

    live = [Declaration(node, "127.0.0.1", 1, 100 + i) for i, node in enumerate(nodes)]
    assert waiting_line(1, live, min_nodes, gathered_by=gathered_by) == expected
