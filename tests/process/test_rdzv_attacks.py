"""Attacks on a running job's rendezvous records in etcd: planted pickles and replays.

Real torchrun agents and CPU/gloo workers on loopback; the attacker writes etcd keys directly.
The records are JSON and never unpickled; a round record that is unreadable or older than
one a node has seen is ignored, and the next seal overwrites it.
"""

from __future__ import annotations

import pickle
import time

import pytest
from support.helpers import read_records, torchrun_command, wait_for

from elasticctl.etcd.client import EtcdClient
from elasticctl.job.settings import DEFAULT_KEY_PREFIX

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


def test_pickles_planted_in_a_running_job_never_run(default_etcd, run_id, nodes, tmp_path):
    record, marker = tmp_path / "record.jsonl", tmp_path / "pwned"
    a, b = _two_node_job(nodes, default_etcd, run_id, record)
    prefix = f"{DEFAULT_KEY_PREFIX}/{run_id}"
    bomb = pickle.dumps(_WritesAFile(marker))
    with EtcdClient(default_etcd.client_settings()) as client:
        for key in ("rdzv/ctl/round", "rdzv/ctl/sealer", "rdzv/nodes/x", "members/x", "progress",
                    "rdzv/ctl/closed-not", "store/1/x"):
            client.put(f"{prefix}/{key}", bomb)
        planted_at = time.time()
    _both_train_at_world_2(record, planted_at)
    assert not marker.exists(), "a planted pickle ran"
    assert not _steps(read_records(record), planted_at, world=1)
    assert a.process.poll() is None and b.process.poll() is None
    assert "Ignoring the round record" in a.log() + b.log()


def test_a_replayed_old_round_splits_nothing(default_etcd, run_id, nodes, tmp_path):
    record = tmp_path / "record.jsonl"
    key = f"{DEFAULT_KEY_PREFIX}/{run_id}/rdzv/ctl/round"
    args = [*TRAIN, "--record", str(record)]
    a = nodes("a", torchrun_command(default_etcd.endpoint, run_id, "1:2", args))
    with EtcdClient(default_etcd.client_settings()) as client:
        # round 1 with a alone, then round 2 with both: the old record is a world of 1
        wait_for(lambda: _steps(read_records(record), 0, world=1), 180, "a training alone")
        old = client.get(key)
        b = nodes("b", torchrun_command(default_etcd.endpoint, run_id, "1:2", args))
        wait_for(lambda: {r["group_rank"] for r in _steps(read_records(record), 0, world=2)} == {0, 1}, 180,
                 "both nodes training at world size 2")
        client.put(key, old.value)
        replayed_at = time.time()
    _both_train_at_world_2(record, replayed_at)
    alone = _steps(read_records(record), replayed_at, world=1)
    assert not alone, f"a node trained alone after the replay (split brain): {alone[:3]}"
    assert a.process.poll() is None and b.process.poll() is None
    assert "is older than round" in a.log() + b.log()
