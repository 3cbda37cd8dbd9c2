"""The etcd3 RendezvousBackend against torch's documented set_state/get_state contract."""

from __future__ import annotations

import threading
import time

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousStateError

from elasticctl.etcd import EtcdClient, EtcdSettings
from elasticctl.etcd_server import free_port
from elasticctl.rendezvous import DEFAULT_KEY_PREFIX, EtcdRendezvousBackend, RunLease


@pytest.fixture
def backend(etcd_client, run_id):
    return EtcdRendezvousBackend(etcd_client, run_id)


def test_get_state_of_a_new_run_is_none(backend):
    assert backend.get_state() is None


def test_token_none_creates_only_if_absent(backend):
    state, token, ok = backend.set_state(b"first")
    assert (state, ok) == (b"first", True)
    assert backend.get_state() == (b"first", token)

    state, token2, ok = backend.set_state(b"second")
    assert (state, token2, ok) == (b"first", token, False)
    assert backend.get_state() == (b"first", token)


def test_matching_token_updates_and_yields_a_new_token(backend):
    _, token, _ = backend.set_state(b"v1")
    state, new_token, ok = backend.set_state(b"v2", token)
    assert (state, ok) == (b"v2", True)
    assert new_token != token
    assert backend.get_state() == (b"v2", new_token)


def test_stale_token_returns_current_state_unchanged(backend):
    _, token1, _ = backend.set_state(b"v1")
    _, token2, _ = backend.set_state(b"v2", token1)
    assert backend.set_state(b"v3", token1) == (b"v2", token2, False)
    assert backend.get_state() == (b"v2", token2)


@pytest.mark.parametrize("foreign", ["not-a-token", -1, 0, 10**12])
def test_foreign_token_returns_current_state(backend, foreign):
    _, token, _ = backend.set_state(b"v1")
    assert backend.set_state(b"evil", foreign) == (b"v1", token, False)


def test_token_for_a_missing_state_returns_none(backend):
    assert backend.set_state(b"v1", 12345) is None
    assert backend.get_state() is None


def test_corrupt_state_raises_state_error(backend, etcd_client):
    etcd_client.put(backend.key, b"\x80garbage that is not ours")
    with pytest.raises(RendezvousStateError, match="corrupt"):
        backend.get_state()
    with pytest.raises(RendezvousStateError):
        backend.set_state(b"v2", 1)


def test_tampered_payload_fails_the_checksum(backend, etcd_client):
    backend.set_state(b"honest state")
    raw = etcd_client.get(backend.key).value
    etcd_client.put(backend.key, raw.replace(b"honest", b"wicked"))
    with pytest.raises(RendezvousStateError, match="integrity"):
        backend.get_state()


def test_secret_signs_and_refuses_unsigned_or_foreign_state(etcd_client, run_id):
    signed = EtcdRendezvousBackend(etcd_client, run_id, secret=b"s3cret")
    _, token, _ = signed.set_state(b"payload")
    assert signed.get_state() == (b"payload", token)

    with pytest.raises(RendezvousStateError, match="no secret"):
        EtcdRendezvousBackend(etcd_client, run_id).get_state()
    with pytest.raises(RendezvousStateError, match="integrity"):
        EtcdRendezvousBackend(etcd_client, run_id, secret=b"other").get_state()

    # An attacker without the secret writes unsigned state: refused.
    unsigned_run = run_id + "-unsigned"
    EtcdRendezvousBackend(etcd_client, unsigned_run).set_state(b"pickle bomb")
    with pytest.raises(RendezvousStateError, match="not signed"):
        EtcdRendezvousBackend(etcd_client, unsigned_run, secret=b"s3cret").get_state()


def test_runs_are_isolated(etcd_client, run_id):
    a = EtcdRendezvousBackend(etcd_client, run_id + "-a")
    b = EtcdRendezvousBackend(etcd_client, run_id + "-b")
    a.set_state(b"a")
    assert b.get_state() is None
    assert a.key.startswith(DEFAULT_KEY_PREFIX + "/" + run_id)


def test_unreachable_etcd_raises_connection_error_naming_the_endpoint(run_id):
    port = free_port()
    client = EtcdClient(EtcdSettings.from_string(f"127.0.0.1:{port}", retry_timeout=0.5, read_timeout=0.5))
    backend = EtcdRendezvousBackend(client, run_id)
    with pytest.raises(RendezvousConnectionError, match=f"127.0.0.1:{port}"):
        backend.get_state()
    with pytest.raises(RendezvousConnectionError, match=f"127.0.0.1:{port}"):
        backend.set_state(b"x")


def test_abandoned_run_keys_expire(etcd_client, run_id):
    backend = EtcdRendezvousBackend(etcd_client, run_id, lease=RunLease(etcd_client, ttl=2))
    backend.set_state(b"short-lived")
    deadline = time.monotonic() + 15
    while backend.get_state() is not None:
        assert time.monotonic() < deadline, "the state key outlived its lease"
        time.sleep(0.2)


def test_concurrent_compare_and_swap_loses_no_update(etcd_client, run_id):
    backend = EtcdRendezvousBackend(etcd_client, run_id)
    backend.set_state(b"0")
    threads, increments = 8, 15
    wins = []

    def increment() -> None:
        for _ in range(increments):
            state, token = backend.get_state()
            while True:
                state, token, ok = backend.set_state(str(int(state) + 1).encode(), token)
                if ok:
                    wins.append(int(state))
                    break

    workers = [threading.Thread(target=increment) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert backend.get_state()[0] == str(threads * increments).encode()
    assert sorted(wins) == list(range(1, threads * increments + 1))
