"""The job layer's records in a real etcd (elasticctl/job/registry.py): what the handler, the
dashboard, `status`, `doctor` and `events` read and write through it.

Layer tests/contract: a real etcd, no processes. Key parsing: tests/unit/test_job_keys.py.
"""

from __future__ import annotations

import threading

from elasticctl.job.events import EventLog, event_records, follow_events
from elasticctl.job.records import EventKind, MemberState, json_object
from elasticctl.job.registry import JobView, Registry, job_has_keys, request_for
from elasticctl.job.snapshot import Part
from elasticctl.job.spec import JobSpec


def _lease(client, ttl: int = 30) -> int:
    return client.grant_lease(ttl)


def test_failures_of_a_round_are_the_nodes_in_the_order_they_recorded_them(etcd_client, run_id):
    registry = Registry(etcd_client, run_id)
    lease = _lease(etcd_client)
    for node in ("b", "a", "c"):
        registry.record_failure(4, node, lease)
    registry.record_failure(5, "z", lease)
    assert registry.failures_of_round(4) == ["b", "a", "c"]
    assert registry.failures_of_round(5) == ["z"]
    assert registry.failures_of_round(6) == []
    assert etcd_client.get(registry.keys.failure(4, "a")).lease == lease


def test_finished_and_the_store_of_a_round(etcd_client, run_id):
    registry = Registry(etcd_client, run_id)
    lease = _lease(etcd_client)
    registry.record_finished("n1", lease)
    finished = etcd_client.get(registry.keys.finished)
    assert json_object(finished.value)["node"] == "n1" and finished.lease == lease
    etcd_client.put(registry.keys.store(3) + "a", "1")
    etcd_client.put(registry.keys.store(3) + "b", "2")
    etcd_client.put(registry.keys.store(4) + "a", "3")
    assert registry.delete_round_store(3) == 2
    assert [kv.key for kv in etcd_client.get_prefix(registry.keys.store())] == [
        (registry.keys.store(4) + "a").encode()]


def test_a_member_record_and_the_checkpoint_marker(etcd_client, run_id):
    registry = Registry(etcd_client, run_id)
    lease = _lease(etcd_client)
    registry.write_member("n1", {"node": "n1", "state": MemberState.TRAINING, "round": 2}, lease)
    assert registry.members() == {"n1": {"node": "n1", "state": "training", "round": 2}}
    assert etcd_client.get(registry.keys.member("n1")).lease == lease
    assert registry.checkpoint_marker() is None
    assert registry.claim_checkpoint_marker("tok") == (True, "tok")
    assert registry.checkpoint_marker() == "tok"


def test_one_snapshot_reads_what_status_and_the_dashboard_each_ask_for(etcd_client, run_id):
    registry = Registry(etcd_client, run_id)
    spec = JobSpec(name=run_id, script="train.py")
    registry.publish_spec(spec)
    lease = _lease(etcd_client)
    registry.register_node({"host": "h", "pid": 7}, lease, wanted_id="n1")
    etcd_client.put(registry.keys.node("planted"), "{}")  # no lease: not a live node's
    registry.write_member("n1", {"state": MemberState.TRAINING, "round": 1}, lease)
    etcd_client.put(registry.keys.progress, '{"step": 5}')
    registry.request_down()
    EventLog(etcd_client, registry.keys).record(EventKind.NODE_JOINED, "n1", at=1000.0)

    requests = []
    status = registry.snapshot(Part.STATUS, lambda request, call: requests.append(request) or call())
    assert status.spec == spec and status.down_requested and status.generation is None
    assert set(status.nodes) == {"n1", "planted"} and status.node_leases == {"n1": lease, "planted": 0}
    assert status.heartbeats == {} and status.events == [] and status.samples == []
    assert set(requests) == {"range"}
    view = JobView.of(status)
    assert view == registry.view()
    assert view.nodes["n1"]["pid"] == 7 and view.progress == {"step": 5} and view.round == 1

    dashboard = registry.snapshot(Part.DASHBOARD)
    assert dashboard.spec is None and not dashboard.down_requested
    assert set(dashboard.heartbeats) == {"n1"} and dashboard.heartbeats["n1"] >= 0
    assert len(dashboard.events) == 1 and dashboard.members == status.members
    assert [raw for _, raw in event_records(etcd_client, registry.keys)] == dashboard.events


def test_requests_are_followed_and_a_job_has_keys_while_it_has_any(etcd_client, run_id):
    registry = Registry(etcd_client, run_id)
    assert not job_has_keys(etcd_client, registry.keys)
    seen = []
    asked = threading.Event()

    def on_controls(controls):
        seen.append(request_for(controls, "n1"))
        if seen[-1]:
            asked.set()

    watch = registry.watch_requests(on_controls)
    try:
        assert seen == [None]  # what was there when it started
        registry.request_leave("n1")
        assert asked.wait(10) and seen[-1] == "leave"
    finally:
        watch.stop()
    assert job_has_keys(etcd_client, registry.keys)


def test_following_the_history_shows_what_is_there_then_what_is_written(etcd_client, run_id):
    keys = Registry(etcd_client, run_id).keys
    log = EventLog(etcd_client, keys)
    log.record(EventKind.NODE_JOINED, "a", at=1000.0)
    shown, more = [], threading.Event()

    def show(pairs):
        shown.extend(pairs)
        if len(shown) >= 2:
            more.set()

    watch = follow_events(etcd_client, keys, show).start()
    try:
        assert len(shown) == 1
        log.record(EventKind.NODE_JOINED, "b", at=1001.0)
        assert more.wait(10)
    finally:
        watch.stop()
    assert [key for key, _ in shown] == [key for key, _ in event_records(etcd_client, keys)]
