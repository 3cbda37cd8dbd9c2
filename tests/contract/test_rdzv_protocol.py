"""The etcd-native rendezvous protocol against a real etcd: concurrent joins, sealing, leaving,
lease expiry, rounds that supersede rounds, close, a watch that survives an etcd restart."""

from __future__ import annotations

import threading
import time

import pytest
from support.rendezvous import Run
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousTimeoutError

from elasticctl.etcd.client import EtcdClient
from elasticctl.embedded_etcd import EmbeddedEtcd
from elasticctl.job.keys import JobKeys
from elasticctl.job.records import Declaration
from elasticctl.rendezvous.member import JoinCancelled, RoundMember
from elasticctl.rendezvous.rounds import Settings
from elasticctl.rendezvous.view import RoundView


def test_concurrent_joins_seal_one_round_with_distinct_ranks(run):
    r = run(Settings(min_nodes=8, max_nodes=8, last_call=30))
    members = [r.member(f"n{i}") for i in range(8)]
    started = time.monotonic()
    results = r.join_all(members)
    elapsed = time.monotonic() - started
    rounds = set(results.values())
    assert len(rounds) == 1, results
    sealed = rounds.pop()
    assert sealed.number == 1 and sorted(sealed.members) == sorted(m.node for m in members)
    # the round is full at max_nodes: nobody waited for the 30 s last call
    assert elapsed < 15


def test_a_round_of_nodes_starting_at_once_costs_two_proposals_a_node(tmp_path, run_id):
    from support.helpers import etcd_metric

    # An etcd of its own: nothing but this round proposes (no other test's leases expiring).
    nodes = 12
    with EmbeddedEtcd(data_dir=str(tmp_path / "data"), client_port=0, peer_port=0) as etcd:
        r = Run(etcd, run_id, Settings(min_nodes=nodes, max_nodes=nodes, last_call=30))
        members = [r.member(f"n{i}") for i in range(nodes)]
        before = etcd_metric(etcd, "etcd_server_proposals_committed_total")
        results = r.join_all(members)
        proposals = etcd_metric(etcd, "etcd_server_proposals_committed_total") - before
        r.close()
    assert len({results[m.node] for m in members}) == 1 and results["n0"].number == 1, results
    # Each node: its lease, and its declaration with the claim to seal in one transaction (a
    # claim of its own would be one more, even when its compare fails); then the one seal.
    assert proposals == 2 * nodes + 1


def test_a_round_seals_once_every_live_node_wants_it(run):
    r = run(Settings(min_nodes=1, max_nodes=8, last_call=5))
    a, b = r.member("a"), r.member("b")
    first = r.join_all([a, b])
    assert first["a"].number == 1 and first["a"] == first["b"]
    # a's workers failed: it wants round 2; b is still in round 1 until it sees the change
    waiting = b.change()
    assert waiting.count == 0
    t = threading.Thread(target=lambda: first.update(a2=a.join()))
    t.start()
    b.view.wait_for(lambda: b.change().count > 0, 10)
    assert b.change().moved_on == ("a",)
    rejoined_at = time.monotonic()
    first["b2"] = b.join()
    assert time.monotonic() - rejoined_at < 4.5, "re-forming waited for the 5 s last call"
    t.join()
    assert first["a2"] == first["b2"] and first["a2"].number == 2
    assert first["a2"].members == first["a"].members  # ranks kept


def test_a_lost_lease_is_a_change_and_the_survivor_reforms_alone(run):
    r = run(Settings(min_nodes=1, max_nodes=2, last_call=1), node_ttl=2)
    a, b = r.member("a"), r.member("b")
    r.join_all([a, b])
    b._lease.stop(revoke=False)  # b freezes: its keep-alives stop, its lease expires
    assert a.view.wait_for(lambda: a.change().lost == ("b",), 10)
    again = a.join()
    assert again.number == 2 and again.members == ("a",)


def test_a_lease_lost_while_waiting_for_the_first_round_declares_again(run):
    from support.helpers import wait_for

    # min = max: a round that did not count the starved node could never fill.
    r = run(Settings(min_nodes=2, max_nodes=2, last_call=1), node_ttl=2, join_timeout=20)
    a, b = r.member("a"), r.member("b")
    results: dict[str, object] = {}
    waiting = threading.Thread(target=lambda: results.update(a=a.join()))
    waiting.start()
    declaration = r.keys.rdzv_node("a")
    wait_for(lambda: a._client.get(declaration) is not None, 10, "a's declaration")
    lost = a._lease.held
    a._client.revoke_lease(lost)  # as etcd does once a starved node's renewals stop: keys go with it
    wait_for(lambda: a._lease.held not in (None, lost) and a._client.get(declaration) is not None, 10,
             "a's declaration on its new lease")
    results["b"] = b.join()
    waiting.join(30)
    assert results["a"] == results["b"] and sorted(results["a"].members) == ["a", "b"]
    assert results["a"].number == 1


def test_a_graceful_leave_is_seen_at_once(run):
    r = run(Settings(min_nodes=1, max_nodes=3, last_call=1))
    a, b = r.member("a"), r.member("b")
    r.join_all([a, b])
    b.leave()
    assert a.view.wait_for(lambda: a.change().lost == ("b",), 2)


def test_nodes_beyond_max_wait_and_are_counted_only_when_there_is_room(run):
    r = run(Settings(min_nodes=2, max_nodes=2, last_call=1))
    a, b, c = r.member("a"), r.member("b"), r.member("c")
    results = r.join_all([a, b])
    assert results["a"].members == ("a", "b") or results["a"].members == ("b", "a")
    c_joined = {}
    t = threading.Thread(target=lambda: c_joined.update(c=c.join()))
    t.start()
    a.change()  # a member's first look: from then on it follows the declarations
    assert a.view.wait_for(lambda: a.view.nodes_followed and "c" in a.view.declarations, 5)
    assert a.change().count == 0  # full round: c waits without disturbing it
    b.leave()
    assert a.view.wait_for(lambda: a.change().count >= 1, 5)  # b gone: room for c
    c_joined["a"] = a.join()
    t.join(30)
    assert c_joined["c"] == c_joined["a"] and set(c_joined["c"].members) == {"a", "c"}


def test_close_ends_joining(run):
    r = run(Settings(min_nodes=2, max_nodes=2, last_call=1), join_timeout=30)
    a = r.member("a")
    closer = r.member("closer")
    threading.Timer(0.5, closer.view.close).start()
    with pytest.raises(RendezvousClosedError):
        a.join()


def test_join_timeout_names_the_round(run):
    r = run(Settings(min_nodes=2, max_nodes=2, last_call=1), join_timeout=1)
    with pytest.raises(RendezvousTimeoutError, match="round 1"):
        r.member("a").join()


def test_the_view_survives_an_etcd_restart(tmp_path, run_id):
    etcd = EmbeddedEtcd(data_dir=str(tmp_path / "data"), client_port=0, peer_port=0).start()
    try:
        r = Run(etcd, run_id, Settings(min_nodes=1, max_nodes=2, last_call=1))
        a, b = r.member("a"), r.member("b")
        r.join_all([a, b])
        etcd.kill()
        etcd.start()
        # A change made after the restart reaches a's view through a new watch.
        b.leave()
        assert a.view.wait_for(lambda: a.change().lost == ("b",), 20)
        r.close()
    finally:
        etcd.stop()


class _WritesAFile:
    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("planted", ["pickle", "garbage", "replay"])
def test_a_planted_or_replayed_round_is_ignored_then_overwritten(run, tmp_path, planted):
    import pickle

    r = run(Settings(min_nodes=2, max_nodes=2, last_call=1))
    a, b = r.member("a"), r.member("b")
    r.join_all([a, b])
    round_key = r.keys.rdzv_round
    old = a._client.get(round_key).value
    again = r.join_all([a, b])  # round 2
    assert again["a"].number == 2
    marker = tmp_path / "pwned"
    value = {"pickle": pickle.dumps(_WritesAFile(marker)), "garbage": b"\x00\xff not json",
             "replay": old}[planted]
    revision = a._client.put(round_key, value)
    # Evaluated by a's watch after each change (wait_until): the planted value is a transient, as
    # the members write their round back at once, and a waiter woken later may find it gone.
    assert a.view.wait_until(lambda: a.view.round_revision >= revision, 5)
    assert a.change().count == 0 and b.change().count == 0, "a planted round disturbed a running round"
    assert a.view.round.number == 2
    third = r.join_all([a, b])  # the next seal overwrites the planted value
    assert third["a"].number == 3 and third["a"] == third["b"]
    assert not marker.exists()


def test_a_planted_declaration_under_another_name_is_ignored(run):
    r = run(Settings(min_nodes=1, max_nodes=3, last_call=1))
    a = r.member("a")
    a._client.put(r.keys.rdzv_node("ghost"), '{"node": "a", "addr": "x", "wants": 1}')
    a._client.put(r.keys.rdzv_node("junk"), b"\x80\x04not json")
    assert a.join().members == ("a",)


def test_with_a_secret_unsigned_or_foreign_records_are_ignored(default_etcd, run_id):
    settings = Settings(min_nodes=1, max_nodes=3, last_call=0.5)
    client = EtcdClient(default_etcd.client_settings())
    keys = JobKeys(run_id)
    view = RoundView(client, keys, secret=b"s3cret").start()
    try:
        # Someone without the secret declares a node and plants a round.
        client.put(keys.rdzv_node("intruder"), '{"node": "intruder", "addr": "x", "wants": 1}')
        client.put(keys.rdzv_round, '{"round": 7, "members": ["intruder"], "addrs": ["x"]}')
        member = RoundMember(client, view, "a", "addr-a", settings, node_ttl=2, join_timeout=20)
        sealed = member.join()
        assert sealed.members == ("a",) and sealed.number == 1
        assert view.nodes_followed and "intruder" not in view.declarations
        # A node with another secret cannot read the signed round either.
        other = RoundView(client, keys, secret=b"other").start()
        assert other.round is None
        other.stop()
    finally:
        view.stop()
        client.close()


def test_a_claim_that_cannot_expire_or_is_unsigned_blocks_nothing(default_etcd, run_id):
    settings = Settings(min_nodes=1, max_nodes=3, last_call=0.5)
    client = EtcdClient(default_etcd.client_settings())
    keys = JobKeys(run_id)
    # No lease: it would hold the sealing forever. Signed by nobody: foreign with a secret.
    client.put(keys.rdzv_sealer, '{"node": "ghost", "round": 1}')
    view = RoundView(client, keys, secret=b"s3cret").start()
    try:
        member = RoundMember(client, view, "a", "addr-a", settings, node_ttl=2, join_timeout=20)
        assert member.join().members == ("a",)
    finally:
        view.stop()
        client.close()


def test_a_claim_holder_that_dies_is_replaced_when_its_lease_ends(run):
    r = run(Settings(min_nodes=1, max_nodes=3, last_call=0.5), join_timeout=30)
    b = r.member("b")
    # "a" claimed round 1 and died before sealing it: its lease is no longer kept alive.
    lease = b._client.grant_lease(2)
    b._client.put(r.keys.rdzv_sealer, '{"node": "a", "round": 1}', lease=lease)
    assert b.view.wait_for(lambda: b.view.claim is not None, 5)
    sealed = b.join()
    assert sealed.members == ("b",) and sealed.number == 1


def test_only_the_claim_holder_follows_declarations_while_a_round_forms(run):
    r = run(Settings(min_nodes=4, max_nodes=4, last_call=30))
    members = [r.member(n) for n in "abcd"]
    followed_before_seal = set()
    for m in members:
        original = m.view.follow_nodes

        def spy(background=False, m=m, original=original):
            if m.view.round is None:
                followed_before_seal.add(m.node)
            original(background)
        m.view.follow_nodes = spy
    results = r.join_all(members)
    assert {res.number for res in results.values()} == {1}
    assert len(followed_before_seal) == 1, followed_before_seal


def test_a_node_that_dies_after_declaring_costs_one_round(run):
    """Dying at each step: after its declaration (here), holding the claim (above), in a sealed
    round (the lost-lease tests): the others go on within one more round."""
    r = run(Settings(min_nodes=2, max_nodes=3, last_call=0.5))
    a, b = r.member("a"), r.member("b")
    # x declared for round 1, then died: its lease is no longer kept alive.
    lease = a._client.grant_lease(2)
    a.view.declare(Declaration("x", "addr-x", 1), lease)
    first = r.join_all([a, b])
    # Three want round 1 of at most 3: sealed at once, x with them (its lease still runs) ...
    assert first["a"] == first["b"] and set(first["a"].members) == {"a", "b", "x"}
    # ... and lost when it ends: one more round, without x. Both members look, as torch's agent
    # does every monitor interval: the one of them that follows the declarations (rank 0 is x,
    # so the other follower is whichever of a and b declared first) publishes what it sees.
    def lost_seen() -> bool:
        b.change()
        return a.change().lost == ("x",)

    assert a.view.wait_for(lost_seen, 10)
    second = r.join_all([a, b])
    assert second["a"] == second["b"] and set(second["a"].members) == {"a", "b"}
    assert second["a"].number == 2


def test_only_three_members_follow_declarations_and_a_frozen_rank_0_still_reaches_everyone(run):
    """The others learn of changes from the ctl/reform record the followers write."""
    r = run(Settings(min_nodes=5, max_nodes=6, last_call=0.5), node_ttl=2)
    members = {m.node: m for m in (r.member(n) for n in "abcde")}
    sealed = r.join_all(list(members.values()))["a"]
    rank0, rank1, rank2, *others = (members[n] for n in sealed.members)
    for m in members.values():
        m.change()  # the first look: followers start following, the sealer stops
    for follower in (rank0, rank1, rank2):
        assert follower.view.wait_for(lambda follower=follower: follower.view.nodes_followed, 5), follower.node
    assert not any(m.view.nodes_followed for m in others)
    # A newcomer waits: everybody sees it, the non-followers through the record.
    x = r.member("x")
    x_joined = {}
    t = threading.Thread(target=lambda: x_joined.update(x=x.join()))
    t.start()
    for m in members.values():
        assert m.view.wait_for(lambda m=m: m.change().waiting == ("x",), 5), m.node
    assert not any(m.view.nodes_followed for m in others)
    second = r.join_all(list(members.values()))
    t.join(30)
    assert x_joined["x"] == second["a"] and len(second["a"].members) == 6
    # Rank 0 freezes: its lease expires, rank 1 sees it and tells the others.
    rank0 = members[second["a"].members[0]]
    for m in [*members.values(), x]:
        m.change()
    rank0._lease.stop(revoke=False)
    survivors = [m for m in [*members.values(), x] if m is not rank0]
    for m in survivors:
        assert m.view.wait_for(lambda m=m: m.change().lost == (rank0.node,), 10), m.node
        # ... and when it was seen, for the failure verdicts of the agents that did not follow it
        assert rank0.node in m.view.gone_at
    third = r.join_all(survivors)
    assert {res.number for res in third.values()} == {3}
    assert set(third[survivors[0].node].members) == {m.node for m in survivors}


def test_a_slow_change_callback_holds_up_no_watch_event(run):
    """The ctl/reform publish (an etcd write) runs on the view's writer, not on the
    watch thread: while a change callback is held, the watches still bring every event (the
    joins below wait on them), and the held callback runs once more afterwards, not once per event."""
    r = run(Settings(min_nodes=2, max_nodes=2, last_call=0.5))
    a, b = r.member("a"), r.member("b")
    entered, release = threading.Event(), threading.Event()
    calls = []

    def slow() -> None:
        calls.append(time.monotonic())
        entered.set()
        release.wait(30)

    a.view.on_change(slow)
    b.view.on_change(slow)
    started = time.monotonic()
    sealed = r.join_all([a, b])
    try:
        assert sealed["a"] == sealed["b"] and sealed["a"].number == 1
        assert entered.is_set() and not release.is_set()
        assert time.monotonic() - started < 15, "the joins waited for the held callback"
        assert len(calls) <= 2, "a held callback was run again before it returned"
    finally:
        release.set()


def test_a_sharded_jobs_generations_admit_a_joining_node_whole(run):
    """Workers of 2-worker nodes (a sharded job's generations). A joining node with one
    worker declared is no reason to re-form, is not sealed into the survivors' next generation and
    does not hold it up; with both declared it is admitted whole; a node that loses a worker leaves
    as a whole, its other worker waiting."""
    r = run(Settings(min_nodes=2, max_nodes=6, last_call=5))
    survivors = [r.member(name, node_workers=2) for name in ("a.0", "a.1", "b.0", "b.1")]
    first = r.join_all(survivors)
    ranks = first["a.0"].members  # in the order they declared
    assert {g.members for g in first.values()} == {ranks} and sorted(ranks) == ["a.0", "a.1", "b.0", "b.1"], first
    rank0 = next(m for m in survivors if m.node == ranks[0])
    assert rank0.change().count == 0  # rank 0 follows the declarations from here on

    joined: dict[str, object] = {}

    def join(member: RoundMember) -> threading.Thread:
        def target() -> None:
            try:
                joined[member.node] = member.join()
            except Exception as exc:  # noqa: BLE001 - reported to the test
                joined[member.node] = exc
        thread = threading.Thread(target=target)
        thread.start()
        return thread

    c0 = r.member("c.0", node_workers=2)
    c0_joining = join(c0)
    assert rank0.view.wait_for(lambda: "c.0" in rank0.view.declarations, 10), "c.0 never declared"
    assert rank0.change().count == 0, "half a node made the generation re-form"

    # The survivors re-form for another reason while c.1 is still starting: sealed at once, without c.0.
    started = time.monotonic()
    second = r.join_all(survivors)
    assert time.monotonic() - started < 4.5, "the survivors waited out the 5 s last call for half a node"
    assert {g.members for g in second.values()} == {ranks}, second
    assert c0_joining.is_alive() and "c.0" not in joined, joined

    c1 = r.member("c.1", node_workers=2)
    c1_joining = join(c1)
    assert rank0.view.wait_for(lambda: set(rank0.change().waiting) == {"c.0", "c.1"}, 10), rank0.change()
    third = r.join_all(survivors)
    for thread in (c0_joining, c1_joining):
        thread.join(10)
    members = {g.members for g in (*third.values(), joined["c.0"], joined["c.1"])}
    assert len(members) == 1 and set(members.pop()) == {"a.0", "a.1", "b.0", "b.1", "c.0", "c.1"}, (third, joined)
    assert third["a.0"].members[:4] == ranks  # the survivors keep their ranks

    # c.1 is lost: the whole of node c leaves the next generation, c.0 waits.
    c1.leave()
    assert rank0.view.wait_for(lambda: rank0.change().lost == ("c.1",), 10), rank0.change()
    joined.clear()
    c0_waiting = join(c0)
    fourth = r.join_all(survivors)
    assert {g.members for g in fourth.values()} == {ranks}, fourth
    assert c0_waiting.is_alive() and "c.0" not in joined, joined
    c0.cancel()
    c0_waiting.join(10)
    assert isinstance(joined["c.0"], JoinCancelled), joined
