"""torch's dynamic rendezvous handler, plus what an elastic job needs to recover in seconds.

torch's agent restarts its workers for free when ``num_nodes_waiting() > 0`` and
spends one of ``--max-restarts`` when they fail. On its own that means a frozen or
partitioned peer is only noticed when a collective times out (minutes), and a
crashed peer costs every survivor a restart. This handler adds:

* **Liveness**: after each round a node writes ``members/<node>`` bound to a lease
  of ``node_ttl`` seconds that a thread of this (mostly idle) agent renews. When a
  member of the current round loses its key, is marked left, or rejoins elsewhere,
  ``num_nodes_waiting()`` reports it, and the agent restarts at once, for free.
* **Restart accounting**: elasticctl gives torchrun an unlimited restart budget and
  the handler keeps the real one. A worker-group failure is free when a member of
  the round was lost (within ``node_ttl`` + 1 s) or another node's failure in the
  same round came first; otherwise it is this node's own and counts. Too many
  counted failures in a short time quarantine the node for a cooldown; more than
  ``max_restarts`` stop it (without closing the rendezvous for the others).
* **Requests**: ``elasticctl leave`` / ``down`` are seen here; the node leaves the
  round properly (others need not wait for its heartbeats to time out) and stops
  its workers with SIGTERM, so trainers write a final checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time

import psutil
from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousInfo
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    _RendezvousExitOp,
)

from elasticctl.errors import ElasticctlError
from elasticctl.etcd import EtcdClient
from elasticctl.registry import KeptLease, Registry, now

log = logging.getLogger(__name__)

RESTARTS_ENV = "ELASTICCTL_RESTARTS"
NODE_ENV = "ELASTICCTL_NODE"
# States of a member record that mean "no longer training with us".
GONE_STATES = ("left", "failed", "quarantined")
# Membership is checked at most this often, however short torchrun's monitor interval.
CHECK_INTERVAL = 0.5
# Seconds workers get to exit on SIGTERM after a peer was lost (see _stop_stuck_workers).
STUCK_WORKER_GRACE = 3.0


class ElasticctlRendezvousHandler(DynamicRendezvousHandler):
    """See the module docstring. Built by :func:`elasticctl.rendezvous.create_rdzv_handler`."""

    def attach(
        self,
        client: EtcdClient,
        registry: Registry,
        run_lease,
        node_id: str | None,
        node_ttl: int,
        max_restarts: int | None,
        quarantine_after: int,
        quarantine_window: float,
        quarantine_seconds: float,
    ) -> ElasticctlRendezvousHandler:
        self._client = client
        self._registry = registry
        self._run_lease = run_lease
        self._node_id = node_id or f"{self._this_node.addr}-{self._this_node.pid}"
        self._node_ttl = node_ttl
        self._max_restarts = max_restarts
        self._quarantine_after = quarantine_after
        self._quarantine_window = quarantine_window
        self._quarantine_seconds = quarantine_seconds
        self._member_lease: KeptLease | None = None
        self._member: dict = {}
        self._round: int | None = None
        self._world_size = 0
        self._round_started = 0.0
        self._seen: set[str] = set()
        self._rounds_joined = 0
        self._free_restart = False
        self._spent = 0
        self._counted_at: list[float] = []
        self._left = False
        self._crashed = False
        self._last_check = 0.0
        os.environ[RESTARTS_ENV] = "0"
        return self

    @property
    def node_id(self) -> str:
        return self._node_id

    @property
    def restarts_spent(self) -> int:
        return self._spent

    # -- the agent's view ----------------------------------------------------------------

    def num_nodes_waiting(self) -> int:
        waiting = super().num_nodes_waiting()  # also syncs the rendezvous state
        if waiting:
            self._free_restart = True
            return waiting
        if self._round is not None and not self._left and not self._participates():
            # Never train on in a round this node is no longer part of (its heartbeats
            # were judged too old, the round was superseded): re-join instead.
            log.warning("[%s] is no longer a participant of round %s; restarting its workers without "
                        "spending a restart", self._node_id, self._round)
            self._free_restart = True
            return 1
        if self._round is None or time.monotonic() - self._last_check < CHECK_INTERVAL:
            return 0
        self._last_check = time.monotonic()
        try:
            request = self._registry.requested(self._node_id)
            if request is not None:
                self._honour(request)
            lost, departed = self._lost_members()
        except ElasticctlError as exc:
            # etcd away: keep training; the client retried for its whole window already.
            log.warning("[%s] cannot check the members of round %s: %s", self._node_id, self._round, exc)
            return 0
        if lost:
            log.warning("[%s] round %s lost %s; restarting workers without spending a restart",
                        self._node_id, self._round, ", ".join(sorted(lost)))
            self._free_restart = True
            if lost - departed:
                self._stop_stuck_workers()
            return len(lost)
        return 0

    def _participates(self) -> bool:
        state = self._state_holder.state
        return state.round == self._round and self._this_node in state.participants

    def _stop_stuck_workers(self) -> None:
        """Stop workers that may hang in a collective with a vanished peer.

        torch stops workers on a restart with SIGTERM and waits 30 s before SIGKILL.
        A trainer that handles SIGTERM at a step boundary never reaches one while a
        collective waits for a frozen or cut-off peer, so those 30 s would be lost.
        A final checkpoint is impossible then anyway (it needs the lost peer).
        """
        workers = psutil.Process().children(recursive=True)
        for proc in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.terminate()
        _, alive = psutil.wait_procs(workers, timeout=STUCK_WORKER_GRACE)
        for proc in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        if alive:
            log.warning("[%s] %d worker process(es) hung after SIGTERM; killed", self._node_id, len(alive))

    def next_rendezvous(self) -> RendezvousInfo:
        try:
            return self._next_rendezvous()
        except BaseException:
            self._crashed = True
            raise

    def _next_rendezvous(self) -> RendezvousInfo:
        if self._rounds_joined and not self._free_restart:
            self._account_failure()
        self._free_restart = False
        os.environ[RESTARTS_ENV] = str(self._spent)
        info = super().next_rendezvous()
        self._round = self._state_holder.state.round
        self._world_size = info.world_size
        self._round_started = time.monotonic()
        self._seen = {self._node_id}
        self._rounds_joined += 1
        self._write_member(state="training", round=self._round, rank=info.rank, world_size=info.world_size)
        return info

    def shutdown(self) -> bool:
        if self._member_lease is not None:
            # Its keys stay until the TTL runs out: peers read "left"/"failed" from them.
            self._member_lease.stop(revoke=False)
        if self._left:
            self._stop_heartbeats()
            return True
        # torchrun calls shutdown from a `finally`: an exception in flight means the agent
        # crashed (a refused state, etcd gone for good), not that the workers succeeded.
        if self._crashed or sys.exc_info()[0] is not None:
            self._stop_heartbeats()
            try:
                failed = {**self._member, "state": "failed", "reason": "agent crashed", "since": now()}
                self._client.put(self._member_key, json.dumps(failed), lease=self._run_lease.id())
            except ElasticctlError as exc:
                log.warning("[%s] cannot record the crash of its agent: %s", self._node_id, exc)
            return True
        # The workers succeeded: say so where peers and `up` look, on the run's lease so
        # the record outlives this process.
        try:
            done = {**self._member, "state": "done", "since": now()}
            self._client.put(self._member_key, json.dumps(done), lease=self._run_lease.id())
            self._client.put(f"{self._registry.prefix}/finished", json.dumps({"node": self._node_id, "time": now()}),
                             lease=self._run_lease.id())
        except ElasticctlError as exc:
            log.warning("[%s] cannot record the end of the job: %s", self._node_id, exc)
        return super().shutdown()

    # -- membership ----------------------------------------------------------------------

    @property
    def _member_key(self) -> str:
        return f"{self._registry.prefix}/members/{self._node_id}"

    def _write_member(self, **fields) -> None:
        self._member = {**self._member, **fields, "node": self._node_id, "addr": self._this_node.addr,
                        "pid": self._this_node.pid, "restarts": self._spent, "since": now()}
        if self._member_lease is None:
            self._member_lease = KeptLease(self._client, self._node_ttl, self._rewrite_member, name="member")
        self._rewrite_member(self._member_lease.id)

    def _rewrite_member(self, lease_id: int) -> None:
        self._client.put(self._member_key, json.dumps(self._member), lease=lease_id)

    def _lost_members(self) -> tuple[set[str], set[str]]:
        """Members of this node's round that are gone, left, or moved to another round.

        Returns (lost, departed): departed are those of the lost that left gracefully,
        whose peers' collectives still complete.
        """
        members = self._registry.members()
        current = {node for node, m in members.items() if m.get("round") == self._round}
        self._seen |= current
        lost: set[str] = set()
        departed: set[str] = set()
        for node in self._seen:
            member = members.get(node)
            if member is None or member.get("state") in GONE_STATES:
                lost.add(node)
                if member is not None and member.get("state") == "left":
                    departed.add(node)
            elif member.get("round") != self._round and member.get("state") != "done":
                lost.add(node)
        # A member that died between the rendezvous and writing its record never shows up.
        if len(self._seen) < self._world_size and time.monotonic() - self._round_started > 2 * self._node_ttl:
            lost.add(f"{self._world_size - len(self._seen)} unseen node(s)")
        return lost, departed

    # -- failures ------------------------------------------------------------------------

    def _account_failure(self) -> None:
        """Decide whether this worker-group failure was this node's own, and act on it."""
        failed_round = self._round
        prefix = f"{self._registry.prefix}/failures/{failed_round}/"
        try:
            self._client.put(prefix + self._node_id, json.dumps({"time": now()}), lease=self._member_lease.id)
            deadline = time.monotonic() + self._node_ttl + 1
            verdict = None
            while verdict is None:
                lost, _ = self._lost_members()
                failures = sorted(self._client.get_prefix(prefix), key=lambda kv: kv.mod_revision)
                first = failures[0].key.decode(errors="replace")[len(prefix):] if failures else self._node_id
                if lost - {self._node_id}:
                    verdict = f"round {failed_round} lost {', '.join(sorted(lost - {self._node_id}))}"
                elif self._node_id in lost:
                    verdict = "this node's lease expired (it was frozen or cut off)"
                elif first != self._node_id:
                    verdict = f"{first} failed first in round {failed_round}"
                elif time.monotonic() > deadline:
                    break
                else:
                    time.sleep(0.25)  # polling etcd for the evidence, bounded by the deadline
        except ElasticctlError as exc:
            # No etcd for a whole retry window: this node is the one cut off, and its
            # workers failed because the others went on without it.
            verdict = f"this node cannot reach etcd ({exc})"
        if verdict is not None:
            log.warning("[%s] workers failed because %s; not spending a restart", self._node_id, verdict)
            return
        self._spent += 1
        self._counted_at = [t for t in self._counted_at if time.monotonic() - t < self._quarantine_window]
        self._counted_at.append(time.monotonic())
        log.warning("[%s] workers failed on their own (%d so far)", self._node_id, self._spent)
        if self._max_restarts is not None and self._spent > self._max_restarts:
            self._left = True  # so that torchrun's shutdown does not close the job for the others
            self._leave_round("failed")
            raise RendezvousError(
                f"The node '{self._node_id}' stops: its workers failed {self._spent} times, more than the "
                f"{self._max_restarts} restarts allowed; the other nodes continue."
            )
        if len(self._counted_at) >= self._quarantine_after:
            until = time.time() + self._quarantine_seconds
            self._leave_round("quarantined", until=round(until, 3))
            log.warning("[%s] failed %d times within %.0f s: quarantined for %.0f s",
                        self._node_id, len(self._counted_at), self._quarantine_window, self._quarantine_seconds)
            time.sleep(self._quarantine_seconds)  # the cooldown itself, not a synchronisation
            self._counted_at.clear()

    def _leave_round(self, state: str, **fields) -> None:
        """Leave the current round now, so the others re-form without waiting for heartbeats."""
        self._stop_heartbeats()
        with self._heartbeat_lock:
            # torch has no public "leave" short of closing the whole rendezvous.
            self._op_executor.run(_RendezvousExitOp(), self._get_deadline(self._settings.timeout.close))
        self._write_member(state=state, **fields)

    def _honour(self, request: str) -> None:
        """Leave (or, for ``down``, close the job), then stop like a preempted node."""
        log.warning("[%s] %s requested: leaving round %s", self._node_id, request, self._round)
        self._left = True
        if request == "down":
            self.set_closed()
        self._leave_round("left")
        # The agent turns SIGTERM into a clean stop of its workers (SIGTERM first, so
        # trainers checkpoint) and exits without closing the rendezvous.
        os.kill(os.getpid(), signal.SIGTERM)
