"""The dashboard's pure part: what one look at etcd found (:class:`Reading`, raw and untrusted)
becomes the page's JSON (:func:`job_view`) and the values of ``/metrics`` (:func:`job_metrics`).

Totals (recoveries, restarts spent, events by kind) come from the job's counters
(:mod:`elasticctl.job.counters`), never from the bounded history: a total recounted from it would
go down when the history forgets an old event. Label values come from closed sets (a node's state,
an event kind, a checkpoint error's kind), never from free text read from etcd.

No I/O and no clock here (``now`` comes in the reading), so every rule is testable with planted
bytes. A record that does not parse is skipped, a field of the wrong type reads as absent: a
malformed or hostile key can blank a cell, never break the page.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping, Sequence

from elasticctl.errors import ConfigError
from elasticctl.job.counters import JobCounters, total
from elasticctl.job.events import describe, parse_events
from elasticctl.job.records import (
    MEMBER_FIELDS,
    NODE_FIELDS,
    PROGRESS_FIELDS,
    Event,
    EventKind,
    MemberState,
    NodeState,
    ProgressSample,
    Round,
    typed_record,
)
from elasticctl.job.registry import spare_nodes, spares_expected
from elasticctl.job.snapshot import JobSnapshot
from elasticctl.job.spec import JobSpec, validate_name

# Seconds a time written by another host's clock may be ahead of (or before) ours and still count.
CLOCK_SKEW = 60.0


@dataclasses.dataclass(frozen=True)
class Reading:
    """One look at a job in etcd: the raw values, by node id where keys name a node."""

    job: str
    now: float
    nodes: Mapping[str, bytes] = dataclasses.field(default_factory=dict)  # nodes/<id>
    members: Mapping[str, bytes] = dataclasses.field(default_factory=dict)  # members/<id>
    heartbeats: Mapping[str, float] = dataclasses.field(default_factory=dict)  # seconds since a
    # node's lease was last renewed (granted TTL - remaining TTL)
    # The nodes/<id> keys bound to a lease (a node's record always is; None: not known). A key
    # written without one is not a live node's, whatever it says.
    leased_nodes: frozenset[str] | None = None
    progress: bytes | None = None
    events: Sequence[bytes] = ()  # history/events/, in key (= time) order
    samples: Sequence[bytes] = ()  # history/progress/, in key (= time) order
    spec: JobSpec | None = None  # validated when read; None: none, or unreadable
    generation: Round | None = None  # the workers' current generation (hot recovery)
    counters: Sequence[bytes] = ()  # history/counters/: the shards of the job's counters

    @classmethod
    def of(cls, snapshot: JobSnapshot, now: float) -> Reading:
        """The dashboard's look at ``snapshot`` (read with ``Part.DASHBOARD``) at time ``now``."""
        return cls(
            job=snapshot.job,
            now=now,
            nodes=snapshot.nodes,
            members=snapshot.members,
            heartbeats=snapshot.heartbeats,
            leased_nodes=frozenset(node for node, lease in snapshot.node_leases.items() if lease),
            progress=snapshot.progress,
            events=snapshot.events,
            samples=snapshot.samples,
            spec=snapshot.spec,
            generation=snapshot.generation,
            counters=snapshot.counters,
        )


def _valid_ids(records: Mapping[str, bytes], fields: dict) -> dict[str, dict]:
    """The typed records whose key is a valid node id (a planted ``a/b`` or empty one: skipped)."""
    typed = {}
    for node, raw in records.items():
        try:
            validate_name(node, "node id")
        except ConfigError:
            continue
        typed[node] = _bounded(typed_record(raw, fields))
    return typed


def _bounded(record: dict) -> dict:
    """``record`` without integers too large for a float: JSON allows any, but arithmetic with a
    time, a metric value or the browser's numbers would overflow or round."""
    return {k: v for k, v in record.items() if not isinstance(v, int) or abs(v) < 2**53}


def _progress(reading: Reading) -> dict:
    return (
        _bounded(typed_record(reading.progress, PROGRESS_FIELDS))
        if reading.progress is not None
        else {}
    )


def _current_round(members: Mapping[str, dict]) -> int | None:
    rounds = [
        m["round"]
        for m in members.values()
        if m.get("state") == MemberState.TRAINING and "round" in m
    ]
    return max(rounds) if rounds else None


def _state(node: dict, member: dict | None) -> str:
    """The node's state as `status` shows it: its rendezvous state while its process runs."""
    state = node.get("state", "?")
    if state == NodeState.RUNNING:
        return (member or {}).get("state", MemberState.JOINING.value)
    return state


def genuine_node(node: str, record: dict, leased: frozenset[str] | None, now: float) -> bool:
    """Whether a ``nodes/<node>`` record can be a live node's: the record a node registers names
    itself and its host, its key is bound to the node's lease (a key put without one outlives
    any process), and it joined before now."""
    joined = record.get("joined_at")
    return (
        record.get("id") == node
        and bool(record.get("host"))
        and (leased is None or node in leased)
        and (joined is None or 0 < joined <= now + CLOCK_SKEW)
    )


def stragglers(events: Sequence[Event]) -> dict[str, float]:
    """The nodes named stragglers now, with their ratio (events in time order): a ``straggler``
    event names one, ``straggler_cleared`` clears it, and so does a round formed after it (the
    workers measure each generation afresh and name a node again if it is still slow)."""
    named: dict[str, float] = {}
    for event in events:
        if event.kind is EventKind.ROUND_FORMED:
            named.clear()
        elif event.kind is EventKind.STRAGGLER and event.node and event.ratio is not None:
            named[event.node] = event.ratio
        elif event.kind is EventKind.STRAGGLER_CLEARED:
            named.pop(event.node, None)
    return named


def _live_nodes(reading: Reading) -> dict[str, dict]:
    return {
        node: record
        for node, record in _valid_ids(reading.nodes, NODE_FIELDS).items()
        if genuine_node(node, record, reading.leased_nodes, reading.now)
    }


def spares(reading: Reading) -> dict:
    """The hot spares as ``status`` counts them (:func:`elasticctl.job.registry.spare_nodes`):
    live nodes waiting warm beside a full world, how many the spec asks for (``--spares N``),
    and how many are missing (``short``: more expected than wait)."""
    waiting = (
        spare_nodes(reading.spec.max_nodes, _live_nodes(reading),
                    _valid_ids(reading.members, MEMBER_FIELDS), reading.generation)
        if reading.spec is not None
        else []
    )
    expected = spares_expected(reading.spec)
    return {"waiting": waiting, "expected": expected, "short": max(0, expected - len(waiting))}


def nodes_table(reading: Reading) -> list[dict]:
    """One row per live node (a genuine ``nodes/`` record, see :func:`genuine_node`), by id;
    ``state`` is ``spare`` for a node waiting warm beside a full world; ``straggler``: its step
    time over the others' while it is named a straggler, else None."""
    named = stragglers(_events(reading))
    nodes = _live_nodes(reading)
    members = _valid_ids(reading.members, MEMBER_FIELDS)
    waiting = set(spares(reading)["waiting"])
    rows = []
    for node, record in sorted(nodes.items()):
        member = members.get(node)
        age = reading.heartbeats.get(node)
        rows.append(
            {
                "id": node,
                "host": record.get("host"),
                "addr": record.get("addr"),
                "state": "spare" if node in waiting else _state(record, member),
                "rank": (member or {}).get("rank"),
                "round": (member or {}).get("round"),
                "gpus": record.get("gpus", 0),
                "restarts": (member or {}).get("restarts", 0),
                "heartbeat_age": None if age is None else max(0.0, round(age, 1)),
                "straggler": named.get(node),
            }
        )
    return rows


def job_lifetime(events: Sequence[Event], now: float) -> tuple[float, float]:
    """From when to when a time in the job's history can be: from the first ``node_joined``
    (an ``up`` or ``join`` registered; the earliest event if none is left) to now, each widened
    by :data:`CLOCK_SKEW`. Without events, anything up to now."""
    past = [e.time for e in events if e.time <= now + CLOCK_SKEW]
    joined = [e.time for e in events if e.kind is EventKind.NODE_JOINED and e.time <= now + CLOCK_SKEW]
    start = min(joined or past) - CLOCK_SKEW if (joined or past) else 0.0
    return start, now + CLOCK_SKEW


def samples_series(raws: Iterable[bytes], lifetime: tuple[float, float] | None = None) -> dict[str, list]:
    """The progress samples as columns for the charts: time, step, loss, steps/s, samples/s,
    world size. Steps/s is between a sample and the one before it; None for the first one and
    where the step went back (a restart resumed from an older checkpoint). Samples outside
    ``lifetime`` (start, end) are dropped: one with a wrong time (a clock of 1970, a planted key)
    would stretch the charts' time axis to it."""
    start, end = lifetime or (float("-inf"), float("inf"))
    samples = sorted(
        (s for s in map(ProgressSample.from_json, raws) if s is not None and start <= s.time <= end),
        key=lambda s: s.time,
    )
    columns: dict[str, list] = {
        name: [] for name in ("time", "step", "loss", "steps_per_s", "samples_per_s", "world_size")
    }
    previous: ProgressSample | None = None
    for sample in samples:
        rate = None
        if previous is not None and sample.time > previous.time and sample.step >= previous.step:
            rate = round((sample.step - previous.step) / (sample.time - previous.time), 4)
        for name, value in (
            ("time", sample.time),
            ("step", sample.step),
            ("loss", sample.loss),
            ("steps_per_s", rate),
            ("samples_per_s", sample.samples_per_s),
            ("world_size", sample.world_size),
        ):
            columns[name].append(value)
        previous = sample
    return columns


def world_series(events: Sequence[Event], lifetime: tuple[float, float] | None = None) -> dict[str, list]:
    """World size over time: a step at every ``round_formed`` that names one (within
    ``lifetime``, as for the samples)."""
    start, end = lifetime or (float("-inf"), float("inf"))
    formed = [e for e in events if e.kind is EventKind.ROUND_FORMED and e.world_size is not None
              and start <= e.time <= end]
    return {"time": [e.time for e in formed], "world_size": [e.world_size for e in formed]}


def totals(counters: JobCounters) -> dict:
    """What the recoveries cost over the job's life: their count and seconds (``recovery_finished``:
    each from the first fault or change to the first training step after it; ``round_formed``'s
    duration is only the rendezvous part of that, so it is not added), restarts spent
    (``failure_judged`` that charged one). From the job's counters, not its bounded history."""
    return {
        "recoveries": counters.recoveries,
        "recovery_seconds": round(counters.recovery_seconds, 3),
        "restarts_spent": counters.restarts_spent,
    }


def _events(reading: Reading) -> list[Event]:
    return sorted(parse_events(reading.events), key=lambda e: e.time)


def newest_checkpoint(events: Sequence[Event], now: float) -> dict | None:
    """The newest ``checkpoint_written`` (events in time order): its step, how long ago it was
    committed, how long its write took; None if the history has none."""
    written = [e for e in events if e.kind is EventKind.CHECKPOINT_WRITTEN]
    if not written:
        return None
    newest = written[-1]
    return {
        # a step too large for a float would round in the browser and in a metric value
        "step": newest.step if newest.step is not None and newest.step < 2**53 else None,
        "age": _age(now, newest.time),
        "duration": newest.duration,
    }


def event_row(event: Event) -> dict:
    """An event for the page: any kind, shown generically as its kind and its details."""
    row = {
        "time": event.time,
        "kind": event.kind.value,
        "node": event.node,
        "text": describe(event),
    }
    if event.world_size is not None:
        row["world_size"] = event.world_size
    if event.step is not None and event.step < 2**53:
        row["step"] = event.step
    return row


def job_view(reading: Reading) -> dict:
    """The page's JSON (``/api/job``)."""
    events = _events(reading)
    members = _valid_ids(reading.members, MEMBER_FIELDS)
    current = _current_round(members)
    progress = _progress(reading)
    nodes = nodes_table(reading)
    lifetime = job_lifetime(events, reading.now)
    return {
        "job": reading.job,
        "now": reading.now,
        "round": current,
        "world_size": _world_size(members, current),
        "live_nodes": len(nodes),
        "nodes": nodes,
        "spares": spares(reading),
        "progress": progress or None,
        "progress_age": _age(reading.now, (progress or {}).get("time")),
        "checkpoint": newest_checkpoint(events, reading.now),
        "samples": samples_series(reading.samples, lifetime),
        "world": world_series(events, lifetime),
        "events": [event_row(e) for e in reversed(events)],  # newest first
        "totals": totals(total(reading.counters)),
    }


def _world_size(members: Mapping[str, dict], current: int | None) -> int:
    return sum(
        1
        for m in members.values()
        if current is not None
        and m.get("round") == current
        and m.get("state") == MemberState.TRAINING
    )


def _age(now: float, then: float | None) -> float | None:
    return None if then is None else max(0.0, round(now - then, 3))


class CheckpointErrorKind(str, enum.Enum):
    """Why checkpoint writes fail, as a metric label: a closed set, so an error's text (a path, a
    message from the file system, anything written in etcd) never becomes a label value."""

    DISK_FULL = "disk_full"    # no space left, or the quota exhausted: free space, or move the directory
    PERMISSION = "permission"  # the storage refuses writes: permissions, ownership, a read-only mount
    OTHER = "other"            # anything else: `elasticctl status` quotes the sentence


# What the checkpointer's sentence says, for each kind: its own words for the storage's state
# (elasticctl.train.checkpoints.files.write_failure_reason) and the system's (strerror), lower case.
_ERROR_WORDS = (
    (CheckpointErrorKind.DISK_FULL, ("the disk is full", "no space left on device", "the disk quota is exhausted",
                                     "disk quota exceeded")),
    (CheckpointErrorKind.PERMISSION, ("permission denied", "operation not permitted", "the file system is read-only",
                                      "read-only file system", "is not readable and writable by this user")),
)


def checkpoint_error_kind(error: str) -> CheckpointErrorKind:
    """The kind of a checkpoint failure, from its sentence (``Writing the checkpoint of step N to
    'DIR' failed: REASON.``): only the reason is read, so a directory whose name holds such words
    does not decide it."""
    _, failed, reason = error.rpartition(" failed: ")
    said = (reason if failed else error).lower()
    for kind, words in _ERROR_WORDS:
        if any(word in said for word in words):
            return kind
    return CheckpointErrorKind.OTHER


# The values of the `state` label of the nodes by state: what a node's records can say, and
# `spare`; a state no version of elasticctl writes (a planted record) counts as `unknown`.
NODE_STATES = frozenset({*(s.value for s in NodeState), *(s.value for s in MemberState), "spare", "unknown"})


def state_label(state: str) -> str:
    return state if state in NODE_STATES else "unknown"


@dataclasses.dataclass(frozen=True)
class JobMetrics:
    """The values ``/metrics`` exposes for one job (None: not known, the metric is left out)."""

    world_size: int
    round: int | None
    nodes_by_state: dict[str, int]  # by :func:`state_label`
    counters: JobCounters  # the job's totals for its life: recoveries, restarts, events by kind
    steps_per_s: float | None
    samples_per_s: float | None
    step: int | None
    loss: float | None
    last_checkpoint_step: int | None
    progress_age: float | None
    last_checkpoint_age: float | None = None  # the newest checkpoint_written event
    checkpoint_write_seconds: float | None = None  # that event's write duration
    checkpoint_failures: int | None = None  # writes failed in a row (0: the newest succeeded)
    checkpoint_error: CheckpointErrorKind | None = None  # the newest failure's kind while they fail
    # From the job's spec (None without one: a plain torchrun job, or after `down`)
    nnodes_min: int | None = None
    nnodes_max: int | None = None
    restart_budget: int | None = None  # per node; None: the handler keeps none
    # Restarts each live node's own failures spent, from its member record
    node_restarts: dict[str, int] = dataclasses.field(default_factory=dict)
    # Member records that say the node's workers finished the script: a finished run's last
    # word, kept on the run lease (``ttl``) after its processes are gone
    finished_nodes: int = 0
    # Live nodes named stragglers now: their step time over the others' median
    straggler_ratios: dict[str, float] = dataclasses.field(default_factory=dict)
    spares: int = 0  # live nodes waiting warm beside a full world (hot spares)
    spares_expected: int | None = None  # the spec's --spares N (None without a spec)

    @property
    def restarts_spent(self) -> int:
        return self.counters.restarts_spent

    @property
    def recoveries(self) -> int:
        return self.counters.recoveries

    @property
    def recovery_seconds(self) -> float:
        return self.counters.recovery_seconds

    @property
    def recovery_buckets(self) -> tuple[tuple[float, int], ...]:
        """(upper bound, cumulative count), +Inf last."""
        return self.counters.histogram()

    @property
    def straggler_events(self) -> int:
        """Nodes named (or evicted as) stragglers over the job's life."""
        return self.counters.count(EventKind.STRAGGLER)

    @property
    def node_refused_events(self) -> int:
        """Nodes an admission check refused (other code, a bad GPU, a failed --check) over the job's life."""
        return self.counters.count(EventKind.NODE_REFUSED)

    @property
    def replica_diverged_events(self) -> int:
        """Replicas found to differ from their set's majority (or sets with none) over the job's life."""
        return self.counters.count(EventKind.REPLICA_DIVERGED)

    @property
    def non_finite_events(self) -> int:
        """Runs of steps whose gradients were not finite (each named at its first step) over the job's life."""
        return self.counters.count(EventKind.NON_FINITE)


def job_metrics(reading: Reading) -> JobMetrics:
    """The metric values of a reading: from the same parsed records as the page."""
    events = _events(reading)
    members = _valid_ids(reading.members, MEMBER_FIELDS)
    current = _current_round(members)
    by_state: dict[str, int] = {}
    node_restarts: dict[str, int] = {}
    straggler_ratios: dict[str, float] = {}
    for row in nodes_table(reading):
        state = state_label(row["state"])
        by_state[state] = by_state.get(state, 0) + 1
        node_restarts[row["id"]] = row["restarts"]
        if row["straggler"] is not None:
            straggler_ratios[row["id"]] = row["straggler"]
    progress = _progress(reading)
    rates = [r for r in samples_series(reading.samples, job_lifetime(events, reading.now))["steps_per_s"]
             if r is not None]
    checkpoint = newest_checkpoint(events, reading.now) or {}
    error = progress.get("checkpoint_error")
    spec = reading.spec
    return JobMetrics(
        world_size=_world_size(members, current),
        round=current,
        nodes_by_state=by_state,
        counters=total(reading.counters),
        steps_per_s=rates[-1] if rates else None,
        samples_per_s=progress.get("samples_per_s"),
        step=progress.get("step"),
        loss=progress.get("loss"),
        last_checkpoint_step=progress.get("last_checkpoint_step"),
        progress_age=_age(reading.now, progress.get("time")),
        last_checkpoint_age=checkpoint.get("age"),
        checkpoint_write_seconds=checkpoint.get("duration"),
        checkpoint_failures=progress.get("checkpoint_failures", 0) if progress else None,
        checkpoint_error=checkpoint_error_kind(error) if error else None,
        nnodes_min=spec.min_nodes if spec else None,
        nnodes_max=spec.max_nodes if spec else None,
        restart_budget=spec.restart_budget if spec else None,
        node_restarts=node_restarts,
        finished_nodes=sum(1 for m in members.values() if m.get("state") == MemberState.DONE),
        straggler_ratios=straggler_ratios,
        spares=by_state.get("spare", 0),
        spares_expected=spares_expected(spec) if spec else None,
    )
