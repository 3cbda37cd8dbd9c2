"""The pure timeline of a hot recovery (elasticctl.train.recovery.timeline)."""

import pytest

from elasticctl.train.recovery.timeline import describe_timeline, recovery_timeline


@pytest.mark.parametrize(("noticed", "marks", "expected"), [
    (100.0, {}, {}),
    (100.0, {"first_step": 100.5}, {"first_step": 0.5}),
    # phase order, whatever order the marks came in
    (100.0, {"first_step": 100.9, "torn_down": 100.01, "sealed": 100.3, "group_built": 100.35,
             "state_synced": 100.4},
     {"torn_down": 0.01, "sealed": 0.3, "group_built": 0.35, "state_synced": 0.4, "first_step": 0.9}),
    # a name that is no phase, and a mark from before the fault (a clock stepped back), are dropped
    (100.0, {"lunch": 101.0, "torn_down": 99.0, "sealed": 100.2}, {"sealed": 0.2}),
    # to the millisecond
    (100.0, {"sealed": 100.12345}, {"sealed": 0.123}),
])
def test_recovery_timeline(noticed, marks, expected):
    timeline = recovery_timeline(noticed, marks)
    assert timeline == expected
    assert list(timeline) == list(expected)


@pytest.mark.parametrize(("timeline", "line"), [
    ({}, ""),
    ({"torn_down": 0.012, "first_step": 0.4}, "group torn down +0.012 s, first step +0.400 s"),
])
def test_describe_timeline(timeline, line):
    assert describe_timeline(timeline) == line
