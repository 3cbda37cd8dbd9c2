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

from elasticctl.errors import ConfigError
from elasticctl.etcd.client import EtcdClient
from elasticctl.etcd.lease import Lease

RENEW_AT_MOST_EVERY = 60.0  # seconds: a long ttl still sees a live run renewed this often


class RunLease(Lease):
    """The job's shared run lease (its id under ``key``), renewed by a thread once started.

    ``key=None`` gives a private lease, renewed only when used (torch's dynamic handler on
    etcd, whose heartbeats rewrite its state every few seconds).
    """

    def __init__(self, client: EtcdClient, ttl: int, key: str | None = None) -> None:
        if ttl < 2:
            raise ConfigError(f"The rendezvous key ttl ({ttl}) must be at least 2 seconds.")
        super().__init__(client, ttl, key=key, renew_every=min(ttl / 3, RENEW_AT_MOST_EVERY), name="run lease")
