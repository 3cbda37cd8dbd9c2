"""Training progress in etcd, for ``elasticctl status``.

Global rank 0 writes one JSON document to ``{prefix}/{job}/progress``: step,
epoch, loss, samples_per_s, world_size, last_checkpoint_step, time (unix), rank.
Writes happen on a background thread, at most one per ``interval`` seconds,
with only the newest update kept: an etcd that is slow or away costs training
nothing (the update is dropped with a warning). Outside elasticctl (no
ELASTICCTL_ETCD / ELASTICCTL_JOB) every call is a no-op.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

from elasticctl.job import envvars

log = logging.getLogger(__name__)



class ProgressPublisher:
    """Publishes the newest progress update in the background; see the module docstring."""

    def __init__(self, client, key: str, rank: int = 0, interval: float = 1.0, events=None,
                 node: str = "") -> None:
        self.client = client
        self._events = events  # EventLog: this process's first step may end a recovery
        self._first_step = events is not None
        self._node = node
        self.key = key
        self.rank = rank
        self.interval = interval
        self._pending: dict | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="elasticctl-progress", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, rank: int, interval: float = 1.0) -> ProgressPublisher | None:
        """A publisher for global rank 0 under elasticctl; None anywhere else."""
        # Give up on one update quickly: a newer one will follow.
        settings = envvars.etcd_settings(retry_timeout=max(interval * 3, 2.0))
        if rank != 0 or settings is None:
            return None
        from elasticctl.etcd import EtcdClient  # grpc only when it is used
        from elasticctl.events import EventLog

        client, keys = EtcdClient(settings), envvars.job_keys()
        return cls(client, keys.progress, rank=rank, interval=interval, events=EventLog(client, keys),
                   node=os.environ.get(envvars.NODE, ""))

    def publish(self, *, step: int, epoch: int, loss: float | None, samples_per_s: float | None,
                world_size: int, last_checkpoint_step: int | None) -> None:
        """Queue an update (never blocks on etcd); a newer update replaces one not yet sent."""
        update = {
            "step": step, "epoch": epoch, "loss": loss, "samples_per_s": samples_per_s,
            "world_size": world_size, "last_checkpoint_step": last_checkpoint_step,
            "time": time.time(), "rank": self.rank,
        }
        if self._first_step:
            self._first_step = False
            self._events.later(lambda: self._events.record_recovery_finished(
                self._node, update["time"], step=step, world_size=world_size))
        with self._cond:
            self._pending = update
            self._cond.notify()

    def _run(self) -> None:
        last_put = float("-inf")
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
