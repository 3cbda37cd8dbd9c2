"""`elasticctl dashboard`: the pure model (table-driven, planted records mixed in), the server's
JSON and /metrics against a real etcd, and its one-sentence errors. The live page in a real
browser during a real job: tests/test_dashboard_browser.py."""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.error
import urllib.request

import pytest
from support.dashboard import MEMBER, NODE, NOW, Dashboard, sample
from support.helpers import cli, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from elasticctl.dashboard.model import Reading, histogram, job_metrics, job_view, samples_series
from elasticctl.etcd.client import EtcdClient
from elasticctl.job.events import EventLog
from elasticctl.job.keys import JobKeys
from elasticctl.job.records import Event, EventKind, ProgressSample


def ev(t: float, kind: EventKind, node: str = "a", **fields) -> bytes:
    return Event(time=NOW - t, kind=kind, node=node, **fields).to_json().encode()


GARBAGE = [b"", b"\xff\xfe", b"[]", b"null", b'{"time": "soon"}', b"[" * 50_000, b'{"kind": 5}']


# -- the pure model --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reading", "expected"),
    [
        pytest.param(
            Reading("j", NOW),
            {
                "round": None,
                "world_size": 0,
                "live_nodes": 0,
                "nodes": [],
                "progress": None,
                "events": [],
                "totals": {"recoveries": 0, "recovery_seconds": 0, "restarts_spent": 0},
            },
            id="nothing-in-etcd",
        ),
        pytest.param(
            Reading("j", NOW, nodes={"a": NODE}, members={"a": MEMBER}, heartbeats={"a": 1.25}),
            {
                "round": 3,
                "world_size": 1,
                "live_nodes": 1,
                "nodes": [
                    {
                        "id": "a",
                        "host": "h1",
                        "addr": "10.0.0.1",
                        "state": "training",
                        "rank": 0,
                        "round": 3,
                        "gpus": 2,
                        "restarts": 1,
                        "heartbeat_age": 1.2,
                    }
                ],
            },
            id="a-training-node",
        ),
        pytest.param(
            Reading(
                "j",
                NOW,
                nodes={
                    "a": NODE,
                    "b/c": NODE,
                    "": NODE,
                    "bad": b"\xff",
                    "x": b"[]",
                    "h": b'{"host": 5, "gpus": "two", "state": "leaving"}',
                },
                members={"a": b'{"state": "training", "round": "3", "rank": -1.5}'},
            ),
            {
                "round": None,
                "world_size": 0,
                # "h" names no id or host of its own: not a node's record (issue 23, item 11)
                "live_nodes": 1,
                "nodes": [
                    {
                        "id": "a",
                        "host": "h1",
                        "addr": "10.0.0.1",
                        "state": "training",
                        "rank": None,
                        "round": None,
                        "gpus": 2,
                        "restarts": 0,
                        "heartbeat_age": None,
                    },
                ],
            },
            id="planted-node-records-and-ids-are-skipped",
        ),
        pytest.param(
            Reading(
                "j",
                NOW,
                events=[
                    ev(30, EventKind.ROUND_FORMED, world_size=3, round=1),
                    *GARBAGE,
                    ev(20, EventKind.MEMBER_LOST, "c", round=1),
                    ev(15, EventKind.FAILURE_JUDGED, "b", charged=True, reason="own"),
                    ev(15, EventKind.FAILURE_JUDGED, "a", charged=False),
                    # the rendezvous part of the recovery: already inside recovery_finished's
                    ev(10, EventKind.ROUND_FORMED, world_size=2, round=2, duration=3.0),
                    ev(10, EventKind.RECOVERY_FINISHED, duration=4.5, round=2, step=40),
                    ev(5, EventKind.RECOVERY_FINISHED, duration=1.25, round=3),
                ],
            ),
            {
                "world": {"time": [NOW - 30, NOW - 10], "world_size": [3, 2]},
                "totals": {"recoveries": 2, "recovery_seconds": 5.75, "restarts_spent": 1},
                # newest first; of two at the same time, the one written later first
                "event_kinds": [
                    "recovery_finished",
                    "recovery_finished",
                    "round_formed",
                    "failure_judged",
                    "failure_judged",
                    "member_lost",
                    "round_formed",
                ],
            },
            id="events-newest-first-with-garbage-mixed-in",
        ),
        pytest.param(
            Reading(
                "j",
                NOW,
                events=[
                    ev(30, EventKind.CHECKPOINT_WRITTEN, step=20, duration=0.5),
                    ev(12.5, EventKind.CHECKPOINT_WRITTEN, step=40, duration=0.25),
                    b'{"time": 1700000099.5, "kind": "checkpoint_written", "duration": -1}',
                    ev(1, EventKind.ROUND_FORMED, world_size=2, round=2),
                ],
            ),
            {
                "checkpoint": {"step": 40, "age": 12.5, "duration": 0.25},
                "totals": {"recoveries": 0, "recovery_seconds": 0, "restarts_spent": 0},
                "event_kinds": ["round_formed", "checkpoint_written", "checkpoint_written"],
            },
            id="the-newest-checkpoint-and-its-age",
        ),
        pytest.param(
            Reading(
                "j",
                NOW,
                events=[ev(3, EventKind.CHECKPOINT_WRITTEN, step=2**60)],
                progress=b'{"last_checkpoint_step": 40, "time": 1700000000}',
            ),
            {"checkpoint": {"step": None, "age": 3.0, "duration": None}},
            id="a-checkpoint-step-too-large-for-the-browser",
        ),
        pytest.param(
            Reading("j", NOW, progress=b'{"last_checkpoint_step": 40, "time": 1700000000}'),
            {"checkpoint": None},
            id="no-checkpoint-event",
        ),
        pytest.param(
            Reading("j", NOW, progress=b'{"step": 7, "loss": "x", "time": 1699999990, "rank": 0}'),
            {"progress": {"step": 7, "time": 1699999990, "rank": 0}, "progress_age": 110.0},
            id="progress-with-a-malformed-field",
        ),
        pytest.param(
            Reading("j", NOW, progress=b"\x00not json"),
            {"progress": None, "progress_age": None},
            id="progress-unreadable",
        ),
    ],
)
def test_job_view(reading, expected):
    view, expected = job_view(reading), dict(expected)
    json.dumps(view)  # the page's JSON: serialisable, whatever etcd held
    if "event_kinds" in expected:
        assert [e["kind"] for e in view["events"]] == expected.pop("event_kinds")
    for key, value in expected.items():
        assert view[key] == value, key


def test_every_event_is_listed_generically_with_its_details():
    view = job_view(
        Reading(
            "j",
            NOW,
            events=[
                ev(1, EventKind.FAILURE_JUDGED, "b", charged=True, reason="own\nfailure", round=4)
            ],
        )
    )
    assert view["events"] == [
        {
            "time": NOW - 1,
            "kind": "failure_judged",
            "node": "b",
            "text": "round 4; restart spent; own failure",
        }
    ]


@pytest.mark.parametrize(
    ("raws", "expected"),
    [
        pytest.param([], {"time": [], "step": [], "steps_per_s": []}, id="none"),
        pytest.param(
            [sample(10, 0), sample(8, 20), sample(6, 30)],
            {
                "time": [NOW - 10, NOW - 8, NOW - 6],
                "step": [0, 20, 30],
                "steps_per_s": [None, 10.0, 5.0],
            },
            id="steps-per-second-between-samples",
        ),
        pytest.param(
            [sample(6, 30), b"{}", sample(10, 0), b'{"time": 1, "step": -4}', sample(8, 20)],
            {"time": [NOW - 10, NOW - 8, NOW - 6], "steps_per_s": [None, 10.0, 5.0]},
            id="out-of-order-and-garbage",
        ),
        pytest.param(
            [sample(10, 100), sample(8, 60), sample(6, 80)],
            {"steps_per_s": [None, None, 10.0]},
            id="a-resume-from-an-older-checkpoint-is-a-gap",
        ),
        pytest.param(
            [sample(10, 0, loss=2.0, world=3), sample(10, 5, loss=1.0)],
            {"loss": [2.0, 1.0], "world_size": [3, None], "steps_per_s": [None, None]},
            id="same-time-no-rate",
        ),
    ],
)
def test_samples_series(raws, expected):
    series = samples_series(raws)
    for key, value in expected.items():
        assert series[key] == value, key


@pytest.mark.parametrize(
    ("events", "age", "write_seconds"),
    [
        pytest.param([], None, None, id="no-checkpoint-no-metrics"),
        pytest.param(
            [ev(8, EventKind.CHECKPOINT_WRITTEN, step=20, duration=1.5)], 8.0, 1.5, id="one"
        ),
        pytest.param(
            [
                ev(2, EventKind.CHECKPOINT_WRITTEN, step=60, duration=0.75),
                ev(8, EventKind.CHECKPOINT_WRITTEN, step=20, duration=1.5),
                ev(1, EventKind.ROUND_FORMED, round=2, duration=0.4),
            ],
            2.0,
            0.75,
            id="the-newest-by-time-whatever-the-order",
        ),
        pytest.param(
            [ev(4, EventKind.CHECKPOINT_WRITTEN, step=20), b'{"kind": "checkpoint_written"}'],
            4.0,
            None,
            id="no-duration-and-garbage",
        ),
        pytest.param(
            [ev(-5, EventKind.CHECKPOINT_WRITTEN, step=20, duration=0.1)],
            0.0,
            0.1,
            id="a-writer-clock-ahead-is-no-negative-age",
        ),
    ],
)
def test_checkpoint_metrics(events, age, write_seconds):
    m = job_metrics(Reading("j", NOW, events=events))
    assert (m.last_checkpoint_age, m.checkpoint_write_seconds) == (age, write_seconds)


def test_histogram_is_cumulative_with_inf_last():
    assert histogram([0.5, 3, 3, 70], (1, 5, 60)) == ((1, 1), (5, 3), (60, 3), (float("inf"), 4))
    assert histogram([], (1,)) == ((1, 0), (float("inf"), 0))


def test_job_metrics_from_the_same_records():
    reading = Reading(
        "j",
        NOW,
        nodes={"a": NODE, "b": NODE.replace(b'"a"', b'"b"').replace(b"running", b"leaving"), "z": b"junk"},
        members={"a": MEMBER},
        progress=b'{"step": 120, "last_checkpoint_step": 100, "samples_per_s": 64.5, "loss": 0.5, '
        b'"time": 1699999999}',
        events=[
            ev(9, EventKind.RECOVERY_FINISHED, duration=7.0),
            b"junk",
            ev(5, EventKind.FAILURE_JUDGED, charged=True),
            ev(4, EventKind.FAILURE_JUDGED, charged=True),
        ],
        samples=[sample(4, 100), sample(2, 120)],
    )
    m = job_metrics(reading)
    assert (m.world_size, m.round, m.nodes_by_state) == (1, 3, {"training": 1, "leaving": 1})
    assert (m.restarts_spent, m.recoveries, m.recovery_seconds) == (2, 1, 7.0)
    assert m.recovery_buckets[2:4] == ((5.0, 0), (10.0, 1))
    assert (m.steps_per_s, m.samples_per_s, m.step, m.loss, m.last_checkpoint_step) == (
        10.0,
        64.5,
        120,
        0.5,
        100,
    )
    assert m.progress_age == 101.0
    empty = job_metrics(Reading("j", NOW, progress=b"[1]"))
    assert (empty.step, empty.steps_per_s, empty.progress_age, empty.round) == (
        None,
        None,
        None,
        None,
    )


RAW = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([NODE, MEMBER, *GARBAGE]),
    st.dictionaries(
        st.sampled_from(
            [
                "time",
                "step",
                "kind",
                "state",
                "round",
                "rank",
                "world_size",
                "duration",
                "charged",
                "loss",
                "host",
                "members",
            ]
        ),
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(),
            st.floats(),
            st.text(max_size=4),
            st.sampled_from(
                ["round_formed", "recovery_finished", "checkpoint_written", "training"]
            ),
        ),
        max_size=6,
    ).map(lambda d: json.dumps(d).encode()),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    nodes=st.dictionaries(st.text(max_size=6), RAW, max_size=4),
    members=st.dictionaries(st.text(max_size=6), RAW, max_size=4),
    progress=st.none() | RAW,
    events=st.lists(RAW, max_size=6),
    samples=st.lists(RAW, max_size=6),
)
def test_random_readings_never_break_the_page_or_the_metrics(
    nodes, members, progress, events, samples
):
    reading = Reading(
        "j", NOW, nodes=nodes, members=members, progress=progress, events=events, samples=samples
    )
    json.dumps(job_view(reading), allow_nan=False)  # the browser's JSON.parse takes no NaN
    job_metrics(reading)


# -- the server against a real etcd -----------------------------------------------------------


@pytest.fixture
def planted(default_etcd, run_id):
    client = EtcdClient(default_etcd.client_settings())
    keys = JobKeys(run_id)
    lease = client.grant_lease(30)
    client.put(keys.node("a"), NODE, lease=lease)
    client.put(keys.node("b"), b"\xff planted")
    client.put(keys.member("a"), MEMBER)
    client.put(keys.progress, b'{"step": 50, "last_checkpoint_step": 40, "time": 1}')
    log = EventLog(client, keys)
    log.record(EventKind.ROUND_FORMED, "a", round=3, members=("a",), world_size=1)
    log.record(EventKind.RECOVERY_FINISHED, "a", round=3, duration=2.0)
    log.record(EventKind.CHECKPOINT_WRITTEN, "a", at=NOW - 30, step=40, duration=0.5)
    client.put(keys.event(NOW, "x", "bogus"), b'{"time": "garbage"}')
    client.put(keys.progress_sample(NOW - 4), sample(4, 10))
    client.put(keys.progress_sample(NOW - 2), sample(2, 30))
    client.put(keys.progress_sample(NOW - 1), b"NaN")
    dashboard = Dashboard(default_etcd.endpoint, "--job", run_id)
    yield dashboard, keys
    assert dashboard.stop() == 0
    client.revoke_lease(lease)
    client.close()


def test_the_page_json_and_metrics_come_from_etcd(planted):
    dashboard, keys = planted
    view = json.loads(dashboard.get("api/job"))
    assert view["job"] == keys.job and view["world_size"] == 1 and view["round"] == 3
    assert [n["id"] for n in view["nodes"]] == ["a"]
    assert 0 <= view["nodes"][0]["heartbeat_age"] <= 30, "from the node record's lease"
    assert [e["kind"] for e in view["events"]] == [
        "recovery_finished",
        "round_formed",
        "checkpoint_written",
    ]
    assert view["checkpoint"]["step"] == 40 and view["checkpoint"]["age"] >= 30
    assert view["samples"]["steps_per_s"] == [None, 10.0]

    page = dashboard.get("").decode()
    assert (
        'id="world-chart"' in page and "static/dashboard.js" in page and "://" not in page
    )  # no CDN
    assert b"uPlot" in dashboard.get("static/uPlot.iife.min.js")
    with pytest.raises(urllib.error.HTTPError):
        dashboard.get("static/../server.py")

    families = {
        f.name: f for f in text_string_to_metric_families(dashboard.get("metrics").decode())
    }
    value = {f.name: f.samples[0].value for f in families.values() if f.samples}
    assert value["elasticctl_world_size"] == 1 and value["elasticctl_round"] == 3
    assert value["elasticctl_dashboard_etcd_up"] == 1
    assert families["elasticctl_restarts_spent"].type == "counter"
    assert families["elasticctl_nodes"].samples[0].labels == {
        "elastic_job": keys.job,
        "state": "training",
    }
    recovery = {
        s.name: s for s in families["elasticctl_recovery_seconds"].samples if "le" not in s.labels
    }
    assert recovery["elasticctl_recovery_seconds_count"].value == 1
    assert recovery["elasticctl_recovery_seconds_sum"].value == 2.0
    assert (
        value["elasticctl_steps_per_second"] == 10.0
        and value["elasticctl_steps_since_checkpoint"] == 10
    )
    assert value["elasticctl_last_checkpoint_age_seconds"] >= 30
    assert value["elasticctl_checkpoint_write_seconds"] == 0.5
    assert families["elasticctl_checkpoint_write_seconds"].type == "gauge"
    latency = families["elasticctl_dashboard_etcd_request_duration_seconds"]
    assert latency.type == "histogram" and {s.labels.get("request") for s in latency.samples} >= {
        "range",
        "lease",
    }
    assert all(
        s.labels.get("elastic_job", keys.job) == keys.job and "job" not in s.labels
        for f in families.values()
        for s in f.samples
    )


# -- one-sentence errors ----------------------------------------------------------------------


def _one_sentence(result: subprocess.CompletedProcess, *named: str) -> None:
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    for text in named:
        assert text in result.stderr, result.stderr


@pytest.mark.parametrize(
    "listen",
    [
        "nohost",
        "127.0.0.1:http",
        "127.0.0.1:70000",
        "example.org:80",
        ":80",
        "127.0.0.1:",
        "[::1:80",
    ],
)
def test_a_bad_listen_is_one_sentence(listen):
    # checked before etcd: no etcd is needed to be told
    _one_sentence(cli("dashboard", "--etcd", "127.0.0.1:1", "--listen", listen), f"'{listen}'")


def test_a_taken_port_is_one_sentence(default_etcd, run_id):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        EtcdClient(default_etcd.client_settings()).put(JobKeys(run_id).spec, "{}")
        result = cli(
            "dashboard",
            "--etcd",
            default_etcd.endpoint,
            "--job",
            run_id,
            "--listen",
            f"127.0.0.1:{port}",
        )
    _one_sentence(result, f"127.0.0.1:{port}", "taken")


def test_an_address_not_on_this_host_is_one_sentence(default_etcd, run_id):
    EtcdClient(default_etcd.client_settings()).put(JobKeys(run_id).spec, "{}")
    result = cli(
        "dashboard", "--etcd", default_etcd.endpoint, "--job", run_id, "--listen", "192.0.2.1:8080"
    )
    _one_sentence(result, "192.0.2.1:8080")


def test_an_unknown_job_is_one_sentence(default_etcd):
    _one_sentence(
        cli("dashboard", "--etcd", default_etcd.endpoint, "--job", "no-such-job"), "'no-such-job'"
    )
    _one_sentence(cli("dashboard", "--etcd", default_etcd.endpoint, "--job", "a/b"), "'a/b'")


def test_a_job_that_is_down_is_shown_from_its_history(default_etcd, run_id):
    client = EtcdClient(default_etcd.client_settings())
    EventLog(client, JobKeys(run_id)).record(EventKind.JOB_DOWN, reason="by the test")
    dashboard = Dashboard(default_etcd.endpoint, "--job", run_id)
    try:
        view = wait_for(lambda: json.loads(dashboard.get("api/job")), 10, "the job's JSON")
        assert [e["kind"] for e in view["events"]] == ["job_down"] and view["nodes"] == []
    finally:
        assert dashboard.stop() == 0
        client.close()


# -- issue 23, item 11: planted times and node records ---------------------------------------------

@pytest.mark.parametrize(
    ("events", "lifetime"),
    [
        ([], (0.0, NOW + 60)),
        ([ev(100, EventKind.NODE_JOINED), ev(50, EventKind.ROUND_FORMED)], (NOW - 160, NOW + 60)),
        ([ev(50, EventKind.ROUND_FORMED)], (NOW - 110, NOW + 60)),  # no node_joined left
        ([ev(-10_000, EventKind.NODE_JOINED), ev(30, EventKind.NODE_JOINED)], (NOW - 90, NOW + 60)),
    ],
    ids=["no-events", "first-join", "earliest-event", "a-join-in-the-future-is-no-start"],
)
def test_job_lifetime(events, lifetime):
    from elasticctl.dashboard.model import job_lifetime

    assert job_lifetime(sorted(map(Event.from_json, events), key=lambda e: e.time), NOW) == lifetime


def test_a_sample_or_round_from_1970_does_not_stretch_the_time_axis():
    reading = Reading(
        "j", NOW,
        events=[ev(100, EventKind.NODE_JOINED), ev(90, EventKind.ROUND_FORMED, world_size=1, round=1),
                Event(time=1.0, kind=EventKind.ROUND_FORMED, world_size=9, round=7).to_json().encode()],
        samples=[ProgressSample(time=1.0, step=5).to_json().encode(), sample(20, 10), sample(10, 20),
                 sample(-100_000, 30)],  # and one from the future
    )
    view = job_view(reading)
    assert view["samples"]["time"] == [NOW - 20, NOW - 10]
    assert view["world"] == {"time": [NOW - 90], "world_size": [1]}
    assert job_metrics(reading).steps_per_s == 1.0


@pytest.mark.parametrize(
    ("key", "record", "leased", "live"),
    [
        ("a", NODE, None, True),  # lease not known (a reading built by hand)
        ("a", NODE, frozenset({"a"}), True),
        ("a", NODE, frozenset(), False),  # put without a lease: outlives any process
        ("b", NODE, frozenset({"b"}), False),  # names another node
        ("a", NODE.replace(b'"host": "h1", ', b""), frozenset({"a"}), False),
        ("a", NODE.replace(b'"joined_at": 1', b'"joined_at": 1800000000'), frozenset({"a"}), False),
    ],
    ids=["lease-unknown", "leased", "no-lease", "another-id", "no-host", "joined-in-the-future"],
)
def test_only_genuine_node_records_count_as_live_nodes(key, record, leased, live):
    reading = Reading("j", NOW, nodes={key: record}, leased_nodes=leased)
    assert job_view(reading)["live_nodes"] == int(live)
    assert sum(job_metrics(reading).nodes_by_state.values()) == int(live)


def test_planted_records_in_etcd_change_neither_live_nodes_nor_the_time_axis(default_etcd, run_id):
    from werkzeug.test import Client

    from elasticctl.dashboard.server import Dashboard
    from elasticctl.job.registry import Registry

    keys = JobKeys(run_id)
    with EtcdClient(default_etcd.client_settings()) as client:
        lease = client.grant_lease(30)
        try:
            Registry(client, run_id).register_node(
                {"host": "h1", "addr": "127.0.0.1", "pid": 1, "state": "running", "joined_at": NOW}, lease,
                wanted_id="real")
            EventLog(client, keys).record(EventKind.NODE_JOINED, "real")
            now = wait_for(lambda: [e.time for e in EventLog(client, keys).read()], 10, "the event")[0]
            client.put(keys.progress_sample(now + 1), ProgressSample(time=now + 1, step=1).to_json())
            # Planted: a node record without a lease, a sample from 1970.
            client.put(keys.node("ghost"), NODE.replace(b'"a"', b'"ghost"'))
            client.put(keys.progress_sample(1.0), ProgressSample(time=1.0, step=0).to_json())
            view = json.loads(Client(Dashboard(client, keys)).get("/api/job").get_data(as_text=True))
            assert [n["id"] for n in view["nodes"]] == ["real"] and view["live_nodes"] == 1
            assert view["samples"]["time"] == [now + 1]
        finally:
            client.revoke_lease(lease)
            client.delete_prefix(keys.everything)
