"""The etcd3 RendezvousBackend against torch's documented set_state/get_state contract.

Layer tests/contract: a real etcd, no training processes. The other tests of this subject:
tests/unit/test_backend_unreachable.py.
"""

from __future__ import annotations

import threading

import pytest
from support.helpers import wait_for
from support.rendezvous import torch_state
from torch.distributed.elastic.rendezvous import RendezvousStateError

from elasticctl.rendezvous.state import seal_state
from elasticctl.rendezvous.backend import DEFAULT_KEY_PREFIX, EtcdRendezvousBackend, RunLease


S0, S1, S2, S3 = (torch_state(n) for n in range(4))


@pytest.fixture
def backend(etcd_client, run_id):
    return EtcdRendezvousBackend(etcd_client, run_id)


def test_get_state_of_a_new_run_is_none(backend):
    assert backend.get_state() is None


def test_token_none_creates_only_if_absent(backend):
    state, token, ok = backend.set_state(S0)
    assert (state, ok) == (S0, True)
    assert backend.get_state() == (S0, token)

    state, token2, ok = backend.set_state(S1)
    assert (state, token2, ok) == (S0, token, False)
    assert backend.get_state() == (S0, token)


def test_matching_token_updates_and_yields_a_new_token(backend):
    _, token, _ = backend.set_state(S1)
    state, new_token, ok = backend.set_state(S2, token)
    assert (state, ok) == (S2, True)
    assert new_token != token
    assert backend.get_state() == (S2, new_token)


def test_stale_token_returns_current_state_unchanged(backend):
    _, token1, _ = backend.set_state(S1)
    _, token2, _ = backend.set_state(S2, token1)
    assert backend.set_state(S3, token1) == (S2, token2, False)
    assert backend.get_state() == (S2, token2)


@pytest.mark.parametrize("foreign", ["not-a-token", -1, 0, 10**12])
def test_foreign_token_returns_current_state(backend, foreign):
    _, token, _ = backend.set_state(S1)
    assert backend.set_state(S3, foreign) == (S1, token, False)


def test_token_for_a_missing_state_returns_none(backend):
    assert backend.set_state(S1, 12345) is None
    assert backend.get_state() is None


def test_corrupt_state_raises_state_error(backend, etcd_client):
    etcd_client.put(backend.key, b"\x80garbage that is not ours")
    with pytest.raises(RendezvousStateError, match="not written by"):
        backend.get_state()
    with pytest.raises(RendezvousStateError):
        backend.set_state(S2, 1)


def test_tampered_payload_fails_the_checksum(backend, etcd_client):
    backend.set_state(S1)
    raw = etcd_client.get(backend.key).value
    etcd_client.put(backend.key, raw[:-1] + bytes([raw[-1] ^ 1]))
    with pytest.raises(RendezvousStateError, match="integrity"):
        EtcdRendezvousBackend(etcd_client, backend.key.split("/")[-2]).get_state()


def test_secret_signs_and_refuses_unsigned_or_foreign_state(etcd_client, run_id):
    signed = EtcdRendezvousBackend(etcd_client, run_id, secret=b"s3cret")
    _, token, _ = signed.set_state(S1)
    assert signed.get_state() == (S1, token)

    with pytest.raises(RendezvousStateError, match="no job secret"):
        EtcdRendezvousBackend(etcd_client, run_id).get_state()
    with pytest.raises(RendezvousStateError, match="integrity"):
        EtcdRendezvousBackend(etcd_client, run_id, secret=b"other").get_state()

    # An attacker without the secret writes unsigned state: refused.
    unsigned_run = run_id + "-unsigned"
    EtcdRendezvousBackend(etcd_client, unsigned_run).set_state(S1)
    with pytest.raises(RendezvousStateError, match="not signed"):
        EtcdRendezvousBackend(etcd_client, unsigned_run, secret=b"s3cret").get_state()


class _WritesAFile:
    """Unpickling this creates ``path``: the proof that planted bytes ran."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _pickle_bombs(marker) -> list[bytes]:
    import pickle

    bomb = _WritesAFile(marker)
    # Alone, inside a real state's fields, and hidden in a heartbeat time.
    state = pickle.loads(S1)
    state.participants = {"node": bomb}
    return [pickle.dumps(bomb), pickle.dumps(state), pickle.dumps({"round": 1, "x": bomb})]


@pytest.mark.parametrize("secret", [None, b"s3cret"], ids=["no-secret", "signed-by-a-secret-holder"])
def test_planted_pickle_never_runs(etcd_client, run_id, tmp_path, secret):
    # A pickle with a valid checksum (or even a valid signature) used to run code.
    marker = tmp_path / "pwned"
    for seq, bomb in enumerate(_pickle_bombs(marker), start=1):
        fresh = EtcdRendezvousBackend(etcd_client, run_id, secret=secret)
        etcd_client.put(fresh.key, seal_state(bomb, 10**6 + seq, secret))
        with pytest.raises(RendezvousStateError, match=f"'{fresh.key}' was refused"):
            fresh.get_state()
        with pytest.raises(RendezvousStateError, match="was refused"):
            fresh.set_state(S1, 1)
    assert not marker.exists()


def test_a_node_that_saw_a_good_state_keeps_it_over_a_planted_one(backend, etcd_client, tmp_path):
    marker = tmp_path / "pwned"
    backend.set_state(S1)
    etcd_client.put(backend.key, seal_state(_pickle_bombs(marker)[0], 10**6, None))
    state, token = backend.get_state()
    assert state == S1 and not marker.exists()
    # torch's next write (its heartbeat) puts the good state back over the planted one.
    assert backend.set_state(S2, token)[2] is True
    assert EtcdRendezvousBackend(etcd_client, backend.key.split("/")[-2]).get_state()[0] == S2


@pytest.mark.parametrize("secret", [None, b"s3cret"], ids=["no-secret", "secret"])
def test_a_replayed_older_state_is_never_handed_to_torch(etcd_client, run_id, secret):
    # Writing back an old state used to make a node drop out of its round.
    backend = EtcdRendezvousBackend(etcd_client, run_id, secret=secret)
    _, token, _ = backend.set_state(S1)
    old = etcd_client.get(backend.key).value
    _, token, _ = backend.set_state(S2, token)
    etcd_client.put(backend.key, old)
    state, token = backend.get_state()
    assert state == S2, "the node took the replayed state"
    state, token, ok = backend.set_state(S3, token)
    assert ok and state == S3
    assert backend.get_state()[0] == S3


def test_a_deleted_state_is_written_back_by_a_node_that_saw_it(backend, etcd_client):
    backend.set_state(S1)
    etcd_client.delete(backend.key)
    state, token = backend.get_state()
    assert state == S1 and token is None
    assert backend.set_state(S2, token)[2] is True


@pytest.mark.parametrize("run", ["jv/x", "jv/nodes", "../jv", "abc\n", "", "a b"])
def test_run_ids_follow_the_job_name_rule(etcd_client, run):
    # --rdzv-id=jv/x used to land inside job jv's keys.
    with pytest.raises(ValueError, match="run id"):
        EtcdRendezvousBackend(etcd_client, run)


def test_runs_are_isolated(etcd_client, run_id):
    a = EtcdRendezvousBackend(etcd_client, run_id + "-a")
    b = EtcdRendezvousBackend(etcd_client, run_id + "-b")
    a.set_state(S0)
    assert b.get_state() is None
    assert a.key.startswith(DEFAULT_KEY_PREFIX + "/" + run_id)


def test_abandoned_run_keys_expire(etcd_client, run_id):
    backend = EtcdRendezvousBackend(etcd_client, run_id, lease=RunLease(etcd_client, ttl=2))
    backend.set_state(S1)
    wait_for(lambda: etcd_client.get(backend.key) is None, 15, "the state key to expire with its lease")


def test_concurrent_compare_and_swap_loses_no_update(etcd_client, run_id):
    import pickle

    backend = EtcdRendezvousBackend(etcd_client, run_id)
    backend.set_state(torch_state(0))
    threads, increments = 8, 15
    wins = []

    def increment() -> None:
        for _ in range(increments):
            state, token = backend.get_state()
            while True:
                state, token, ok = backend.set_state(torch_state(pickle.loads(state).round + 1), token)
                if ok:
                    wins.append(pickle.loads(state).round)
                    break

    workers = [threading.Thread(target=increment) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert pickle.loads(backend.get_state()[0]).round == threads * increments
    assert sorted(wins) == list(range(1, threads * increments + 1))
