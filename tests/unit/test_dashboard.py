"""`elasticctl dashboard`: the pure model (table-driven, planted records mixed in), the server's
JSON and /metrics against a real etcd, and its one-sentence errors. The live page in a real
browser during a real job: tests/test_dashboard_browser.py.

Layer tests/unit: no etcd, no processes. The other tests of this subject:
tests/process/test_dashboard_server.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from support.dashboard import MEMBER, NODE, NOW, sample
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elasticctl.dashboard.model import NODE_STATES, Reading, job_metrics, job_view, samples_series
from elasticctl.job.counters import JobCounters
from elasticctl.job.records import Event, EventKind, ProgressSample


GARBAGE = [b"", b"\xff\xfe", b"[]", b"null", b'{"time": "soon"}', b"[" * 50_000, b'{"kind": 5}']


def ev(t: float, kind: EventKind, node: str = "a", **fields) -> bytes:
    return Event(time=NOW - t, kind=kind, node=node, **fields).to_json().encode()


def counted(*raws: bytes) -> tuple[bytes, ...]:
    """The counter shard the events in ``raws`` (garbage skipped) added up to as they were recorded."""
    counters = JobCounters()
    for event in filter(None, map(Event.from_json, raws)):
        counters = counters.add(event)
    return (counters.to_json().encode(),)


RECOVERIES_AND_VERDICTS = (
    ev(30, EventKind.ROUND_FORMED, world_size=3, round=1),
    *GARBAGE,
    ev(20, EventKind.MEMBER_LOST, "c", round=1),
    ev(15, EventKind.FAILURE_JUDGED, "b", charged=True, reason="own"),
    ev(15, EventKind.FAILURE_JUDGED, "a", charged=False),
    # the rendezvous part of the recovery: already inside recovery_finished's
    ev(10, EventKind.ROUND_FORMED, world_size=2, round=2, duration=3.0),
    ev(10, EventKind.RECOVERY_FINISHED, duration=4.5, round=2, step=40),
    ev(5, EventKind.RECOVERY_FINISHED, duration=1.25, round=3),
)


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
                        "straggler": None,
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
                # "h" names no id or host of its own: not a node's record
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
                        "straggler": None,
                    },
                ],
            },
            id="planted-node-records-and-ids-are-skipped",
        ),
        pytest.param(
            # the totals come from the job's counters, which these events added up to
            Reading("j", NOW, events=RECOVERIES_AND_VERDICTS, counters=counted(*RECOVERIES_AND_VERDICTS)),
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


def test_the_totals_are_the_counters_not_a_recount_of_the_bounded_history():
    events = [ev(9, EventKind.RECOVERY_FINISHED, duration=7.0), ev(5, EventKind.FAILURE_JUDGED, charged=True)]
    # the history forgot these events (trimmed): the totals stay
    forgotten = job_metrics(Reading("j", NOW, counters=counted(*events)))
    assert (forgotten.restarts_spent, forgotten.recoveries, forgotten.recovery_seconds) == (1, 1, 7.0)
    assert job_view(Reading("j", NOW, counters=counted(*events)))["totals"] == {
        "recoveries": 1, "recovery_seconds": 7.0, "restarts_spent": 1}
    # events in the history that no counter counted (planted there): no total rises
    planted = job_metrics(Reading("j", NOW, events=events))
    assert (planted.restarts_spent, planted.recoveries, planted.counters) == (0, 0, JobCounters())


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
    reading = dataclasses.replace(reading, counters=counted(*reading.events))
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
    counters=st.lists(RAW, max_size=3),
)
def test_random_readings_never_break_the_page_or_the_metrics(
    nodes, members, progress, events, samples, counters
):
    reading = Reading(
        "j", NOW, nodes=nodes, members=members, progress=progress, events=events, samples=samples,
        counters=counters,
    )
    json.dumps(job_view(reading), allow_nan=False)  # the browser's JSON.parse takes no NaN
    metrics = job_metrics(reading)
    assert set(metrics.nodes_by_state) <= NODE_STATES, "label values from a closed set"
    _render([("j", metrics)])


# -- planted times and node records ----------------------------------------------------------------

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


def test_the_dashboard_and_status_present_one_snapshot_each_their_own_way():
    from elasticctl.job.registry import JobView
    from elasticctl.job.snapshot import JobSnapshot

    snapshot = JobSnapshot(job="j", nodes={"a": NODE, "b": NODE.replace(b'"a"', b'"b"')},
                           node_leases={"a": 7, "b": 0}, members={"a": MEMBER}, progress=b'{"step": 4}',
                           heartbeats={"a": 1.5}, events=[], samples=[sample(NOW - 1, 3)])
    reading = Reading.of(snapshot, NOW)
    assert reading.leased_nodes == frozenset({"a"}) and reading.heartbeats == {"a": 1.5}
    assert [row["id"] for row in job_view(reading)["nodes"]] == ["a"]  # b's key has no lease
    view = JobView.of(snapshot)
    assert sorted(view.nodes) == ["a", "b"] and view.round == 3 and view.progress == {"step": 4}
    assert [n["rendezvous"] for n in view.to_dict()["nodes"]] == ["training", "joining"]


# -- what the alert rules compare against -------------------------------------------------------


def test_the_spec_gives_the_node_bounds_and_the_restart_budget_and_members_what_each_spent():
    from elasticctl.errors import ConfigError
    from elasticctl.job.spec import JobSpec

    spec = JobSpec("j", "train.py", min_nodes=2, max_nodes=4, max_restarts=5)
    reading = Reading(
        "j",
        NOW,
        nodes={"a": NODE, "b": NODE.replace(b'"a"', b'"b"')},
        members={"a": MEMBER},  # restarts 1; b has no member record yet: it spent none
        spec=spec,
    )
    m = job_metrics(reading)
    assert (m.nnodes_min, m.nnodes_max, m.restart_budget) == (2, 4, 5)
    assert m.node_restarts == {"a": 1, "b": 0} and m.finished_nodes == 0
    # a finished run: the member records say done, also those of nodes whose process is gone
    done = MEMBER.replace(b'"training"', b'"done"')
    assert job_metrics(Reading("j", NOW, members={"a": done, "z": done.replace(b'"a"', b'"z"')})).finished_nodes == 2
    # max_restarts has one home, the spec's field, which the handler enforces: the budget shown;
    # given in --rdzv-conf with the same value it is taken once, with another it is refused
    given_twice = JobSpec("j", "train.py", max_restarts=2, rdzv_conf=(("max_restarts", "2"),))
    assert given_twice.rdzv_conf == () and job_metrics(Reading("j", NOW, spec=given_twice)).restart_budget == 2
    with pytest.raises(ConfigError, match=r"max_restarts \(5\) and its rendezvous option max_restarts=2 disagree"):
        JobSpec("j", "train.py", max_restarts=5, rdzv_conf=(("max_restarts", "2"),))
    without = job_metrics(Reading("j", NOW))  # a plain torchrun job, or one that is down
    assert (without.nnodes_min, without.nnodes_max, without.restart_budget) == (None, None, None)


# -- hot spares on the page and in /metrics ---------------------------------------------------------


def _node(node: str) -> bytes:
    return NODE.replace(b'"a"', f'"{node}"'.encode())


def _spares_reading(generation: tuple[str, ...] | None, spares: str = "1", states: dict | None = None,
                    nodes: str = "abcd") -> Reading:
    from elasticctl.job.records import Round
    from elasticctl.job.spec import JobSpec

    states = states or {}
    return Reading(
        "j", NOW,
        nodes={n: _node(n) for n in nodes},
        members={n: MEMBER.replace(b'"a"', f'"{n}"'.encode()).replace(b'"training"', f'"{states.get(n, "training")}"'.encode())
                 for n in nodes},
        spec=JobSpec("j", "train.py", min_nodes=1, max_nodes=3, rdzv_conf=(("spares", spares),)),
        generation=None if generation is None else Round(number=4, members=generation),
    )


@pytest.mark.parametrize(
    ("reading", "waiting", "expected", "short"),
    [
        # hot: a full generation of a, b, c; d's worker waits warm outside it
        (_spares_reading(("a.0", "b.0", "c.0")), ["d"], 1, 0),
        # two expected, one waits: one SHORT
        (_spares_reading(("a.0", "b.0", "c.0"), spares="2"), ["d"], 2, 1),
        # room in the generation: d is joining, not a spare, and the one expected is missing
        (_spares_reading(("a.0", "b.0")), [], 1, 1),
        # d left: no spare
        (_spares_reading(("a.0", "b.0", "c.0"), states={"d": "left"}), [], 1, 1),
        # none asked for, none waiting
        (_spares_reading(("a.0", "b.0", "c.0"), spares="0", nodes="abc"), [], 0, 0),
        # restart mode (no generation): the full round is a, b, c by their member records
        (_spares_reading(None, states={"d": "joining"}), ["d"], 1, 0),
    ],
    ids=["hot-one-waits", "hot-one-short", "room-in-the-world", "spare-left", "none-expected", "restart-mode"],
)
def test_spares_on_the_page_and_in_the_metrics(reading, waiting, expected, short):
    view = job_view(reading)
    assert view["spares"] == {"waiting": waiting, "expected": expected, "short": short}
    assert [n["id"] for n in view["nodes"] if n["state"] == "spare"] == waiting
    m = job_metrics(reading)
    assert (m.spares, m.spares_expected) == (len(waiting), expected)
    assert m.nodes_by_state.get("spare", 0) == len(waiting)


def test_the_metrics_render_the_spares_and_the_spare_state():
    samples = _samples(_render([("j", job_metrics(_spares_reading(("a.0", "b.0", "c.0"), spares="2")))]))
    assert samples[("elasticctl_spares", (("elastic_job", "j"),))] == 1
    assert samples[("elasticctl_spares_expected", (("elastic_job", "j"),))] == 2
    assert samples[("elasticctl_nodes", (("elastic_job", "j"), ("state", "spare")))] == 1
    assert samples[("elasticctl_nodes", (("elastic_job", "j"), ("state", "training")))] == 3
    # without a spec nothing is expected: the metric is left out, not reported as 0
    assert job_metrics(Reading("j", NOW)).spares_expected is None


# -- /metrics by the book ----------------------------------------------------------------------


def _render(results) -> str:
    """/metrics as prometheus_client renders the families of ``results`` (job, metrics or None)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from elasticctl.dashboard.server import metric_families

    class Planted:  # a collector of planted results (no etcd here)
        @staticmethod
        def collect():
            return metric_families(results)

    registry = CollectorRegistry()
    registry.register(Planted())
    return generate_latest(registry).decode()


def _samples(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        ("Writing the checkpoint of step 40 to '/ckpt' failed: the disk is full (No space left on device).",
         "disk_full"),
        ("Writing the checkpoint of step 40 to '/ckpt' failed: the disk quota is exhausted (Disk quota exceeded).",
         "disk_full"),
        ("Writing the checkpoint of step 7 to '/ckpt' failed: Permission denied.", "permission"),
        ("Writing the checkpoint of step 7 to '/ckpt' failed: Operation not permitted.", "permission"),
        ("Writing the checkpoint of step 7 to '/ckpt' failed: the file system is read-only (Read-only file system).",
         "permission"),
        ("Writing the checkpoint of step 7 to '/ckpt' failed: RuntimeError: unexpected pos 64 vs 0.", "other"),
        ("Writing the checkpoint of step 7 to '/ckpt' failed: the storage reports an I/O error (Input/output error).",
         "other"),
        # the directory's name does not decide it: only the reason after it
        ("Writing the checkpoint of step 7 to '/the disk is full/permission denied' failed: Timed out.", "other"),
        ("The checkpoint directory '/ckpt' is not readable and writable by this user.", "permission"),
        ("NO SPACE LEFT ON DEVICE", "disk_full"),
        ("", "other"),
    ],
    ids=["enospc", "edquot", "eacces", "eperm", "erofs", "torch", "eio", "a-directory-named-so",
         "a-sentence-of-the-directory-check", "any-case", "empty"],
)
def test_a_checkpoint_error_becomes_one_kind_of_a_closed_set(error, kind):
    from elasticctl.dashboard.model import checkpoint_error_kind

    assert checkpoint_error_kind(error).value == kind


@settings(max_examples=100, deadline=None)
@given(error=st.text(max_size=200))
def test_any_checkpoint_error_text_is_a_kind_of_the_closed_set(error):
    from elasticctl.dashboard.model import CheckpointErrorKind, checkpoint_error_kind

    assert checkpoint_error_kind(error) in set(CheckpointErrorKind)


def test_the_checkpoint_failures_label_is_the_kind_never_the_text():
    text = "Writing the checkpoint of step 40 to '/data/run 7' failed: the disk is full (No space left on device)."
    failing = Reading("j", NOW, progress=json.dumps(
        {"step": 50, "time": NOW, "checkpoint_error": text, "checkpoint_failures": 3}).encode())
    samples = _samples(_render([("j", job_metrics(failing))]))
    assert samples[("elasticctl_checkpoint_failures", (("elastic_job", "j"), ("error", "disk_full")))] == 3
    fine = Reading("j", NOW, progress=b'{"step": 50, "time": 1700000000}')
    assert _samples(_render([("j", job_metrics(fine))]))[
        ("elasticctl_checkpoint_failures", (("elastic_job", "j"), ("error", "")))] == 0, "no error: an empty label"


def test_a_planted_node_state_is_unknown_not_a_new_label_value():
    planted = NODE.replace(b'"running"', b'"' + b"x" * 30 + b'"')
    m = job_metrics(Reading("j", NOW, nodes={"a": planted}))
    assert m.nodes_by_state == {"unknown": 1}


def test_one_family_per_metric_with_every_job_and_the_build_info():
    from prometheus_client.parser import text_string_to_metric_families

    from elasticctl import __version__

    a = Reading("a", NOW, nodes={"a": NODE}, members={"a": MEMBER},
                counters=counted(ev(3, EventKind.MEMBER_LOST, "c"), ev(2, EventKind.RECOVERY_FINISHED, duration=2.0)))
    b = Reading("b", NOW, counters=counted(ev(1, EventKind.FAILURE_JUDGED, charged=True)))
    text = _render([("a", job_metrics(a)), ("b", job_metrics(b)), ("broken", None)])
    families = list(text_string_to_metric_families(text))
    assert len({f.name for f in families}) == len(families), "each name once per scrape"
    samples = _samples(text)
    assert samples[("elasticctl_build_info", (("version", __version__),))] == 1
    assert samples[("elasticctl_dashboard_etcd_up", (("elastic_job", "broken"),))] == 0
    assert samples[("elasticctl_dashboard_etcd_up", (("elastic_job", "a"),))] == 1
    assert samples[("elasticctl_world_size", (("elastic_job", "a"),))] == 1
    assert samples[("elasticctl_world_size", (("elastic_job", "b"),))] == 0
    assert samples[("elasticctl_events_total", (("elastic_job", "a"), ("kind", "member_lost")))] == 1
    assert samples[("elasticctl_events_total", (("elastic_job", "b"), ("kind", "member_lost")))] == 0
    assert {labels[1][1] for (name, labels) in samples if name == "elasticctl_events_total"} == {
        k.value for k in EventKind}, "every kind, 0 until it happens"
    assert samples[("elasticctl_restarts_spent_total", (("elastic_job", "b"),))] == 1
    assert samples[("elasticctl_recovery_seconds_count", (("elastic_job", "a"),))] == 1
    assert samples[("elasticctl_recovery_seconds_bucket", (("elastic_job", "a"), ("le", "2.5")))] == 1
    assert not any(name.startswith("elasticctl_world_size") for (name, labels) in samples
                   if ("elastic_job", "broken") in labels), "an unreadable job has only its up series"
    per_job = {name for (name, labels) in samples if name != "elasticctl_build_info"}
    assert all(dict(labels).get("elastic_job") for (name, labels) in samples if name in per_job)


def test_diverged_replicas_have_their_own_counter():
    reading = Reading("a", NOW, counters=counted(ev(3, EventKind.REPLICA_DIVERGED, "c", step=25),
                                                 ev(2, EventKind.REPLICA_DIVERGED, "", step=30)))
    samples = _samples(_render([("a", job_metrics(reading)), ("b", job_metrics(Reading("b", NOW)))]))
    assert samples[("elasticctl_replica_diverged_events_total", (("elastic_job", "a"),))] == 2
    assert samples[("elasticctl_replica_diverged_events_total", (("elastic_job", "b"),))] == 0
    assert samples[("elasticctl_events_total", (("elastic_job", "a"), ("kind", "replica_diverged")))] == 2


def test_a_dashboard_that_cannot_list_the_jobs_says_so_in_one_series():
    samples = _samples(_render(None))
    assert samples[("elasticctl_dashboard_etcd_up", ())] == 0
    assert {name for name, _ in samples} == {"elasticctl_dashboard_etcd_up", "elasticctl_build_info"}


@pytest.mark.parametrize(
    ("asked", "jobs", "chosen"),
    [
        (None, ["a"], "a"),
        ("b", ["a", "b"], "b"),
        (None, ["a", "b"], "There are 2 jobs in etcd (a, b); pick one."),
        (None, [], "There is no job in etcd yet; start one with 'elasticctl up'."),
        ("c", ["a", "b"], "The job 'c' is not one this dashboard shows (jobs: a, b)."),
        ("c", [], "The job 'c' is not one this dashboard shows (jobs: none)."),
    ],
    ids=["the-only-job", "the-one-asked-for", "several-pick-one", "none-yet", "not-shown", "not-shown-none"],
)
def test_the_page_shows_the_job_asked_for_or_the_only_one(asked, jobs, chosen):
    from elasticctl.dashboard.server import choose_job
    from elasticctl.errors import ConfigError

    if chosen in jobs:
        assert choose_job(asked, jobs) == chosen
    else:
        with pytest.raises(ConfigError) as error:
            choose_job(asked, jobs)
        assert str(error.value) == chosen


@pytest.mark.parametrize(
    ("keys", "shown"),
    [
        ([], []),
        (["/elasticctl/jobs/a/spec", "/elasticctl/jobs/a/nodes/n1"], ["a"]),
        # down: only its history left (for an hour)
        (["/elasticctl/jobs/b/history/events/00001-n-node_joined", "/elasticctl/jobs/b/history/lease"], ["b"]),
        (["/elasticctl/jobs/b/history/counters/n"], ["b"]),
        # a job's stray keys without a spec or history (a store being cleaned up): not a job shown
        (["/elasticctl/jobs/c/store/1/x", "/elasticctl/jobs/c/rdzv/nodes/n"], []),
        # planted under names no job can have
        (["/elasticctl/jobs/-x/spec", "/elasticctl/jobs/\xff/spec", b"/elasticctl/jobs/\xff/spec"], []),
        (["/elasticctl/jobs/z/spec", "/elasticctl/jobs/a/spec", "/elasticctl/jobs/a/history/lease"], ["a", "z"]),
    ],
    ids=["none", "running", "down", "counters-only", "stray-keys", "planted-names", "sorted-once-each"],
)
def test_the_jobs_a_dashboard_shows(keys, shown):
    from elasticctl.job.registry import shown_jobs

    assert shown_jobs(keys) == shown
