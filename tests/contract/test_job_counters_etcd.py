"""A job's counters in a real etcd: each recorded event adds to its node's shard by
compare-and-swap, so writers racing on one shard lose no count; the history's bound forgets
events, never counts; the shards share the history's lease and outlive `down` with it.

Layer tests/contract: a real etcd, no training processes. The pure rules: tests/unit/test_job_counters.py.
"""

from __future__ import annotations

import threading

from elasticctl.job.counters import JobCounters
from elasticctl.job.events import EventLog, read_counters
from elasticctl.job.keys import JobKeys
from elasticctl.job.records import EventKind
from elasticctl.job.registry import Registry


def test_writers_racing_on_one_shard_lose_no_count(etcd_client, run_id):
    keys = JobKeys(run_id)
    writers, each = 6, 15
    start = threading.Barrier(writers)

    def write() -> None:
        log = EventLog(etcd_client, keys)  # a writer of its own, as each node's process has
        start.wait()
        for _ in range(each):
            assert log.record(EventKind.MEMBER_LOST, "c") is not None

    threads = [threading.Thread(target=write) for _ in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    counters = read_counters(etcd_client, keys)
    assert counters.count(EventKind.MEMBER_LOST) == writers * each
    assert [kv.key.decode() for kv in etcd_client.get_prefix(keys.counters)] == [keys.counter_shard("c")]


def test_the_history_forgets_events_but_the_counters_keep_them(etcd_client, run_id):
    keys = JobKeys(run_id)
    log = EventLog(etcd_client, keys, max_events=5)
    for i in range(12):
        log.record(EventKind.FAILURE_JUDGED, f"n{i % 3}", at=1000.0 + i, charged=True)
        log.record(EventKind.RECOVERY_FINISHED, f"n{i % 3}", at=1000.5 + i, duration=float(i))
    assert len(log.read()) == 5
    counters = read_counters(etcd_client, keys)
    assert counters.restarts_spent == 12 and counters.recoveries == 12
    assert counters.recovery_seconds == sum(range(12))
    assert dict(counters.histogram())[10.0] == 11  # 0 .. 10 s
    assert sorted(kv.key.decode() for kv in etcd_client.get_prefix(keys.counters)) == [
        keys.counter_shard(f"n{i}") for i in range(3)]


def test_the_shards_share_the_history_lease_and_outlive_down(etcd_client, run_id):
    keys = JobKeys(run_id)
    log = EventLog(etcd_client, keys)
    log.record(EventKind.MEMBER_LOST, "a")
    log.record(EventKind.JOB_DOWN)
    history_lease = int(etcd_client.get(keys.events_lease).value)
    assert {kv.lease for kv in etcd_client.get_prefix(keys.counters)} == {history_lease}
    Registry(etcd_client, run_id).delete_job()  # what `down` deletes
    counters = read_counters(etcd_client, keys)
    assert counters.count(EventKind.MEMBER_LOST) == counters.count(EventKind.JOB_DOWN) == 1
    assert etcd_client.get(keys.counter_shard("_")) is not None, "the job's own events: shard _"


def test_a_planted_shard_is_counted_on_from_zero_not_a_crash(etcd_client, run_id):
    keys = JobKeys(run_id)
    etcd_client.put(keys.counter_shard("a"), b"\xff planted")
    log = EventLog(etcd_client, keys)
    assert log.record(EventKind.MEMBER_LOST, "a") is not None
    assert read_counters(etcd_client, keys) == JobCounters().add(log.read()[0])
