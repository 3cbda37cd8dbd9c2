"""A job's counters: totals of its events for the life of the job, for Prometheus.

The event history is bounded (a write past its bound deletes the oldest events), so a total
recounted from it goes down when an old event is forgotten, and a counter that goes down reads as
a reset to Prometheus (its ``rate()`` and ``increase()`` jump). So each event adds to totals kept
beside the history instead, as it is recorded (:meth:`elasticctl.job.events.EventLog.record`,
which updates them by compare-and-swap), and nothing ever recounts them.

They are kept in shards, one per node the events are about (``history/counters/<node>``, ``_``
for the job's own events: :meth:`JobKeys.counter_shard`), bound to the history's lease: two nodes
recording at once never contend for one key, and a reader adds the shards up (:func:`total`).

What an event adds is decided here by a pure function (:meth:`JobCounters.add`); a shard read
back from etcd is untrusted and validated here (:meth:`JobCounters.from_json`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

from elasticctl.job.records import Event, EventKind, json_object, record_json

# Upper bounds (seconds) of the recovery-time histogram: from a free in-place re-form to a slow
# restart with a checkpoint load. A stored shard names its bounds, so changing them here reads
# the old shards' buckets as empty (never as a histogram that breaks its rules).
RECOVERY_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)

# A count or a sum past this is not one a job reached: a planted value, read as absent. (Below
# 2**53 every whole number is exact as a float, in a metric value and in the browser.)
MAX_TOTAL = 2**53


@dataclasses.dataclass(frozen=True)
class JobCounters:
    """Totals of a job's events (one shard's, or the sum of all of them: :func:`total`)."""

    events: Mapping[EventKind, int] = dataclasses.field(default_factory=dict)  # recorded, by kind
    restarts_spent: int = 0  # failure_judged events that charged a restart
    recoveries: int = 0  # recovery_finished events with a duration
    recovery_seconds: float = 0.0  # their durations, summed
    # Recoveries that took at most each bound of RECOVERY_BUCKETS (cumulative, as Prometheus's le)
    recovery_buckets: tuple[int, ...] = (0,) * len(RECOVERY_BUCKETS)

    def count(self, kind: EventKind) -> int:
        return self.events.get(kind, 0)

    def add(self, event: Event) -> JobCounters:
        """These totals with ``event`` counted."""
        events = {**self.events, event.kind: self.count(event.kind) + 1}
        restarts = self.restarts_spent + (event.kind is EventKind.FAILURE_JUDGED and event.charged is True)
        if event.kind is not EventKind.RECOVERY_FINISHED or event.duration is None:
            return dataclasses.replace(self, events=events, restarts_spent=restarts)
        # A writer's clock stepping back can make a duration negative: a histogram's sum must
        # not go down, so such a recovery counts as taking no time.
        seconds = max(0.0, event.duration)
        return dataclasses.replace(
            self, events=events, restarts_spent=restarts, recoveries=self.recoveries + 1,
            recovery_seconds=self.recovery_seconds + seconds,
            recovery_buckets=tuple(n + (seconds <= bound) for n, bound in zip(self.recovery_buckets, RECOVERY_BUCKETS)),
        )

    def __add__(self, other: JobCounters) -> JobCounters:
        return JobCounters(
            events={kind: self.count(kind) + other.count(kind) for kind in {*self.events, *other.events}},
            restarts_spent=self.restarts_spent + other.restarts_spent,
            recoveries=self.recoveries + other.recoveries,
            recovery_seconds=self.recovery_seconds + other.recovery_seconds,
            recovery_buckets=tuple(a + b for a, b in zip(self.recovery_buckets, other.recovery_buckets)),
        )

    def histogram(self) -> tuple[tuple[float, int], ...]:
        """The recovery histogram as Prometheus has it: (upper bound, cumulative count), +Inf last."""
        return (*zip(RECOVERY_BUCKETS, self.recovery_buckets), (math.inf, self.recoveries))

    def to_json(self) -> str:
        return record_json({
            "events": {kind.value: n for kind, n in sorted(self.events.items()) if n},
            "restarts_spent": self.restarts_spent,
            "recoveries": self.recoveries,
            "recovery_seconds": self.recovery_seconds,
            "recovery_buckets": {repr(bound): n for bound, n in zip(RECOVERY_BUCKETS, self.recovery_buckets)},
        })

    @classmethod
    def from_json(cls, raw: bytes | None) -> JobCounters:
        """The shard in ``raw`` (untrusted; None: none yet). Each field is checked on its own and
        one that is malformed reads as 0; an event kind this version does not know is dropped;
        recovery buckets that break a histogram's rules (not one per bound, not cumulative, more
        than the recoveries) read as empty."""
        data = json_object(raw) if raw is not None else {}
        events = data.get("events")
        known = {kind.value: kind for kind in EventKind}
        counted = {known[name]: n for name, n in (events.items() if isinstance(events, dict) else ())
                   if name in known and _count(n)}
        recoveries = data.get("recoveries") if _count(data.get("recoveries")) else 0
        seconds = data.get("recovery_seconds")
        seconds = float(seconds) if _count(seconds, (int, float)) else 0.0
        return cls(
            events=counted,
            restarts_spent=data.get("restarts_spent") if _count(data.get("restarts_spent")) else 0,
            recoveries=recoveries,
            recovery_seconds=seconds,
            recovery_buckets=_buckets(data.get("recovery_buckets"), recoveries),
        )


def _count(value: object, kind: type | tuple[type, ...] = int) -> bool:
    """A JSON number of ``kind`` (never a bool) from 0 to :data:`MAX_TOTAL`, finite."""
    return (not isinstance(value, bool) and isinstance(value, kind)
            and math.isfinite(value) and 0 <= value < MAX_TOTAL)


def _buckets(stored: object, recoveries: int) -> tuple[int, ...]:
    empty = (0,) * len(RECOVERY_BUCKETS)
    if not isinstance(stored, dict):
        return empty
    counts = [stored.get(repr(bound)) for bound in RECOVERY_BUCKETS]
    if not all(_count(n) for n in counts):
        return empty
    cumulative = all(a <= b for a, b in zip(counts, counts[1:])) and counts[-1] <= recoveries
    return tuple(counts) if cumulative else empty


def total(shards: Iterable[bytes]) -> JobCounters:
    """The job's totals: its shards (raw, untrusted) added up."""
    result = JobCounters()
    for raw in shards:
        result = result + JobCounters.from_json(raw)
    return result


def shard_of(event: Event) -> str:
    """Which shard counts ``event``: the node it is about (``_``, which no node id can be, for
    the job's own)."""
    return event.node or "_"
