"""What the event history and the progress series share in etcd: one long-lived lease, and a bound.

Everything under ``history/`` is bound to one lease whose id lives at ``history/lease``
(:attr:`JobKeys.events_lease`): any writer (a node, a handler, rank 0's progress
publisher) finds it there or puts a new one there, and renews it as it writes, so the
history expires ``HISTORY_TTL`` seconds after the job's last writer and survives
``elasticctl down`` until then. Each series keeps only its newest entries
(:func:`trim_oldest`): keys are zero-padded times, so key order is time order.
"""

from __future__ import annotations

from elasticctl.etcd.client import EtcdClient
from elasticctl.etcd.lease import Lease

HISTORY_TTL = 3600  # seconds the history outlives its job's last writer


class HistoryLease(Lease):
    """The lease under ``key`` shared by every writer of a job's history, renewed as they write."""

    def __init__(self, client: EtcdClient, key: str, ttl: int = HISTORY_TTL) -> None:
        # No keeper thread: the writes renew it, at most every quarter of its ttl.
        super().__init__(client, ttl, key=key, renew_every=ttl / 4, name="history lease")


def trim_oldest(client: EtcdClient, prefix: str, keep: int) -> int:
    """Delete the oldest keys under ``prefix`` past the newest ``keep``; how many were deleted."""
    excess = client.count_prefix(prefix) - keep
    if excess <= 0:
        return 0
    keys = client.oldest_keys(prefix, excess)
    for key in keys:
        client.delete(key)
    return len(keys)
