"""A job that runs for days. Nothing it needs may expire or vanish while it runs, and
a missing round or generation record while members live is never read as "no job yet".

Contract tests on a real etcd (the run lease, members writing their round back, a newcomer
that waits, forged and replayed records), then real `elasticctl up`/`join` jobs in restart
and hot mode with the run's ttl shortened to seconds: they run for 3 x ttl, then a join, a kill
and a leave complete, the round records are deleted in turn, and no second world ever trains.

Layer tests/contract: a real etcd, no training processes. The other tests of this subject:
tests/process/test_long_running_jobs.py.
"""

from __future__ import annotations

import threading
import time

from support.helpers import wait_for

from elasticctl.etcd.client import EtcdClient
from elasticctl.job.keys import JobKeys
from elasticctl.job.records import Declaration, Round, run_secret
from elasticctl.job.run_lease import RunLease
from elasticctl.rendezvous.member import JoinCancelled, RoundMember
from elasticctl.rendezvous.rounds import Settings
from elasticctl.rendezvous.view import RoundView


TTL = 3  # seconds: the run's keys of an abandoned run expire after this


# -- the run lease ---------------------------------------------------------------------------

def test_the_run_lease_keeps_a_live_jobs_keys_and_lets_an_abandoned_runs_expire(default_etcd, run_id):
    keys = JobKeys(run_id)
    with EtcdClient(default_etcd.client_settings()) as client:
        first = RunLease(client, TTL, keys.run_lease).start()
        second = RunLease(client, TTL, keys.run_lease).start()  # another agent of the job: the same lease
        assert first.id() == second.id()
        client.put(keys.rdzv_round, "kept", lease=first.id())
        # Nothing writes through the lease: only the keepers renew it (the bug: the key went after ttl).
        began = time.monotonic()
        while time.monotonic() - began < 3 * TTL:
            assert client.get(keys.rdzv_round) is not None, "a live run's key expired"
            time.sleep(0.5)  # sampling the key over 3 x ttl: the passing of time is what is tested
        first.stop()  # one agent gone: the other keeps the run alive
        began = time.monotonic()
        while time.monotonic() - began < 2 * TTL:
            assert client.get(keys.rdzv_round) is not None, "the key expired while an agent lived"
            time.sleep(0.5)
        second.stop()  # the last one gone: the run is abandoned
        wait_for(lambda: client.get(keys.rdzv_round) is None, 3 * TTL, "the abandoned run's key to expire")


# -- a missing or forged round record --------------------------------------------------------

def test_members_write_back_a_deleted_round_and_a_newcomer_joins_them(run):
    r = run(Settings(min_nodes=1, max_nodes=3, last_call=1))
    a, b = r.member("a"), r.member("b")
    sealed = r.join_all([a, b])["a"]
    client = a._client
    client.delete(r.keys.rdzv_round)
    wait_for(lambda: client.get(r.keys.rdzv_round) is not None, 10, "a member to write its round back")
    assert Round.from_json(client.get(r.keys.rdzv_round).value, 0).same_round(dataclass_copy(sealed))
    assert a.change().count == 0 and b.change().count == 0
    c = r.member("c")
    joined: dict = {}
    thread = threading.Thread(target=lambda: joined.update(c=c.join()))
    thread.start()
    wait_for(lambda: a.change().waiting == ("c",), 20, "the members to see the newcomer waiting")
    joined.update(r.join_all([a, b]))
    thread.join(30)
    assert joined["c"].number == sealed.number + 1 and set(joined["c"].members) == {"a", "b", "c"}


def dataclass_copy(round_: Round) -> Round:
    return Round(round_.number, round_.members, round_.addrs, round_.master_port, 0, round_.sealed_at)


def test_a_newcomer_never_seals_a_round_beside_live_members_whose_record_it_cannot_see(default_etcd, run_id):
    """The record of round 4 is gone while its members' declarations live (the hot-mode failure
    this guards against: a joiner formed a generation 1 of its own and trained from step 0 beside
    the job)."""
    keys = JobKeys(run_id)
    with EtcdClient(default_etcd.client_settings()) as client:
        lease = client.grant_lease(30)
        for node in ("a", "b"):
            client.put(keys.rdzv_node(node), Declaration(node, f"addr-{node}", 4).to_json(), lease=lease)
        view = RoundView(client, keys).start()
        c = RoundMember(client, view, "c", "addr-c", Settings(min_nodes=1, max_nodes=3, last_call=0.2),
                        node_ttl=2, join_timeout=60)
        joined: dict = {}

        def join() -> None:
            try:
                joined["c"] = c.join()
            except JoinCancelled:
                pass  # the test ends the wait

        thread = threading.Thread(target=join, daemon=True)
        thread.start()
        try:
            wait_for(lambda: view.claim is not None and view.claim.node == "c", 10, "c to claim the sealing")
            # Past c's last call several times over: a sealing would have happened by now.
            assert not thread.join(2.0) and "c" not in joined, joined
            assert client.get(keys.rdzv_round) is None, "a round was sealed beside the live members"
            # The members write their round back: c joins them in the round after it.
            client.put(keys.rdzv_round, Round(4, ("a", "b"), ("addr-a", "addr-b"), sealed_at=1.0).to_json())
            wait_for(lambda: (view.declarations.get("c") or Declaration("c", "x", 0)).wants == 5, 10,
                     "c to want round 5")
        finally:
            c.cancel()
            thread.join(10)
            view.stop()
            client.revoke_lease(lease)


def test_a_forged_round_of_the_same_number_is_refused_and_overwritten(run):
    """Without a secret the check used to be `>=`: a forged round 2 restarted every worker."""
    r = run(Settings(min_nodes=2, max_nodes=2, last_call=1))
    a, b = r.member("a"), r.member("b")
    r.join_all([a, b])
    sealed = r.join_all([a, b])["a"]
    assert sealed.number == 2
    client = a._client
    for forged in (Round(2, ("x",), ("addr-x",)), Round(2, ("a", "b"), ("a", "b"), sealed_at=time.time() + 60)):
        client.put(r.keys.rdzv_round, forged.to_json())
        wait_for(lambda: Round.from_json(client.get(r.keys.rdzv_round).value, 0).same_round(dataclass_copy(sealed)),
                 10, "a member to write its round back over the forged one")
        assert a.change().count == 0 and b.change().count == 0, "a forged round disturbed the running round"
        assert a.view.round.same_round(sealed) and b.view.round.same_round(sealed)


def test_signed_records_of_an_earlier_run_are_refused(default_etcd, run_id):
    """A signed round of an earlier run of the job (same name, same secret) replayed
    while the new run's first node waited: it took "round 2: rank 0 of 2" and waited for a ghost."""
    keys = JobKeys(run_id)
    settings = Settings(min_nodes=1, max_nodes=2, last_call=0.3)
    with EtcdClient(default_etcd.client_settings()) as client:
        old_secret = run_secret(b"s3cret", "r100")
        replayed = Round(2, ("a", "ghost"), ("addr-a", "addr-ghost"), sealed_at=1.0)
        client.put(keys.rdzv_round, replayed.to_json(keys.rdzv_round, old_secret))
        assert RoundView(client, keys, old_secret).start().round is not None  # readable in its own run
        view = RoundView(client, keys, run_secret(b"s3cret", "r200")).start()
        try:
            assert view.round is None
            sealed = RoundMember(client, view, "a", "addr-a", settings, node_ttl=2, join_timeout=20).join()
            assert sealed.number == 1 and sealed.members == ("a",)
        finally:
            view.stop()
