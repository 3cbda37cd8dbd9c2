"""The event history: records, the bounded lease-bound log in a real etcd, `elasticctl events`,
and the events a real job writes when a node is killed, one joins and one leaves.

Every wait is on etcd keys, the trainer's JSON record or a command's output line, never a sleep.

Layer tests/unit: no etcd, no processes. The other tests of this subject:
tests/contract/test_events_log.py, tests/process/test_events.py.
"""

from __future__ import annotations

import pytest

from elasticctl.job.events import render_line
from elasticctl.job.records import Event, EventKind


# -- records -------------------------------------------------------------------------------


def test_an_event_round_trips_and_renders_on_one_line():
    event = Event(time=1700000000.25, kind=EventKind.ROUND_FORMED, node="a", round=3, members=("a", "b"),
                  world_size=2)
    assert Event.from_json(event.to_json().encode()) == event
    judged = Event(time=1.0, kind=EventKind.FAILURE_JUDGED, node="b", round=2, charged=False,
                   reason="lost c\nat once")
    assert Event.from_json(judged.to_json().encode()) == judged
    line = render_line(judged)
    assert "\n" not in line and "failure_judged" in line and "no restart spent" in line and "lost c at once" in line


@pytest.mark.parametrize("raw", [
    b"", b"null", b"[]", b"{", b'{"time": 1}', b'{"kind": "round_formed"}',
    b'{"time": 1, "kind": "nope"}', b'{"time": "1", "kind": "round_formed"}',
    b'{"time": true, "kind": "round_formed"}', b'{"time": -1, "kind": "round_formed"}',
    b'{"time": 1, "kind": "round_formed", "node": "../x"}',
    b'{"time": 1, "kind": "round_formed", "members": ["a", "a/b"]}',
    b'{"time": 1, "kind": "round_formed", "members": "ab"}',
    b'{"time": 1, "kind": "round_formed", "round": -2}',
    b'{"time": 1, "kind": "round_formed", "world_size": 1.5}',
    b'{"time": 1, "kind": "failure_judged", "charged": 1}',
    b'{"time": 1, "kind": "recovery_finished", "duration": -3}',
    b'{"time": 1, "kind": "recovery_finished", "duration": "3"}',
    b'{"time": 1, "kind": "job_down", "reason": 5}',
    b'{"time": 1e300, "kind": "job_down"}',
])
def test_malformed_events_read_as_none(raw):
    assert Event.from_json(raw) is None
