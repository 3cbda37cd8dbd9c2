"""A job's counters (elasticctl.job.counters): what each event adds (table-driven), that no
sequence of events makes a total go down, that shards add up, and that a shard read back from
etcd (untrusted) always decodes to valid totals, whatever it holds.

Layer tests/unit: no etcd, no processes. The compare-and-swap that keeps them in etcd:
tests/contract/test_job_counters_etcd.py; the dashboard that exports them: tests/unit/test_dashboard.py.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elasticctl.job.counters import RECOVERY_BUCKETS, JobCounters, shard_of, total
from elasticctl.job.records import Event, EventKind

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def event(kind: EventKind, node: str = "a", **fields) -> Event:
    return Event(time=1_700_000_000.0, kind=kind, node=node, **fields)


def folded(*events: Event) -> JobCounters:
    counters = JobCounters()
    for e in events:
        counters = counters.add(e)
    return counters


def bucket(counters: JobCounters, bound: float) -> int:
    return dict(counters.histogram())[bound]


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        pytest.param((), {"restarts_spent": 0, "recoveries": 0, "recovery_seconds": 0.0, "events": {}}, id="none"),
        pytest.param(
            (event(EventKind.FAILURE_JUDGED, charged=True), event(EventKind.FAILURE_JUDGED, charged=False),
             event(EventKind.FAILURE_JUDGED)),
            {"restarts_spent": 1, "events": {EventKind.FAILURE_JUDGED: 3}},
            id="only-a-charged-verdict-spends-a-restart",
        ),
        pytest.param(
            (event(EventKind.RECOVERY_FINISHED, duration=0.5), event(EventKind.RECOVERY_FINISHED, duration=70.0),
             event(EventKind.RECOVERY_FINISHED)),
            {"recoveries": 2, "recovery_seconds": 70.5, "events": {EventKind.RECOVERY_FINISHED: 3}},
            id="a-recovery-without-a-duration-is-an-event-not-an-observation",
        ),
        pytest.param(
            (event(EventKind.RECOVERY_FINISHED, duration=-3.0),),
            {"recoveries": 1, "recovery_seconds": 0.0},
            id="a-clock-stepping-back-makes-no-negative-sum",
        ),
        pytest.param(
            (event(EventKind.MEMBER_LOST, "c"), event(EventKind.STRAGGLER, "c", ratio=2.0),
             event(EventKind.STRAGGLER_CLEARED, "c"), event(EventKind.MEMBER_LOST, "d")),
            {"events": {EventKind.MEMBER_LOST: 2, EventKind.STRAGGLER: 1, EventKind.STRAGGLER_CLEARED: 1}},
            id="every-kind-counted",
        ),
    ],
)
def test_what_each_event_adds(events, expected):
    counters = folded(*events)
    for name, value in expected.items():
        assert getattr(counters, name) == value, name


def test_the_recovery_histogram_is_cumulative_with_inf_last():
    counters = folded(*(event(EventKind.RECOVERY_FINISHED, duration=d) for d in (0.5, 3, 3, 70)))
    assert counters.histogram() == (
        (1.0, 1), (2.5, 1), (5.0, 3), (10.0, 3), (20.0, 3), (30.0, 3), (60.0, 3), (120.0, 4), (300.0, 4),
        (math.inf, 4),
    )
    assert bucket(folded(event(EventKind.RECOVERY_FINISHED, duration=1.0)), 1.0) == 1, "a bound is inclusive (le)"
    assert JobCounters().histogram() == (*((b, 0) for b in RECOVERY_BUCKETS), (math.inf, 0))


def test_the_shards_add_up_and_survive_their_json():
    a = folded(event(EventKind.MEMBER_LOST, "a"), event(EventKind.RECOVERY_FINISHED, "a", duration=4.0))
    b = folded(event(EventKind.MEMBER_LOST, "b"), event(EventKind.FAILURE_JUDGED, "b", charged=True))
    assert JobCounters.from_json(a.to_json().encode()) == a
    summed = total([a.to_json().encode(), b.to_json().encode(), b"planted junk"])
    assert summed.count(EventKind.MEMBER_LOST) == 2 and summed.restarts_spent == 1
    assert (summed.recoveries, summed.recovery_seconds, bucket(summed, 5.0)) == (1, 4.0, 1)
    assert total([]) == JobCounters()


def test_an_event_is_counted_in_the_shard_of_the_node_it_is_about():
    assert shard_of(event(EventKind.MEMBER_LOST, "c")) == "c"
    assert shard_of(event(EventKind.JOB_DOWN, "")) == "_", "the job's own: a name no node id can be"


# -- untrusted shards --------------------------------------------------------------------------


def shard(**fields) -> bytes:
    base = json.loads(folded(event(EventKind.RECOVERY_FINISHED, duration=3.0),
                             event(EventKind.FAILURE_JUDGED, charged=True)).to_json())
    return json.dumps({**base, **fields}).encode()


@pytest.mark.parametrize(
    ("raw", "check"),
    [
        (None, lambda c: c == JobCounters()),
        (b"\xff not json", lambda c: c == JobCounters()),
        (b"[1, 2]", lambda c: c == JobCounters()),
        (shard(restarts_spent=-1), lambda c: c.restarts_spent == 0 and c.recoveries == 1),
        (shard(restarts_spent=True), lambda c: c.restarts_spent == 0),
        (shard(restarts_spent=2**60), lambda c: c.restarts_spent == 0),
        (shard(recovery_seconds="3"), lambda c: c.recovery_seconds == 0.0 and c.recoveries == 1),
        (shard(events={"member_lost": 2, "from_the_future": 5, "straggler": -1}),
         lambda c: c.events == {EventKind.MEMBER_LOST: 2}),
        (shard(events=[1]), lambda c: c.events == {}),
        # buckets that break a histogram's rules read as empty, never as a histogram Prometheus refuses
        (shard(recovery_buckets={"1.0": 1}), lambda c: c.recovery_buckets == (0,) * len(RECOVERY_BUCKETS)),
        (shard(recovery_buckets={repr(b): 9 - i for i, b in enumerate(RECOVERY_BUCKETS)}, recoveries=9),
         lambda c: c.recovery_buckets == (0,) * len(RECOVERY_BUCKETS)),
        (shard(recovery_buckets={repr(b): 5 for b in RECOVERY_BUCKETS}, recoveries=1),
         lambda c: c.recovery_buckets == (0,) * len(RECOVERY_BUCKETS) and c.recoveries == 1),
    ],
    ids=["none", "not-json", "not-an-object", "negative", "a-bool", "too-large", "a-string", "unknown-kinds",
         "events-not-an-object", "buckets-missing", "buckets-not-cumulative", "buckets-over-the-count"],
)
def test_a_malformed_shard_reads_field_by_field(raw, check):
    assert check(JobCounters.from_json(raw))


def valid(counters: JobCounters) -> bool:
    """Totals Prometheus accepts: non-negative, finite, buckets cumulative and within the count."""
    buckets = [n for _, n in counters.histogram()]
    return (all(n >= 0 for n in (*counters.events.values(), counters.restarts_spent, counters.recoveries))
            and math.isfinite(counters.recovery_seconds) and counters.recovery_seconds >= 0
            and buckets == sorted(buckets) and buckets[-1] == counters.recoveries
            and set(counters.events) <= set(EventKind))


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = st.dictionaries(
    st.sampled_from(["events", "restarts_spent", "recoveries", "recovery_seconds", "recovery_buckets", "x"]),
    JSON | st.dictionaries(st.sampled_from([k.value for k in EventKind] + [repr(b) for b in RECOVERY_BUCKETS]),
                           st.integers(-2, 2**54) | st.floats(), max_size=10),
    max_size=6,
)


@FUZZ
@given(raw=st.binary(max_size=64) | FIELDS.map(lambda d: json.dumps(d).encode()))
def test_any_shard_decodes_to_valid_totals(raw):
    assert valid(JobCounters.from_json(raw))


EVENTS = st.builds(
    Event,
    time=st.just(1_700_000_000.0),
    kind=st.sampled_from(list(EventKind)),
    node=st.sampled_from(["", "a", "b"]),
    charged=st.none() | st.booleans(),
    duration=st.none() | st.floats(-10, 1e6),
)


@FUZZ
@given(events=st.lists(EVENTS, max_size=30))
def test_no_sequence_of_events_makes_a_total_go_down(events):
    counters = JobCounters()
    for e in events:
        after = counters.add(e)
        assert valid(after)
        assert all(after.count(k) >= counters.count(k) for k in EventKind)
        assert after.restarts_spent >= counters.restarts_spent and after.recoveries >= counters.recoveries
        assert after.recovery_seconds >= counters.recovery_seconds
        assert all(x >= y for x, y in zip(after.recovery_buckets, counters.recovery_buckets))
        assert JobCounters.from_json(after.to_json().encode()) == after, "what is stored is what was counted"
        counters = after
    assert sum(counters.events.values()) == len(events)
