"""The rendezvous records in a real etcd (elasticctl/job/rdzv_records.py): the protocol's
declarations, claim, seal and close; a c10d store's keys; torch's state key.

Layer tests/contract: a real etcd, no processes. The protocol on top: test_rdzv_protocol.py;
the store and torch's backend: test_store.py, test_backend.py.
"""

from __future__ import annotations

import threading

from elasticctl.job.keys import JobKeys
from elasticctl.job.rdzv_records import RoundRecords, StoreRecords, TorchStateRecord
from elasticctl.job.run_lease import RunLease
from elasticctl.job.records import Claim, Declaration, Round


def test_declarations_read_back_signed_and_under_their_own_node(etcd_client, run_id):
    keys = JobKeys(run_id)
    records = RoundRecords(etcd_client, keys, secret=b"s3cret")
    lease = etcd_client.grant_lease(30)
    revision = records.declare(Declaration("a", "10.0.0.1", 1), lease)
    kv = etcd_client.get(keys.rdzv_node("a"))
    assert kv.lease == lease and kv.mod_revision == revision
    assert records.declaration_at(kv.key, kv.value, kv.mod_revision) == (
        "a", Declaration("a", "10.0.0.1", 1, revision=revision))
    # the same record under another node's name, or read without the secret, is no declaration
    assert records.declaration_at(keys.rdzv_node("b").encode(), kv.value, kv.mod_revision) == ("b", None)
    assert RoundRecords(etcd_client, keys).declaration_at(kv.key, kv.value, kv.mod_revision)[1] is not None
    assert RoundRecords(etcd_client, keys, b"other").declaration_at(kv.key, kv.value, kv.mod_revision)[1] is None
    records.withdraw("a")
    assert etcd_client.get(keys.rdzv_node("a")) is None


def test_claim_and_seal_are_compare_and_swap_and_the_seal_releases_the_claim(etcd_client, run_id):
    keys = JobKeys(run_id)
    records = RoundRecords(etcd_client, keys)
    lease = etcd_client.grant_lease(30)
    assert records.claim_sealing(Claim("a", 1), 0, lease)
    assert not records.claim_sealing(Claim("b", 1), 0, lease)  # taken
    claim = etcd_client.get(keys.rdzv_sealer)
    assert records.claim_from(claim.value) == Claim("a", 1)
    sealed = Round(1, ("a",), ("10.0.0.1",))
    assert not records.seal(sealed, 12345, lease)  # not at that revision
    assert etcd_client.get(keys.rdzv_sealer) is not None
    assert records.seal(sealed, 0, lease)
    assert etcd_client.get(keys.rdzv_sealer) is None
    kv = etcd_client.get(keys.rdzv_round)
    assert records.round_from(kv.value, kv.mod_revision).members == ("a",)
    assert records.restore(Round(2, ("a",)), kv.mod_revision, lease)
    assert not records.restore(Round(3, ("a",)), kv.mod_revision, lease)  # replaced meanwhile
    records.close(lease)
    assert etcd_client.get(keys.rdzv_closed).value == b"1"


def test_the_feeds_watch_the_two_prefixes(etcd_client, run_id):
    keys = JobKeys(run_id)
    records = RoundRecords(etcd_client, keys)
    loaded, applied = {}, threading.Event()
    feed = records.ctl_feed(lambda kvs, revision: loaded.update(ctl=[kv.key for kv in kvs]),
                            lambda response: applied.set())
    nodes = records.nodes_feed(lambda kvs, revision: loaded.update(nodes=len(kvs)), lambda response: None)
    try:
        feed.start()
        nodes.start()
        assert loaded == {"ctl": [], "nodes": 0}
        records.close()
        assert applied.wait(10)
    finally:
        feed.stop()
        nodes.stop()


def test_a_stores_keys_are_bound_to_its_lease_and_swapped_by_revision(etcd_client, run_id):
    lease = RunLease(etcd_client, 30)
    store = StoreRecords(etcd_client, JobKeys(run_id).store(2), lease)
    store.write("k", b"1")
    kv = store.read("k")
    assert kv.value == b"1" and kv.lease == lease.id() and kv.key == JobKeys(run_id).store(2).encode() + b"k"
    assert store.swap("k", b"2", kv.mod_revision)[0]
    ok, current = store.swap("k", b"3", kv.mod_revision)
    assert not ok and current.value == b"2"
    assert store.swap("new", b"x", 0)[0] and store.count() == 2
    assert store.delete("new") and store.read("new") is None and store.count() == 1


def test_torchs_state_key(etcd_client, run_id):
    state = TorchStateRecord(etcd_client, JobKeys(run_id), RunLease(etcd_client, 30))
    assert state.key == JobKeys(run_id).torch_state and state.read() is None
    ok, kv = state.swap(b"s1", 0)
    assert ok and kv.value == b"s1"
    ok, current = state.swap(b"s2", 0)
    assert not ok and current.value == b"s1" and state.read().value == b"s1"
