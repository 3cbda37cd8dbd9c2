"""EtcdStore: the c10d Store operations torch's agents use, on a real etcd."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist

from elasticctl.rendezvous.backend import EtcdStore


@pytest.fixture
def store(etcd_client, run_id):
    return EtcdStore(etcd_client, f"/elasticctl/jobs/{run_id}/store", timeout=datetime.timedelta(seconds=5))


def test_set_get_roundtrip_str_and_bytes(store):
    store.set("a", "text")
    store.set("b", b"\x00\xffbinary")
    assert store.get("a") == b"text"
    assert store.get("b") == b"\x00\xffbinary"


def test_get_waits_for_a_key_set_later(store):
    seen = []
    reader = threading.Thread(target=lambda: seen.append(store.get("late")))
    reader.start()
    store.set("late", "here")
    reader.join(10)
    assert seen == [b"here"]


def test_get_of_a_missing_key_times_out(store):
    store.set_timeout(datetime.timedelta(milliseconds=300))
    with pytest.raises(dist.DistStoreError, match="missing"):
        store.get("missing")


def test_add_under_contention_returns_every_value_once(store):
    results, threads, each = [], 8, 10
    lock = threading.Lock()

    def adder():
        for _ in range(each):
            value = store.add("counter", 1)
            with lock:
                results.append(value)

    workers = [threading.Thread(target=adder) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert sorted(results) == list(range(1, threads * each + 1))
    assert store.add("counter", 0) == threads * each
    assert store.add("fresh", -3) == -3


def test_compare_set_follows_tcpstore_semantics(store):
    assert store.compare_set("k", "", "first") == b"first"  # absent + empty expectation: set
    assert store.compare_set("k", "wrong", "second") == b"first"  # mismatch: current value
    assert store.compare_set("k", "first", "second") == b"second"  # match: swapped
    assert store.compare_set("absent", "x", "y") == b"x"  # absent + expectation: expectation back
    assert not store.check(["absent"])


def test_wait_check_delete_and_count(store):
    store.set("x", "1")
    store.set("y", "2")
    store.wait(["x", "y"])
    assert store.check(["x", "y"])
    assert not store.check(["x", "nope"])
    with pytest.raises(dist.DistStoreError):
        store.wait(["nope"], datetime.timedelta(milliseconds=200))
    assert store.num_keys() == 2
    assert store.delete_key("x") is True
    assert store.delete_key("x") is False
    assert store.num_keys() == 1


def test_through_prefix_store_as_torch_uses_it(store):
    prefixed = dist.PrefixStore("torch.rendezvous.job.3", store)
    prefixed.multi_set(["r0", "r1"], ["a", b"b"])
    assert prefixed.multi_get(["r0", "r1"]) == [b"a", b"b"]
    assert prefixed.add("n", 2) == 2
    assert prefixed.num_keys() == 3
    assert prefixed.delete_key("r0")
    assert store.get("torch.rendezvous.job.3/r1") == b"b"
