"""Attacks on a running job's rendezvous state in etcd: planted pickles and replays (issue 10, items 1-2).

Real torchrun agents and CPU/gloo workers on loopback; the attacker writes etcd keys directly.
"""

from __future__ import annotations

import pickle
import time

import pytest
from helpers import read_records, torchrun_command, wait_for

from elasticctl.etcd import EtcdClient
from elasticctl.rdzv_options import DEFAULT_KEY_PREFIX
from elasticctl.rdzv_state import seal_state

pytestmark = pytest.mark.slow

TRAIN = ["--steps", "100000", "--step-sleep", "0.05", "--log-every", "0"]


class _WritesAFile:
    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _steps(records: list[dict], since: float, world: int | None = None) -> list[dict]:
    return [r for r in records if "event" not in r and r["time"] > since
            and (world is None or r["world_size"] == world)]


def _two_node_job(nodes, etcd, run_id, record):
    args = [*TRAIN, "--record", str(record)]
    started = [nodes(name, torchrun_command(etcd.endpoint, run_id, "1:2", args)) for name in ("a", "b")]
    wait_for(lambda: {r["group_rank"] for r in _steps(read_records(record), 0, world=2)} == {0, 1}, 180,
             "both nodes training at world size 2")
    return started


def _both_train_at_world_2(record, since: float, steps: int = 20):
    def enough():
        recent = _steps(read_records(record), since, world=2)
        return all(len([r for r in recent if r["group_rank"] == g]) >= steps for g in (0, 1))

    wait_for(enough, 120, f"both nodes training {steps} more steps at world size 2")


def test_a_pickle_planted_in_a_running_job_never_runs(default_etcd, run_id, nodes, tmp_path):
    record, marker = tmp_path / "record.jsonl", tmp_path / "pwned"
    a, b = _two_node_job(nodes, default_etcd, run_id, record)
    key = f"{DEFAULT_KEY_PREFIX}/{run_id}/rdzv"
    with EtcdClient(default_etcd.client_settings()) as client:
        planted = seal_state(pickle.dumps(_WritesAFile(marker)), 10**9, None)  # a valid checksum
        client.put(key, planted)
        planted_at = time.time()
        wait_for(lambda: client.get(key).value != planted, 30, "a node writing the good state back")
    _both_train_at_world_2(record, planted_at)
    assert not marker.exists(), "the planted pickle ran"
    assert a.process.poll() is None and b.process.poll() is None
    assert "Refusing the rendezvous state" in a.log() + b.log()


def test_a_replayed_old_state_splits_nothing(default_etcd, run_id, nodes, tmp_path):
    record = tmp_path / "record.jsonl"
    a, b = _two_node_job(nodes, default_etcd, run_id, record)
    key = f"{DEFAULT_KEY_PREFIX}/{run_id}/rdzv"
    with EtcdClient(default_etcd.client_settings()) as client:
        old = client.get(key)
        captured_at = time.time()
        # Older than keep_alive_interval x keep_alive_max_attempt (1 s x 3): in it, both nodes'
        # heartbeats look dead, which is what made a node drop itself from its round.
        wait_for(lambda: time.time() - captured_at > 6 and client.get(key).mod_revision > old.mod_revision,
                 30, "the state to move on while the old one ages")
        client.put(key, old.value)
        replayed_at = time.time()
        wait_for(lambda: client.get(key).value != old.value, 30, "a node writing the newer state back")
    _both_train_at_world_2(record, replayed_at)
    alone = _steps(read_records(record), replayed_at, world=1)
    assert not alone, f"a node trained alone after the replay (split brain): {alone[:3]}"
    assert a.process.poll() is None and b.process.poll() is None
    assert "replayed or rolled back" in a.log() + b.log()
