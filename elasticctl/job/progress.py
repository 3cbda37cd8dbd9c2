"""Training progress in etcd, for ``elasticctl status``.

Global rank 0 writes one JSON document to ``{prefix}/{job}/progress``: step,
epoch, loss, samples_per_s, world_size, last_checkpoint_step, time (unix), rank, and while
checkpoints fail, checkpoint_error (the newest failure's sentence) and checkpoint_failures.
Writes happen on a background thread, at most one per ``interval`` seconds,
with only the newest update kept: an etcd that is slow or away costs training
nothing (the update is dropped with a warning). Outside elasticctl (its worker environment
names no etcd or job: :mod:`elasticctl.job.environment`) every call is a no-op.

Given the job's keys, the same thread also appends a
:class:`~elasticctl.job.records.ProgressSample` (time, step, loss, samples_per_s,
world_size) to ``history/progress/`` at most every ``sample_interval`` seconds,
keeping the newest ``max_samples``, bound to the history's shared lease: the
dashboard draws its curves from them and keeps no state of its own.
"""

from __future__ import annotations

import json
import logging
import threading
import time

from elasticctl.job.environment import WorkerEnvironment
from elasticctl.job.history import HistoryLease, trim_oldest
from elasticctl.job.keys import JobKeys
from elasticctl.job.records import ProgressSample

log = logging.getLogger(__name__)

SAMPLE_INTERVAL = 2.0  # seconds between samples of the progress series
MAX_SAMPLES = 1800     # an hour of samples at that interval

class ProgressPublisher:
    """Publishes the newest progress update in the background; see the module docstring."""

    def __init__(self, client, key: str, rank: int = 0, interval: float = 1.0, keys: JobKeys | None = None,
                 sample_interval: float = SAMPLE_INTERVAL, max_samples: int = MAX_SAMPLES, events=None,
                 node: str = "") -> None:
        self.client = client
        self._events = events  # EventLog: this process's first step may end a recovery
        self._first_step = events is not None
        self._node = node
        self.key = key
        self.rank = rank
        self.interval = interval
        self.keys = keys  # None: no progress series
        self.sample_interval = sample_interval
        self.max_samples = max_samples
        self._lease = None if keys is None else HistoryLease(client, keys.events_lease)
        self._pending: dict | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="elasticctl-progress", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, rank: int, interval: float = 1.0, recoveries: bool = True,
                 environment: WorkerEnvironment | None = None) -> ProgressPublisher | None:
        """A publisher for global rank 0 under elasticctl; None anywhere else. ``recoveries``:
        the first update records the recovery it ends (the hot-recovery runtime does its own).
        ``environment``: the worker's, if it decoded it already."""
        environment = environment or WorkerEnvironment.from_env()
        # Give up on one update quickly: a newer one will follow.
        settings = environment.etcd_settings(retry_timeout=max(interval * 3, 2.0))
        if rank != 0 or settings is None:
            return None
        from elasticctl.etcd.client import EtcdClient  # grpc only when it is used
        from elasticctl.job.events import EventLog

        client, keys = EtcdClient(settings), environment.job_keys()
        return cls(client, keys.progress, rank=rank, interval=interval, keys=keys,
                   events=EventLog(client, keys) if recoveries else None,
                   node=environment.node)

    def publish(self, *, step: int, epoch: int, loss: float | None, samples_per_s: float | None,
                world_size: int, last_checkpoint_step: int | None, checkpoint_error: str | None = None,
                checkpoint_failures: int = 0) -> None:
        """Queue an update (never blocks on etcd); a newer update replaces one not yet sent.
        ``checkpoint_error``: the newest failed checkpoint's sentence while they fail."""
        update = {
            "step": step, "epoch": epoch, "loss": loss, "samples_per_s": samples_per_s,
            "world_size": world_size, "last_checkpoint_step": last_checkpoint_step,
            "time": time.time(), "rank": self.rank,
        }
        if checkpoint_error:
            update.update(checkpoint_error=checkpoint_error, checkpoint_failures=checkpoint_failures)
        if self._first_step:
            self._first_step = False
            self._events.later(lambda: self._events.record_recovery_finished(
                self._node, update["time"], step=step, world_size=world_size))
        with self._cond:
            self._pending = update
            self._cond.notify()

    def _run(self) -> None:
        last_put = last_sample = float("-inf")
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:  # closed and nothing left
                    return
                # Rate limit: wait out the interval, but let close() cut it short.
                wait = last_put + self.interval - time.monotonic()
                if wait > 0 and not self._closed:
                    self._cond.wait(wait)
                    continue
                update, self._pending = self._pending, None
            last_put = time.monotonic()
            try:
                self.client.put(self.key, json.dumps(update))
            except Exception as exc:  # noqa: BLE001 - etcd away or refusing: training goes on without it
                log.warning("Dropped a progress update for %s: %s", self.key, exc)
                continue
            if self.keys is not None and last_put - last_sample >= self.sample_interval:
                last_sample = last_put
                self._append_sample(update)

    def _append_sample(self, update: dict) -> None:
        """Append ``update`` to the progress series and trim it (best-effort, like the update)."""
        sample = ProgressSample(time=update["time"], step=update["step"], loss=update["loss"],
                                samples_per_s=update["samples_per_s"], world_size=update["world_size"])
        try:
            self._lease.put(self.keys.progress_sample(sample.time), sample.to_json())
            trim_oldest(self.client, self.keys.progress_samples, self.max_samples)
        except Exception as exc:  # noqa: BLE001 - the curves lose a point; training goes on
            log.warning("Dropped a progress sample of %s: %s", self.keys.job, exc)

    def close(self, timeout: float = 5.0) -> None:
        """Send the last queued update (waiting at most ``timeout`` s) and stop."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)
        if self._events is not None:
            self._events.flush(timeout)
        if not self._thread.is_alive():
            self.client.close()
