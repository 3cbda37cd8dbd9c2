"""A job's event history in etcd: written best-effort by whichever component knows, read by ``events``.

Each event is one key under ``history/events/`` (:meth:`JobKeys.event`: the time in
microseconds, zero-padded, so key order is time order), holding an
:class:`~elasticctl.job.records.Event`. The history is bounded: a write that takes it
over ``max_events`` deletes the oldest. Every event is bound to one shared lease
(its id under ``history/lease``) with a long TTL, renewed by every write and by every
live node (:meth:`EventLog.keep_alive`): the history expires ``EVENTS_TTL`` seconds
after the job's last node and last event, and survives ``elasticctl down`` until then.

Each event recorded also adds to the job's counters (:mod:`elasticctl.job.counters`), by
compare-and-swap on the shard of the node it is about: totals that the history's bound never
makes go down, for Prometheus.

Writing never raises: an etcd error is logged and the event is lost, so a history
problem can never stop a node or its agent.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from elasticctl.errors import ElasticctlError
from elasticctl.etcd.client import EtcdClient
from elasticctl.etcd.watch import PrefixWatch
from elasticctl.job.counters import JobCounters, shard_of, total
from elasticctl.job.environment import WorkerEnvironment
from elasticctl.job.history import HISTORY_TTL, HistoryLease, trim_oldest
from elasticctl.job.keys import JobKeys
from elasticctl.job.records import Event, EventKind

log = logging.getLogger(__name__)

MAX_EVENTS = 1000
# Compare-and-swap tries to add an event to its counter shard. A shard is written by the writers
# of one node's events only, so a conflict is rare; writers that do race back off for a random
# time that grows with each conflict, so that none of them starves.
COUNT_ATTEMPTS = 50
COUNT_BACKOFF = 0.002  # seconds: the mean wait after the first conflict, then 2x, 3x ... (at most 50 ms)
EVENTS_TTL = HISTORY_TTL  # seconds the history outlives its job's last writer

# Frequent events, kept to a tenth of the history so that they never push the membership
# changes and faults out of it.
ROUTINE = frozenset({EventKind.CHECKPOINT_WRITTEN})

# Events that start a recovery: the first of them after a round formed, to the next round formed.
RECOVERY_TRIGGERS = frozenset({EventKind.WORKERS_FAILED, EventKind.MEMBER_LOST, EventKind.NODE_WAITING,
                               EventKind.LEAVE_REQUESTED, EventKind.QUARANTINED, EventKind.OVER_BUDGET})


class EventLog:
    """Writes and reads the events of the job whose keys are ``keys``."""

    def __init__(self, client: EtcdClient, keys: JobKeys, max_events: int = MAX_EVENTS,
                 ttl: int = EVENTS_TTL) -> None:
        self._client = client
        self._keys = keys
        self._max_events = max_events
        self._ttl = ttl
        self._lock = threading.Lock()
        self._shared = HistoryLease(client, keys.events_lease, ttl)
        self._later: queue.SimpleQueue[Callable[[], object] | None] | None = None
        self._writer: threading.Thread | None = None

    # -- writing -------------------------------------------------------------------------

    def record(self, kind: EventKind, node: str = "", at: float | None = None, **fields) -> Event | None:
        """Write an event (at ``at``, default now); the event, or None if etcd refused it (logged)."""
        event = Event(time=round(time.time() if at is None else at, 6), kind=kind, node=node, **fields)
        try:
            self._put(event)
            try:
                self._count(event)
            except ElasticctlError as exc:  # the event is recorded; only the totals missed it
                log.warning("cannot count the event %s of node %s: %s", kind.value, node or "-", exc)
            self._trim(kind)
        except ElasticctlError as exc:
            log.warning("cannot record the event %s of node %s: %s", kind.value, node or "-", exc)
            return None
        return event

    def record_later(self, kind: EventKind, node: str = "", **fields) -> None:
        """Record an event timed now, on this log's writer thread (in order, never blocking the
        caller: for the recovery path). A daemon thread: what is queued at exit is lost."""
        at = time.time()
        self.later(lambda: self.record(kind, node, at=at, **fields))

    def later(self, action: Callable[[], object]) -> None:
        """Run ``action`` on this log's writer thread, after what was queued before it."""
        with self._lock:
            if self._later is None:
                self._later = queue.SimpleQueue()
                self._writer = threading.Thread(target=self._write_later, args=(self._later,),
                                                name="elasticctl-history", daemon=True)
                self._writer.start()
            self._later.put(action)

    @staticmethod
    def _write_later(actions: queue.SimpleQueue) -> None:
        while (action := actions.get()) is not None:  # None: close() asked the writer to end
            try:
                action()
            except Exception:  # the history must never take its writer down
                log.exception("cannot record an event")

    def close(self, timeout: float) -> bool:
        """Write what is queued (up to ``timeout`` s), then end the writer thread; whether it
        ended. A later :meth:`later` starts a new writer."""
        with self._lock:
            actions, writer = self._later, self._writer
            self._later = self._writer = None
        if actions is None or writer is None:
            return True
        actions.put(None)
        writer.join(timeout)
        return not writer.is_alive()

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for what was queued with :meth:`later`; whether it all ran."""
        done = threading.Event()
        self.later(done.set)
        return done.wait(timeout)

    @classmethod
    def from_env(cls, environment: WorkerEnvironment | None = None) -> EventLog | None:
        """The event history of this worker's job, or None outside elasticctl. ``environment``:
        the worker's, if it decoded it already."""
        environment = environment or WorkerEnvironment.from_env()
        settings = environment.etcd_settings(retry_timeout=5.0)
        return None if settings is None else cls(EtcdClient(settings), environment.job_keys())

    def record_recovery_finished(self, node: str, at: float, **fields) -> Event | None:
        """A first step at ``at``: if it ends a recovery (the newest round formed before it was not
        the job's first), record how long that took from its first fault or change."""
        try:
            history = self.read()
        except ElasticctlError as exc:
            log.warning("cannot read the event history: %s", exc)
            return None
        formed = [e for e in history if e.kind is EventKind.ROUND_FORMED and e.time <= at]
        started = recovery_start(history, formed[-1].time) if formed else None
        if started is None:
            return None
        return self.record(EventKind.RECOVERY_FINISHED, node, round=formed[-1].round,
                           duration=round(at - started, 3), **fields)

    def keep_alive(self) -> None:
        """Renew the history's lease (a live node calls this now and then); errors are logged."""
        try:
            self._shared.renew()
        except ElasticctlError as exc:
            log.warning("cannot renew the event history's lease: %s", exc)

    def _put(self, event: Event) -> None:
        self._shared.put(self._keys.event(event.time, event.node, event.kind.value), event.to_json())

    def _count(self, event: Event) -> JobCounters:
        """Add ``event`` to its counter shard, by compare-and-swap; the shard's new totals."""
        key = self._keys.counter_shard(shard_of(event))
        current = self._client.get(key)
        for attempt in range(1, COUNT_ATTEMPTS + 1):
            counters = JobCounters.from_json(None if current is None else current.value).add(event)
            revision = 0 if current is None else current.mod_revision
            ok, current, _ = self._shared.bound(lambda lease, revision=revision, counters=counters:
                                                self._client.compare_and_swap(key, counters.to_json(), revision,
                                                                              lease=lease))
            if ok:
                return counters
            time.sleep(random.uniform(0, 2 * min(COUNT_BACKOFF * attempt, 0.025)))  # a backoff, not a wait for anything
        raise ElasticctlError(f"The counters of job {self._keys.job} kept changing under {COUNT_ATTEMPTS} tries "
                              f"to count the event {event.kind.value}.")

    def _trim(self, kind: EventKind) -> None:
        if kind in ROUTINE:
            suffix = f"-{kind.value}".encode()
            routine = [key for key in self._client.keys_prefix(self._keys.events) if key.endswith(suffix)]
            for key in routine[:max(0, len(routine) - self._max_events // 10)]:
                self._client.delete(key)
        trim_oldest(self._client, self._keys.events, self._max_events)

    # -- reading -------------------------------------------------------------------------

    def read(self, since: float | None = None) -> list[Event]:
        """The events in time order (from ``since``, epoch seconds); malformed ones are skipped."""
        return [e for e in parse_events(kv.value for kv in self._client.get_prefix(self._keys.events))
                if since is None or e.time >= since]


def read_counters(client: EtcdClient, keys: JobKeys) -> JobCounters:
    """The job's counters: its shards added up (:func:`elasticctl.job.counters.total`)."""
    return total(kv.value for kv in client.get_prefix(keys.counters))


def event_records(client: EtcdClient, keys: JobKeys) -> list[tuple[bytes, bytes]]:
    """The job's history as stored: (key, raw event) in key order, which is time order."""
    return [(kv.key, kv.value) for kv in client.get_prefix(keys.events)]


def follow_events(client: EtcdClient, keys: JobKeys,
                  show: Callable[[Iterable[tuple[bytes, bytes]]], None]) -> PrefixWatch:
    """A watch of the job's history, to ``start()``: ``show`` gets the (key, raw event) pairs there
    are, then each new or rewritten one as it is written (deletions, the history's trimming, are
    not news)."""

    class Follow(PrefixWatch):
        def _load(self, kvs, revision) -> None:
            show((kv.key, kv.value) for kv in kvs)

        def _apply(self, response) -> None:
            show((e.key, e.value) for e in response.events if type(e).__name__ != "DeleteEvent")

    return Follow(client, keys.events)


def parse_events(raws: Iterable[bytes]) -> Iterator[Event]:
    for raw in raws:
        event = Event.from_json(raw)
        if event is not None:
            yield event


def recovery_start(events: Iterable[Event], formed_at: float) -> float | None:
    """When the recovery that ends with a round formed at ``formed_at`` began: the first fault or
    change event after the previous round formed. None without a previous round (the job's start)
    or without such an event."""
    previous: float | None = None
    first: float | None = None
    for event in events:
        if event.time >= formed_at:
            break
        if event.kind is EventKind.ROUND_FORMED:
            previous, first = event.time, None
        elif previous is not None and first is None and event.kind in RECOVERY_TRIGGERS:
            first = event.time
    return first


def describe(event: Event) -> str:
    """The details of an event in a few words (no time, kind or node)."""
    parts = []
    if event.round is not None:
        parts.append(f"round {event.round}")
    if event.world_size is not None:
        parts.append(f"world size {event.world_size}")
    if event.members:
        parts.append("members " + ",".join(event.members))
    if event.charged is not None:
        parts.append("restart spent" if event.charged else "no restart spent")
    if event.step is not None:
        parts.append(f"step {event.step}")
    if event.ratio is not None:
        parts.append(f"{event.ratio:.2f}x the others' step time")
    if event.duration is not None:
        parts.append(f"took {event.duration:.2f} s")
    if event.reason:
        parts.append(" ".join(event.reason.split()))
    return "; ".join(parts)


def render_line(event: Event) -> str:
    """One line: local time, kind, node, details."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event.time)) + f".{int(event.time * 1000) % 1000:03d}"
    return f"{stamp}  {event.kind.value:<17} {event.node or '-':<16} {describe(event)}".rstrip()
