"""The straggler rule (elasticctl.train.watches.stragglers), its settings, its event and its dashboard mark."""

from __future__ import annotations

import random

import pytest

from support.helpers import up_dry_run_in_process

from elasticctl.dashboard.model import stragglers as marked_stragglers
from elasticctl.errors import ConfigError
from elasticctl.job.records import Event, EventKind
from elasticctl.job.settings import StragglerSettings, parse_rdzv_options
from elasticctl.job.spec import JobSpec
from elasticctl.train.groups.roster import decode_name, encode_name
from elasticctl.train.watches.stragglers import (
    MIN_EXCESS,
    Interval,
    StepClock,
    Straggler,
    find_stragglers,
    node_times,
    summarize,
    to_evict,
)

FAST, SLOW = 0.010, 0.030  # seconds: a node at 3x the others


def intervals(*rows: dict[str, float], steps: int = 10) -> list[Interval]:
    return [Interval(steps, row) for row in rows]


EVEN = {"a": FAST, "b": FAST, "c": FAST}
C_SLOW = {"a": FAST, "b": FAST, "c": SLOW}


@pytest.mark.parametrize(("history", "ratio", "window", "named"), [
    pytest.param([], 1.5, 50, [], id="no-exchange-yet"),
    pytest.param(intervals(*[EVEN] * 6), 1.5, 50, [], id="even-nodes"),
    pytest.param(intervals(*[C_SLOW] * 5), 1.5, 50, [Straggler("c", 3.0, 50)], id="slow-for-the-window"),
    pytest.param(intervals(*[C_SLOW] * 7), 1.5, 50, [Straggler("c", 3.0, 70)], id="slow-for-longer"),
    pytest.param(intervals(*[C_SLOW] * 12), 1.5, 50, [Straggler("c", 3.0, 100)],
                 id="slow-steps-counted-within-two-windows"),
    pytest.param(intervals(*[C_SLOW] * 4), 1.5, 50, [], id="slow-for-fewer-than-W-steps"),
    pytest.param(intervals(*[C_SLOW] * 4, EVEN, *[C_SLOW] * 4), 1.5, 50, [Straggler("c", 3.0, 80)],
                 id="slow-at-most-steps-with-a-fast-interval-between"),
    pytest.param(intervals(EVEN, *[C_SLOW] * 2, *[EVEN] * 3, *[C_SLOW] * 2, *[EVEN] * 3, *[C_SLOW] * 2), 1.5, 50, [],
                 id="slow-in-bursts-normal-on-average"),
    pytest.param(intervals(*[C_SLOW] * 5, EVEN), 1.5, 50, [Straggler("c", 3.0, 50)],
                 id="one-fast-interval-does-not-clear-it"),
    pytest.param(intervals(*[C_SLOW] * 5, *[EVEN] * 3), 1.5, 50, [], id="no-longer-slow-at-most-steps"),
    pytest.param(intervals(*[C_SLOW] * 5), 3.0, 50, [], id="at-the-ratio-is-not-above-it"),
    pytest.param(intervals(*[C_SLOW] * 5), 2.9, 50, [Straggler("c", 3.0, 50)], id="just-above-the-ratio"),
    pytest.param(intervals(*[{"a": 1e-4, "b": 1e-4, "c": 1e-3}] * 6), 1.5, 50, [],
                 id="ten-times-a-tiny-step-is-noise"),
    pytest.param(intervals(*[{"a": 0.0, "b": 0.0, "c": MIN_EXCESS}] * 6), 1.5, 50,
                 [Straggler("c", 1e6, 60)], id="others-measured-zero"),
    pytest.param(intervals(*[{"a": FAST, "b": SLOW}] * 5), 1.5, 50, [Straggler("b", 3.0, 50)],
                 id="two-nodes-the-slow-one"),
    pytest.param(intervals(*[{"a": FAST}] * 9), 1.5, 50, [], id="one-node-has-no-others"),
    pytest.param(intervals(*[{"a": FAST, "b": FAST, "c": SLOW, "d": 2 * SLOW}] * 5), 1.5, 50,
                 [Straggler("d", 6.0, 50), Straggler("c", 3.0, 50)], id="two-stragglers-slowest-first"),
    pytest.param(intervals(*[C_SLOW] * 3, steps=20), 1.5, 50, [Straggler("c", 3.0, 60)], id="longer-intervals"),
    pytest.param([Interval(10, EVEN), *intervals(*[C_SLOW] * 5), Interval(10, {"a": FAST, "b": FAST})], 1.5, 50,
                 [], id="a-node-gone-from-the-newest-exchange"),
    # Within an interval: a median step above the threshold counts more than half of the steps
    # slow (6 of 10), a fastest step above it counts all of them
    pytest.param([Interval(10, C_SLOW, EVEN)] * 9, 1.5, 50, [Straggler("c", 3.0, 54)],
                 id="slow-at-most-steps-of-every-interval"),
    pytest.param([Interval(10, C_SLOW, EVEN)] * 8, 1.5, 50, [], id="most-steps-of-too-few-intervals"),
    pytest.param([Interval(10, EVEN, {"a": FAST, "b": FAST, "c": FAST / 2})] * 9, 1.5, 50, [],
                 id="a-fast-step-alone-is-no-evidence"),
])
def test_find_stragglers(history, ratio, window, named):
    assert find_stragglers(history, ratio, window) == named


# -- the rule on step times: what the workers report, interval by interval -----------------------

def exchanges(step_times: dict[str, list[float]], interval: int, window: int) -> list[list[Interval]]:
    """The history rank 0 holds after each exchange (as much as it keeps: two windows), from every
    node's own step times (one worker per node), summarized as the workers summarize them."""
    history, histories = [], []
    steps = len(next(iter(step_times.values())))
    for end in range(interval, steps + 1, interval):
        summaries = {node: summarize(times[end - interval:end]) for node, times in step_times.items()}
        history.append(Interval(interval, {node: median for node, (_, median) in summaries.items()},
                                {node: fastest for node, (fastest, _) in summaries.items()}))
        del history[:-(2 * window // interval + 2)]
        histories.append(list(history))
    return histories


def verdicts(step_times: dict[str, list[float]], interval: int, window: int, ratio: float = 1.5) -> list[set[str]]:
    return [{s.node for s in find_stragglers(h, ratio, window)} for h in exchanges(step_times, interval, window)]


def c_steps(pattern: list[float], repeats: int, offset: int = 0) -> dict[str, list[float]]:
    """a and b at FAST, c repeating ``pattern`` (shifted by ``offset`` steps)."""
    steps = (pattern * (repeats + 1))[offset:offset + len(pattern) * repeats]
    return {"a": [FAST] * len(steps), "b": [FAST] * len(steps), "c": steps}


INTERVALS = (1, 2, 3, 5, 10, 20)


def test_a_node_slow_at_every_step_is_named_after_the_window():
    for interval in INTERVALS:
        named = verdicts(c_steps([SLOW], 120), interval, 20)
        first = -(-20 // interval) - 1  # the first exchange after 20 steps
        assert named.index({"c"}) == first, interval
        assert all(v == {"c"} for v in named[first:]), interval


def test_a_node_slow_on_average_is_named_whether_or_not_one_step_of_the_window_was_fast():
    """19 slow steps then 1 normal, over and over: slow on average. The normal step, or the same
    step measured slow (the machine busy), wherever it falls in the intervals: named all the
    same, and once named never cleared by it."""
    window = 20
    for interval in INTERVALS:
        all_slow = verdicts(c_steps([SLOW] * 20, 8), interval, window)
        for offset in range(window):
            with_a_fast_step = verdicts(c_steps([SLOW] * 19 + [FAST], 8, offset), interval, window)
            assert with_a_fast_step[-1] == all_slow[-1] == {"c"}, (interval, offset)
            first = with_a_fast_step.index({"c"})
            assert all(v == {"c"} for v in with_a_fast_step[first:]), (interval, offset, with_a_fast_step)
            # Named at most two intervals after a node slow at every step (the bound counts known slow steps)
            assert first * interval <= window + 2 * interval, (interval, offset, first)


@pytest.mark.parametrize("pattern", [
    pytest.param([SLOW] * 5 + [FAST] * 15, id="5-slow-15-normal"),
    pytest.param([SLOW] * 10 + [FAST] * 10, id="slow-half-the-time"),
    pytest.param([SLOW] * 19 + [FAST] * 21, id="slow-for-W-minus-1-then-longer-normal"),
    pytest.param([SLOW, FAST], id="every-other-step"),
])
def test_a_node_slow_in_bursts_but_normal_on_average_is_never_named(pattern):
    for interval in INTERVALS:
        for offset in range(len(pattern)):
            named = verdicts(c_steps(pattern, 160 // len(pattern), offset), interval, 20)
            assert not any(named), (interval, offset, named)  # nor evicted: the same rule at a higher ratio


def test_a_node_slow_for_fewer_than_w_steps_is_never_named_wherever_the_slow_steps_fall():
    """W-1 slow steps in a row, normal before and after, slid over every offset and interval
    length: never named (the rule counts W slow steps before it names anyone)."""
    window = 30
    for interval in (1, 3, 7, 10, 30):
        for first_slow in range(0, 40):
            steps = [SLOW if first_slow <= s < first_slow + window - 1 else FAST for s in range(90)]
            named = verdicts({"a": [FAST] * 90, "b": [FAST] * 90, "c": steps}, interval, window)
            assert not any(named), (interval, first_slow, named)


def test_healthy_noisy_nodes_are_never_named():
    """Three nodes whose steps vary by up to 40% and, one step in ten, stall at 3x (a busy
    machine): each is slow now and then, none on average."""
    rng = random.Random(7)

    def noisy() -> list[float]:
        return [FAST * (3.0 if rng.random() < 0.1 else rng.uniform(0.8, 1.2)) for _ in range(400)]

    for interval in INTERVALS:
        named = verdicts({"a": noisy(), "b": noisy(), "c": noisy()}, interval, 20)
        assert not any(named), (interval, named)


def test_the_summary_a_worker_sends_is_its_fastest_and_lower_median_step():
    assert summarize([0.03, 0.01, 0.02, 0.04]) == (0.01, 0.02)  # the lower median: a step it took
    assert summarize([0.05]) == (0.05, 0.05)
    assert summarize([]) == (0.0, 0.0)


@pytest.mark.parametrize(("stragglers", "world_nodes", "min_nodes", "evicted"), [
    ([], 3, 1, None),
    ([Straggler("c", 3.0, 50)], 3, 1, "c"),
    ([Straggler("d", 6.0, 50), Straggler("c", 3.0, 50)], 4, 1, "d"),  # one at a time, the slowest
    ([Straggler("c", 3.0, 50)], 3, 3, None),  # never below --nnodes MIN
    ([Straggler("c", 3.0, 50)], 3, 2, "c"),
])
def test_to_evict(stragglers, world_nodes, min_nodes, evicted):
    chosen = to_evict(stragglers, world_nodes, min_nodes)
    assert (chosen.node if chosen else None) == evicted


def test_a_node_is_as_fast_as_its_slowest_worker():
    assert node_times(["a", "a", "b", "b"], [0.01, 0.03, 0.02, 0.01]) == {"a": 0.03, "b": 0.02}


def test_node_names_travel_as_bytes_and_are_checked():
    assert decode_name(encode_name("node-7.x")) == "node-7.x"
    assert len(encode_name("n" * 63)) == 64
    with pytest.raises(ConfigError, match="node id a peer sent"):
        decode_name(list(b"a/b") + [0] * 61)


def test_the_clock_times_a_step_to_its_gradients_or_else_to_commit():
    clock = StepClock()
    clock.restart()
    clock.gradients_ready()
    clock.step_done()
    fastest, median, steps = clock.take()
    assert steps == 1 and 0 <= fastest == median < 0.5
    clock.next_step()
    clock.step_done()  # no hook ran: timed to commit
    assert clock.take()[2] == 1
    assert clock.take() == (0.0, 0.0, 0)  # an interval without steps


# -- settings ---------------------------------------------------------------------------------

def test_the_defaults():
    assert StragglerSettings.of(parse_rdzv_options({}), min_nodes=2) == StragglerSettings(
        ratio=1.5, window=50, interval=10, evict=0.0, min_nodes=2)


@pytest.mark.parametrize(("conf", "message"), [
    ({"straggler_ratio": "1"}, r"straggler_ratio \(--straggler-ratio\) \('1'\) must be a ratio above 1"),
    ({"straggler_ratio": "inf"}, r"\('inf'\) must be a ratio above 1 and up to 1000\."),
    ({"straggler_ratio": "0"}, r"\('0'\) must be a ratio above 1 and up to 1000\.$"),
    ({"evict_stragglers": "0.5"}, r"evict_stragglers \(--evict-stragglers\) \('0.5'\) .* \(0: never\)"),
    ({"straggler_window": "0"}, r"straggler_window \(--straggler-window\) \('0'\) must be a whole number of steps"),
    ({"straggler_interval": "2.5"}, r"straggler_interval \(--straggler-interval\) \('2.5'\)"),
    ({"straggler_window": "5"}, r"The straggler interval \(10 steps\) must not be above the straggler window \(5"),
])
def test_a_bad_setting_is_one_sentence_naming_it(conf, message):
    with pytest.raises(ConfigError, match=message) as caught:
        JobSpec("j", "train.py", rdzv_conf=tuple(conf.items()))
    assert str(caught.value).count(". ") == 0 and "\n" not in str(caught.value)


def test_eviction_is_a_ratio_or_zero():
    options = parse_rdzv_options({"evict_stragglers": "2.5", "straggler_window": "20", "straggler_interval": "5"})
    assert (options.evict_stragglers, options.straggler_window, options.straggler_interval) == (2.5, 20, 5)
    assert parse_rdzv_options({"evict_stragglers": "0"}).evict_stragglers == 0


# -- the event and the dashboard's mark --------------------------------------------------------

def test_a_straggler_event_round_trips_and_a_bad_ratio_is_refused():
    event = Event(time=100.0, kind=EventKind.STRAGGLER, node="c", ratio=3.0, step=50, reason="slow")
    assert Event.from_json(event.to_json().encode()) == event
    for ratio in ('"3"', "-1", "true", "1e12"):
        raw = event.to_json().replace('"ratio":3.0', f'"ratio":{ratio}').encode()
        assert Event.from_json(raw) is None, ratio


def _event(t: float, kind: EventKind, node: str = "c", **fields) -> Event:
    return Event(time=t, kind=kind, node=node, **fields)


@pytest.mark.parametrize(("events", "marked"), [
    ([], {}),
    ([_event(1, EventKind.STRAGGLER, ratio=3.0)], {"c": 3.0}),
    ([_event(1, EventKind.STRAGGLER, ratio=3.0), _event(2, EventKind.STRAGGLER, ratio=4.0)], {"c": 4.0}),
    ([_event(1, EventKind.STRAGGLER, ratio=3.0), _event(2, EventKind.STRAGGLER_CLEARED)], {}),
    ([_event(1, EventKind.STRAGGLER, ratio=3.0), _event(2, EventKind.ROUND_FORMED, node="", round=4)], {}),
    ([_event(1, EventKind.ROUND_FORMED, node="", round=4), _event(2, EventKind.STRAGGLER, ratio=2.0),
      _event(3, EventKind.STRAGGLER, node="b", ratio=5.0)], {"c": 2.0, "b": 5.0}),
])
def test_the_dashboard_marks_the_nodes_named_now(events, marked):
    assert marked_stragglers(events) == marked


# -- the flags of `up` ----------------------------------------------------------------------------

_up = up_dry_run_in_process


def test_up_hands_the_straggler_flags_to_the_rendezvous_options():
    code, stdout, stderr = _up("--straggler-ratio", "2", "--straggler-window", "40", "--straggler-interval", "4",
                               "--evict-stragglers", "3.5")
    assert code == 0, stderr
    conf = dict(item.split("=", 1) for item in stdout.split("--rdzv-conf=")[1].split()[0].split(","))
    assert {key: conf[key] for key in conf if "straggler" in key} == {
        "straggler_ratio": "2", "straggler_window": "40", "straggler_interval": "4", "evict_stragglers": "3.5"}


@pytest.mark.parametrize(("flags", "message"), [
    (("--straggler-ratio", "0.9"), "The rendezvous option straggler_ratio (--straggler-ratio) ('0.9') must be a "
                                   "ratio above 1 and up to 1000."),
    (("--evict-stragglers", "x"), "The rendezvous option evict_stragglers (--evict-stragglers) ('x') must be a "
                                  "ratio above 1 and up to 1000 (0: never)."),
    (("--straggler-window", "-3"), "(--straggler-window) ('-3') must be a whole number of steps from 1 to 1000000."),
    (("--straggler-window", "5"), "The straggler interval (10 steps) must not be above the straggler window (5 steps)."),
])
def test_a_bad_straggler_flag_is_a_one_line_error(flags, message):
    code, _, stderr = _up(*flags)
    assert code != 0 and stderr.count("\n") == 1 and stderr.startswith("elasticctl: error: "), stderr
    assert message in stderr
