"""Everything a worker tells others about its run, in one place: the script's ``on_event``, the
job's event history (written on its own thread: the training thread never waits for etcd), the
progress record (rank 0), a recovery's timeline (its phases marked as they end, reported at the
generation's first step), and the requests that another node leave (the watches' verdicts)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from elasticctl.errors import ElasticctlError
from elasticctl.job.environment import WorkerEnvironment
from elasticctl.job.records import EventKind
from elasticctl.train.group import Group
from elasticctl.train.recovery.timeline import describe_timeline, recovery_timeline

log = logging.getLogger(__name__)


class Reporter:
    """Worker ``worker`` of node ``node``; ``on_event(kind, **fields)``: the script's (None: none)."""

    def __init__(self, environment: WorkerEnvironment, *, worker: str, node: str,
                 on_event: Callable[..., object] | None, recoveries_in_progress: bool) -> None:
        self.environment = environment
        self.worker = worker
        self.node = node
        self._on_event = on_event
        self._recoveries_in_progress = recoveries_in_progress
        # The job's event history (False: not under elasticctl), made here and not on first use:
        # the watchdog thread records too, and must not race the training thread to create it.
        from elasticctl.job.events import EventLog

        self._events: Any = EventLog.from_env(environment) or False
        self._progress: Any = None
        self._registry: Any = None
        self._samples_since = (time.monotonic(), 0)
        self._recovery_marks: dict[str, float] = {}  # phase -> wall time it ended (train/recovery/timeline.py)
        # When the fault or change this generation recovers from was noticed; cleared once its
        # first step is recorded (None: the generation ends no recovery, or it is recorded).
        self._recovering_since: float | None = None

    # -- to the script and the history -----------------------------------------------------

    def emit(self, kind: str, **fields: Any) -> None:
        if self._on_event is not None:
            self._on_event(kind, **fields)

    def record(self, kind: EventKind, node: str | None = None, **fields) -> None:
        """Record an event of ``node`` (default: this worker's; "": the job's own) on the event
        writer thread."""
        if self._events:
            self._events.record_later(kind, self.node if node is None else node, **fields)

    def request_leave(self, node: str) -> None:
        """Ask ``node`` to leave as ``elasticctl leave`` does, on the event writer thread."""
        if self._registry is None:
            from elasticctl.job.registry import Registry

            self._registry = Registry.from_environment(self.environment) or False
        if not self._registry or not self._events:
            log.warning("[%s] cannot ask %s to leave: not under elasticctl", self.worker, node)
            return
        registry = self._registry

        def request() -> None:
            try:
                registry.request_leave(node)
            except ElasticctlError as exc:
                log.warning("[%s] could not ask %s to leave: %s", self.worker, node, exc)

        self._events.later(request)

    # -- a recovery's timeline ---------------------------------------------------------------

    def generation_ends(self) -> None:
        self._recovery_marks = {}

    def mark_recovery(self, phase: str) -> None:
        """The wall time a phase of the recovery in progress ended (the membership marks its own;
        a phase repeated by a second attempt to form keeps its last time)."""
        self._recovery_marks[phase] = time.time()

    def generation_formed(self, group: Group, noticed_at: float | None, records_generations: bool) -> None:
        """Generation ``group`` formed, ending the recovery from what was noticed at ``noticed_at``
        (None: it ends none); rank 0 records it where the workers agree generations themselves."""
        if group.rank == 0:
            self._progress_publisher()
            if records_generations:
                duration = None if noticed_at is None else round(time.time() - noticed_at, 3)
                self.record(EventKind.ROUND_FORMED, round=group.number, members=group.members,
                            world_size=group.world_size, duration=duration, reason="workers' generation (hot)")
        self._recovering_since = noticed_at
        self._samples_since = (time.monotonic(), 0)

    def first_step(self, group: Group, step: int) -> None:
        """The first step of a generation formed after a fault or change ends that recovery: its
        timeline goes to the script (every rank) and, from rank 0, to the job's history."""
        if self._recovering_since is None:
            return
        noticed, self._recovering_since = self._recovering_since, None
        self.mark_recovery("first_step")
        timeline = recovery_timeline(noticed, self._recovery_marks)
        self.emit("recovery_timeline", round=group.number, noticed=noticed, **timeline)
        if group.rank == 0:
            self.record(EventKind.RECOVERY_FINISHED, round=group.number, world_size=group.world_size,
                        step=step, duration=round(time.time() - noticed, 3), reason=describe_timeline(timeline))

    # -- progress ----------------------------------------------------------------------------

    def publishes_progress(self, group: Group) -> bool:
        """Whether this worker publishes the progress record (rank 0 under elasticctl): the other
        ranks skip gathering its fields at every step."""
        return self._progress is not None and group.rank == 0

    def progress(self, group: Group, samples: int, **fields: Any) -> None:
        """Rank 0's progress record at a step boundary (``fields``: step, epoch, loss, the
        checkpoint's), with the samples per second since the generation began."""
        if not self.publishes_progress(group):
            return
        began, count = self._samples_since
        count += samples * group.world_size
        self._samples_since = (began, count)
        elapsed = time.monotonic() - began
        self._progress.publish(samples_per_s=count / elapsed if elapsed > 0 and count else None,
                               world_size=group.world_size, **fields)

    def _progress_publisher(self) -> None:
        if self._progress is None:
            from elasticctl.job.progress import ProgressPublisher

            self._progress = ProgressPublisher.from_env(0, recoveries=self._recoveries_in_progress,
                                                        environment=self.environment)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()
        if self._events:  # False: not under elasticctl
            self._events.flush(5.0)
