"""The event history: records, the bounded lease-bound log in a real etcd, `elasticctl events`,
and the events a real job writes when a node is killed, one joins and one leaves.

Every wait is on etcd keys, the trainer's JSON record or a command's output line, never a sleep.

Layer tests/contract: a real etcd, no training processes. The other tests of this subject:
tests/process/test_events.py, tests/unit/test_events_records.py.
"""

from __future__ import annotations

import time

import pytest
from support.helpers import wait_for

from elasticctl.etcd.client import EtcdClient
from elasticctl.job.events import EventLog
from elasticctl.job.keys import JobKeys
from elasticctl.job.records import EventKind


# -- the log in etcd --------------------------------------------------------------------------


def test_the_log_keeps_the_newest_events_in_time_order_bound_to_one_lease(etcd_client, run_id):
    keys = JobKeys(run_id)
    log = EventLog(etcd_client, keys, max_events=5)
    for i in range(8):
        assert log.record(EventKind.NODE_JOINED, f"n{i}", at=1000.0 + i) is not None
    # an event written late with an earlier time sorts where its time puts it
    log.record(EventKind.MEMBER_LOST, "n0", at=1006.5)
    assert [(e.node, e.time) for e in log.read()] == [
        ("n4", 1004.0), ("n5", 1005.0), ("n6", 1006.0), ("n0", 1006.5), ("n7", 1007.0)]
    assert [e.node for e in log.read(since=1006.2)] == ["n0", "n7"]
    kvs = etcd_client.get_prefix(keys.history)
    leases = {kv.lease for kv in kvs}
    assert len(leases) == 1 and 0 not in leases
    assert etcd_client.get(keys.events_lease).value == str(leases.pop()).encode()
    # a second writer (another node) binds to the same lease
    other = EventLog(etcd_client, keys, max_events=5)
    other.record(EventKind.JOB_DOWN, at=1008.0)
    assert len({kv.lease for kv in etcd_client.get_prefix(keys.history)}) == 1


def test_checkpoint_events_never_push_the_membership_history_out(etcd_client, run_id):
    log = EventLog(etcd_client, JobKeys(run_id), max_events=20)  # at most 2 routine events
    log.record(EventKind.ROUND_FORMED, "a", at=1000.0, round=1)
    for step in range(1, 30):
        log.record(EventKind.CHECKPOINT_WRITTEN, "a", at=1000.0 + step, step=step, duration=0.01)
    log.record(EventKind.MEMBER_LOST, "b", at=1100.0, round=1)
    assert [(e.kind, e.step) for e in log.read()] == [
        (EventKind.ROUND_FORMED, None), (EventKind.CHECKPOINT_WRITTEN, 28),
        (EventKind.CHECKPOINT_WRITTEN, 29), (EventKind.MEMBER_LOST, None)]


@pytest.mark.parametrize(("history", "first_step", "expected"), [
    # a fault at 6 after the round of 2; the round of 9; the first step at 12: 6 s
    ([(2, EventKind.ROUND_FORMED), (6, EventKind.WORKERS_FAILED), (9, EventKind.ROUND_FORMED)], 12.0, 6.0),
    ([(2, EventKind.ROUND_FORMED)], 5.0, None),  # the job's first round: a start, not a recovery
    ([], 5.0, None),  # no round in the history (it expired, or etcd lost it)
    # the newest round formed before the step counts, not one formed after it
    ([(2, EventKind.ROUND_FORMED), (3, EventKind.MEMBER_LOST), (4, EventKind.ROUND_FORMED),
      (8, EventKind.NODE_WAITING), (9, EventKind.ROUND_FORMED)], 6.0, 3.0),
])
def test_the_first_step_after_a_round_ends_the_recovery(etcd_client, run_id, history, first_step, expected):
    log = EventLog(etcd_client, JobKeys(run_id))
    for i, (t, kind) in enumerate(history):
        log.record(kind, "a", at=1000.0 + t, round=i)
    recorded = log.record_recovery_finished("a", 1000.0 + first_step, step=7, world_size=2)
    if expected is None:
        assert recorded is None and EventKind.RECOVERY_FINISHED not in {e.kind for e in log.read()}
    else:
        assert recorded.duration == expected and recorded.step == 7 and recorded in log.read()


def test_a_lost_lease_is_replaced_and_etcd_errors_do_not_raise(etcd_client, run_id):
    keys = JobKeys(run_id)
    log = EventLog(etcd_client, keys)
    log.record(EventKind.NODE_JOINED, "a")
    etcd_client.revoke_lease(int(etcd_client.get(keys.events_lease).value))
    assert etcd_client.get_prefix(keys.history) == []
    assert log.record(EventKind.NODE_LEFT, "a") is not None
    assert [e.kind for e in log.read()] == [EventKind.NODE_LEFT]

    unreachable = EtcdClient(etcd_client.settings.__class__.from_string("127.0.0.1:1", retry_timeout=0.5))
    assert EventLog(unreachable, keys).record(EventKind.NODE_LEFT, "a") is None
    unreachable.close()


def test_events_recorded_later_keep_their_order_and_time(etcd_client, run_id):
    log = EventLog(etcd_client, JobKeys(run_id))
    before = time.time()
    for kind in (EventKind.WORKERS_FAILED, EventKind.FAILURE_JUDGED, EventKind.OVER_BUDGET):
        log.record_later(kind, "a", round=1)
    wait_for(lambda: len(log.read()) == 3, 10, "three events")
    events = log.read()
    assert [e.kind for e in events] == [EventKind.WORKERS_FAILED, EventKind.FAILURE_JUDGED, EventKind.OVER_BUDGET]
    assert all(before <= e.time <= time.time() for e in events)
