"""This worker's part in its job's generations: who trains together, agreed in etcd.

A generation is a round of the etcd-native rendezvous (:mod:`elasticctl.rendezvous.member`)
whose members are workers (``<node>.<local rank>``), under ``generations/`` instead of
the agents' ``rdzv/``: one lease-bound declaration per worker, one claim holder that
seals, every worker learns the sealed generation by watch. The worker's lease is its
liveness: a frozen or cut-off worker is dropped when it ends. Nothing here touches torch's
process groups; :mod:`elasticctl.train.runtime` builds one per generation.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from elasticctl.etcd.client import EtcdClient
from elasticctl.job.keys import JobKeys
from elasticctl.job.records import Round
from elasticctl.job.run_lease import RunLease
from elasticctl.job.settings import HotSettings
from elasticctl.rendezvous.member import RoundMember
from elasticctl.rendezvous.rounds import Settings
from elasticctl.rendezvous.view import RoundView

log = logging.getLogger(__name__)


class Generations:
    """The generations of the job whose keys are ``keys``, seen by worker ``worker``."""

    def __init__(self, client: EtcdClient, keys: JobKeys, worker: str, addr: str, settings: HotSettings,
                 secret: bytes | None = None, sharded: bool = False) -> None:
        self.worker = worker
        self._settings = settings
        self.view = RoundView(client, keys.generations(), secret).start()
        # The generation record lives on the run lease, which the workers renew as well as their
        # agents: it stays while any worker of the job lives, and goes ttl after the last one.
        self._run_lease = RunLease(client, settings.run_ttl, keys.run_lease).start()
        # Members are workers, each node brings its LOCAL_WORLD_SIZE of them (nodes may differ), and
        # MIN and MAX count nodes: a node with more workers than the others is one node all the same.
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        rounds = Settings(min_nodes=settings.min_nodes, max_nodes=settings.max_nodes,
                          last_call=settings.last_call, members_are_workers=True)
        # A sharded model's mesh holds whole nodes (train/sharding/shards.py: hsdp_layout): each worker declares
        # how many its node brings, and a generation admits a node with all of them or none.
        self._member = RoundMember(client, self.view, worker, addr, rounds, settings.node_ttl,
                                   settings.join_timeout, self._run_lease, pid=os.getpid(),
                                   node_workers=per_node if sharded else 0, node_size=per_node)

    def join(self) -> Round:
        """Declare for the next generation; return it once it is sealed with this worker in it."""
        sealed = self._member.join()
        # Later generations re-form among running workers, which declare within milliseconds
        # of a fault: only a dead worker's declaration (its lease not yet ended) is waited for.
        self._member.settings = dataclasses.replace(self._member.settings,
                                                    last_call=self._settings.reform_last_call)
        return sealed

    def cancel(self) -> None:
        """End the wait for a generation (now, or the next one) with JoinCancelled."""
        self._member.cancel()

    def change_pending(self) -> bool:
        """Whether this worker's generation must re-form: a member lost or gone on, a newcomer
        waiting, a later generation sealed without it, or its own lease lost. No etcd request."""
        return self._member.change().count > 0

    def describe_change(self) -> str:
        change = self._member.change()
        parts = [f"lost {', '.join(change.lost)}"] if change.lost else []
        parts += [f"{', '.join(change.moved_on)} re-forming"] if change.moved_on else []
        parts += [f"{', '.join(change.waiting)} waiting"] if change.waiting else []
        parts += ["superseded"] if change.superseded else []
        return "; ".join(parts) or "no change seen here"

    def on_member_lost(self, callback) -> None:
        """``callback(generation, lost)`` on the view's writer thread (never the training thread)
        after each change the watches bring in which members of this worker's generation are
        lost (their lease ended or ``ctl/reform`` names them): train/groups/lost_member_abort.py."""
        def changed() -> None:
            seen = self._member.lost_now()
            if seen is not None and seen[1]:
                callback(*seen)
        self.view.on_change(changed)

    def leave(self) -> None:
        """Withdraw: the others see this worker's key go at once, not after node_ttl."""
        self._member.leave()

    def close(self) -> None:
        self.view.stop()
        self._run_lease.stop()
