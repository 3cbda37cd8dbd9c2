"""What the event history and the progress series share in etcd: one long-lived lease, and a bound.

Everything under ``history/`` is bound to one lease whose id lives at ``history/lease``
(:attr:`JobKeys.events_lease`): any writer (a node, a handler, rank 0's progress
publisher) finds it there or puts a new one there, and renews it as it writes, so the
history expires ``HISTORY_TTL`` seconds after the job's last writer and survives
``elasticctl down`` until then. Each series keeps only its newest entries
(:func:`trim_oldest`): keys are zero-padded times, so key order is time order.
"""

from __future__ import annotations

import threading
import time

from elasticctl.errors import ElasticctlError
from elasticctl.etcd.client import EtcdClient

HISTORY_TTL = 3600  # seconds the history outlives its job's last writer


class SharedLease:
    """The lease under ``key`` shared by every writer of a job's history."""

    def __init__(self, client: EtcdClient, key: str, ttl: int = HISTORY_TTL) -> None:
        self._client = client
        self._key = key
        self._ttl = ttl
        self._lock = threading.Lock()
        self._lease_id: int | None = None
        self._renewed_at = 0.0

    def get(self, force: bool = False) -> int:
        """The lease id, renewed at most every ttl / 4 (or now, with ``force``)."""
        with self._lock:
            now = time.monotonic()
            if self._lease_id is not None and (force or now - self._renewed_at > self._ttl / 4):
                if self._client.refresh_lease(self._lease_id) <= 0:
                    self._lease_id = None
                self._renewed_at = now
            if self._lease_id is None:
                self._lease_id = self._find_or_grant()
                self._renewed_at = now
            return self._lease_id

    def forget(self) -> None:
        """Drop the cached id (etcd said the lease is gone): the next :meth:`get` looks again."""
        with self._lock:
            self._lease_id = None

    def put(self, key: str, value: str) -> None:
        """Write ``key`` bound to the lease, looking for a new lease once if it was gone."""
        try:
            self._client.put(key, value, lease=self.get())
        except ElasticctlError as exc:
            if "lease not found" not in str(exc):
                raise
            self.forget()
            self._client.put(key, value, lease=self.get())

    def _find_or_grant(self) -> int:
        """The lease under the key if it is alive, else a new one put there."""
        return find_or_grant_lease(self._client, self._key, self._ttl)


def find_or_grant_lease(client: EtcdClient, key: str, ttl: int) -> int:
    """The live lease whose id is stored at ``key``, else a new one of ``ttl`` seconds put there
    (bound to itself); shared by every process that writes the keys bound to it."""
    for _ in range(5):
        kv = client.get(key)
        if kv is not None:
            try:
                lease_id = int(kv.value)
            except ValueError:
                lease_id = 0
            if lease_id > 0 and client.refresh_lease(lease_id) > 0:
                return lease_id
        lease_id = client.grant_lease(ttl)
        ok, _, _ = client.compare_and_swap(key, str(lease_id), 0 if kv is None else kv.mod_revision, lease=lease_id)
        if ok:
            return lease_id
        client.revoke_lease(lease_id)  # another writer put its lease there first
    raise ElasticctlError(f"The shared lease at '{key}' kept changing under us.")


def trim_oldest(client: EtcdClient, prefix: str, keep: int) -> int:
    """Delete the oldest keys under ``prefix`` past the newest ``keep``; how many were deleted."""
    excess = client.count_prefix(prefix) - keep
    if excess <= 0:
        return 0
    keys = client.oldest_keys(prefix, excess)
    for key in keys:
        client.delete(key)
    return len(keys)
