"""The run lease: what keeps a live job's shared keys alive, and lets an abandoned run's expire.

Every key that the job needs while it runs and that no single node owns (the sealed round
and generation, ``closed``, the agents' stores, the end records) is bound to one lease
whose id lives at ``<job>/lease`` (:attr:`JobKeys.run_lease`). Every live agent and worker
uses that lease and renews it on a schedule (every ``ttl / 3``, at most every minute) that
does not depend on writes or membership changes: the keys live exactly as long as some
process of the job is alive, and expire ``ttl`` seconds after the last one is gone.

Before, each agent bound its writes to a lease of its own, renewed only when it wrote
again; the etcd-native rendezvous writes the round once per round, so a job that ran
``ttl`` seconds (2 h) without a membership change lost its round record.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from elasticctl.errors import ConfigError, ElasticctlError
from elasticctl.etcd.client import EtcdClient
from elasticctl.job.history import find_or_grant_lease

log = logging.getLogger(__name__)

RENEW_AT_MOST_EVERY = 60.0  # seconds: a long ttl still sees a live run renewed this often


class RunLease:
    """The job's shared run lease (its id under ``key``), renewed by a thread once started.

    ``key=None`` gives a private lease, renewed only when used (torch's dynamic handler on
    etcd, whose heartbeats rewrite its state every few seconds). ``on_regrant(lease_id)``
    callbacks run when the lease was found gone (etcd away, or every process frozen, for
    longer than ``ttl``) and another was found or granted: the keys bound to the old one
    are gone, and whoever knows them writes them again.
    """

    def __init__(self, client: EtcdClient, ttl: int, key: str | None = None) -> None:
        if ttl < 2:
            raise ConfigError(f"The rendezvous key ttl ({ttl}) must be at least 2 seconds.")
        self._client = client
        self._ttl = ttl
        self._key = key
        self._lock = threading.Lock()
        self._id: int | None = None
        self._renewed_at = 0.0
        self._regranted: list[Callable[[int], None]] = []
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def ttl(self) -> int:
        return self._ttl

    @property
    def renew_every(self) -> float:
        return min(self._ttl / 3, RENEW_AT_MOST_EVERY)

    def id(self) -> int:
        """The lease id; renewed here too when the keeper thread is not running."""
        with self._lock:
            now = time.monotonic()
            if self._id is not None and now - self._renewed_at > self.renew_every:
                if self._client.refresh_lease(self._id) <= 0:
                    self._id = None
                self._renewed_at = now
            if self._id is None:
                self._id = self._grant()
                self._renewed_at = now
            return self._id

    def forget(self) -> None:
        """Drop a lease etcd no longer knows (it expired while we were away)."""
        with self._lock:
            self._id = None

    def on_regrant(self, callback: Callable[[int], None]) -> None:
        self._regranted.append(callback)

    # -- the keeper ----------------------------------------------------------------------

    def start(self) -> RunLease:
        """Renew the lease every :attr:`renew_every` seconds until :meth:`stop`."""
        self.id()
        if self._thread is None:
            self._thread = threading.Thread(target=self._keep, name="elasticctl-run-lease", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop renewing (never revoked: the other processes of the job still use it)."""
        self._stopped.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)

    def _keep(self) -> None:
        while not self._stopped.wait(self.renew_every):
            try:
                self.renew()
            except ElasticctlError as exc:
                log.warning("cannot renew the run lease: %s", exc)

    def renew(self) -> None:
        """Refresh the lease now; find or grant another if it is gone, and say so."""
        with self._lock:
            lease, self._renewed_at = self._id, time.monotonic()
        if lease is not None and self._client.refresh_lease(lease) > 0:
            if self._key is not None and self._client.get(self._key) is None:
                # Its key was deleted: put it back, so that a newcomer finds this lease.
                self._client.compare_and_swap(self._key, str(lease), 0, lease=lease)
            return
        self.forget()
        new = self.id()
        if lease is not None:
            log.warning("the run lease %x expired; the job's keys now live on lease %x", lease, new)
            for callback in list(self._regranted):
                try:
                    callback(new)
                except ElasticctlError as exc:
                    log.warning("cannot rewrite a key on the new run lease: %s", exc)

    # -- finding it --------------------------------------------------------------------

    def _grant(self) -> int:
        if self._key is None:
            return self._client.grant_lease(self._ttl)
        return find_or_grant_lease(self._client, self._key, self._ttl)


def with_lease(lease: RunLease, write: Callable[[int], object]):
    """``write(lease_id)``, finding the run lease again once if etcd no longer knows it."""
    try:
        return write(lease.id())
    except ElasticctlError as exc:
        if "lease not found" not in str(exc):
            raise
        lease.forget()
        return write(lease.id())
