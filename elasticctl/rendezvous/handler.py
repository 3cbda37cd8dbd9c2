"""The ``etcd3`` rendezvous handler for torchrun, on the etcd-native protocol.

Implements torch's public :class:`RendezvousHandler` on :mod:`elasticctl.rendezvous.member`:
a node joins a round with one lease-bound put, the holder of the claim to seal it
seals it with one transaction, everyone learns it by watch. On top of the protocol:

* **Membership changes restart for free.** ``num_nodes_waiting()`` answers from the
  watched view (no etcd request): a member lost (lease ended) or gone to a later
  round, a newcomer with room, a round sealed without this node. torch's agent then
  restarts its workers without spending a restart. Workers of a node whose peer was
  lost (not a graceful leave) are killed at once: their collectives wait on that peer.
* **Nothing waits on the recovery path.** A node whose workers failed re-joins at
  once; whose fault it was is decided afterwards from the evidence in etcd
  (:mod:`elasticctl.rendezvous.verdicts`) and charged to the node's budget then. elasticctl
  gives torchrun an unlimited ``--max-restarts``; this handler keeps the real one.
  Over budget, the node stops (the others continue); too many own failures in a
  window put it aside for a while (quarantine).
* **Requests**: ``elasticctl leave`` / ``down`` make the node leave its round at once
  and stop its workers with SIGTERM, so trainers write a final checkpoint.
* **Records for ``status``**: ``members/<node>`` (round, rank, restarts) and, at the
  end, ``finished`` or the crash.
* **A finished group never trains again.** torch judges a worker group all or
  nothing: a worker that died after another exited 0 (an abort at interpreter exit)
  would have the whole group started again from scratch. Workers mark what they
  did (:mod:`elasticctl.train.entry`); a group with a finished worker is ended.

What the node does is decided by the pure rules of :mod:`elasticctl.rendezvous.policy` (and
whose fault a failure was by :mod:`elasticctl.rendezvous.verdicts`); this class gathers the
facts for them from the workers' marks, the watched view and etcd, and acts on the answer.

Why one module of over 500 lines: it is one class, torch's ``RendezvousHandler``, whose
methods share one node's state (its round, budget, member record, closed and left flags)
across the three threads that call it (torch's agent, the watch of leave/down requests,
the verdicts), with one lock discipline written down in ``__init__``. The protocol
(``member.py``, ``view.py``, ``rounds.py``) and the decisions (``policy.py``,
``verdicts.py``) are already elsewhere; what is left gathers facts and acts on them, and
splitting it would spread those shared fields and their locking over files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import psutil
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
)
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
from torch.distributed.elastic.utils.distributed import get_free_port

from elasticctl.errors import ElasticctlError
from elasticctl.etcd.client import EtcdClient
from elasticctl.job.events import EventLog, recovery_start
from elasticctl.job import environment as worker_environment
from elasticctl.job.environment import WorkerEnvironment
from elasticctl.job.records import EventKind, FailureCause, MemberState, Round
from elasticctl.job.options import RecoveryMode
from elasticctl.job.worker_failure import MAX_BYTES as MAX_FAILURE_BYTES
from elasticctl.job.worker_failure import WorkerFailure
from elasticctl.rendezvous.member import RoundMember
from elasticctl.rendezvous.rounds import Settings
from elasticctl.rendezvous.policy import (
    Budget,
    BudgetRules,
    NodeAction,
    NodeDecision,
    RequestAction,
    Waiting,
    after_workers_ended,
    before_join,
    charge,
    kill_for_lost,
    on_request,
    repeated_failure,
    when_asked_for_waiting,
)
from elasticctl.rendezvous.verdicts import Evidence, Verdict, failure_verdict
from elasticctl.rendezvous.view import RoundView
from elasticctl.job.registry import Registry, now, request_for

log = logging.getLogger(__name__)
_Mark = TypeVar("_Mark")  # what a worker's mark is read into

BACKEND_NAME = "etcd3"


class EtcdRendezvousHandler(RendezvousHandler):
    """See the module docstring. Built by :func:`elasticctl.rendezvous.backend.create_rdzv_handler`."""

    def __init__(self, *, client: EtcdClient, run_id: str, registry: Registry, run_lease, node_id: str,
                 local_addr: str, settings: Settings, node_ttl: int, join_timeout: float,
                 max_restarts: int | None, quarantine_after: int | None, quarantine_window: float,
                 quarantine_seconds: float, store_factory, secret: bytes | None = None,
                 worker_environment: WorkerEnvironment | None = None) -> None:
        self._client = client
        self._run_id = run_id
        self._registry = registry
        self._run_lease = run_lease
        self._node_id = node_id
        self._local_addr = local_addr
        self._node_ttl = node_ttl
        self._rules = BudgetRules(max_restarts, quarantine_after, quarantine_window)
        self._quarantine_seconds = quarantine_seconds
        self._store_factory = store_factory
        self._secret = secret
        # What the node gave torchrun for the workers; each start of them adds its own part.
        self._worker_environment = worker_environment or WorkerEnvironment()
        # Restart mode, or hot: the workers re-form their generations themselves.
        self._recovery = self._worker_environment.recovery
        self._keys = registry.keys
        self._view = RoundView(client, self._keys, secret).start()
        self._events = EventLog(client, self._keys)
        self._member = RoundMember(client, self._view, node_id, local_addr, settings, node_ttl, join_timeout,
                                   run_lease, os.getpid())
        # Three threads use this handler: torch's agent (the torch contract), the watch thread
        # of leave/down requests (_on_requests) and verdict threads (_judge, charging a failure
        # judged after the node re-joined). Fields shared between them are behind _lock, or
        # _record_lock for the member record; the rest belong to the agent's thread alone.
        self._lock = threading.Lock()
        self._budget = Budget()   # _lock: charged by the agent's and the verdict threads
        self._left = False        # _lock: left the round for good (a request, a stop); set by the agent or watch thread
        self._closed = False      # _lock: this handler closed the run (its view stops at shutdown)
        self._record_lock = threading.Lock()
        self._record: dict = {}   # _record_lock: the member record as last written, by any thread
        # The agent's thread alone. _round is replaced whole; the watch thread only reads it, once, for a message.
        self._round: Round | None = None
        self._changed = False     # the last restart was a membership change (or our own verdict), not a failure
        self._crashed = False
        self._finished = False
        self._finished_peers: frozenset[str] = frozenset()  # members of this round that finished
        self._shut_down = False
        self._verdicts: list[threading.Thread] = []
        self._stopping = threading.Event()  # shutdown() began: background work ends
        # Workers mark here which of them finished their script (see elasticctl/train/entry.py).
        self._marks_root = tempfile.mkdtemp(prefix="elasticctl-workers-")
        self._marks: str | None = None
        # The failure the workers' last start ended on (None: it left none, or it did not fail):
        # the same one again before a first step stops the node (policy.repeated_failure).
        self._last_failure: WorkerFailure | None = None
        # leave/down requests, watched: acted on the moment they are written (last: it may act at once).
        self._requests = registry.watch_requests(self._on_requests)

    # -- torch's contract ----------------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND_NAME

    def get_run_id(self) -> str:
        return self._run_id

    @property
    def use_agent_store(self) -> bool:
        return False

    def is_closed(self) -> bool:
        # The watched view learns of a close asynchronously and stops at shutdown(): a close
        # this handler wrote itself is known at once, also after shutdown().
        with self._lock:
            closed = self._closed
        return closed or self._view.closed

    def set_closed(self) -> None:
        self._view.close(self._run_lease.id())
        with self._lock:
            self._closed = True

    @property
    def node_id(self) -> str:
        return self._node_id

    @property
    def restarts_spent(self) -> int:
        with self._lock:
            return self._budget.spent

    def next_rendezvous(self) -> RendezvousInfo:
        try:
            return self._next_rendezvous()
        except SystemExit as exc:
            self._finished = exc.code in (None, 0)
            self._crashed = not self._finished
            raise
        except BaseException:
            self._crashed = True
            raise

    def _next_rendezvous(self) -> RendezvousInfo:
        # The agent asks again after its workers ended, or (restart mode) after it stopped them
        # for a membership change or our own verdict (num_nodes_waiting said so).
        workers_ended = self._round is not None and (self._recovery is RecoveryMode.HOT or not self._changed)
        self._changed = False
        self._before_joining(workers_ended)
        if self._recovery is RecoveryMode.HOT:
            return self._start_hot()
        current = self._view.round
        if current is not None and self._node_id not in current.members:
            # A node joining a running job (or back from a freeze) is a change the history tells;
            # the nodes of a cold start are in its first round_formed (a thousand of them would
            # fill the history).
            self._events.record_later(EventKind.NODE_WAITING, self._node_id, reason=f"address {self._local_addr}")
        previous = self._round
        sealed = self._member.join()
        rank = sealed.rank_of(self._node_id)
        if rank == 0:  # off the recovery path: a few etcd requests
            wall, mono = time.time(), time.monotonic()
            self._events.later(lambda: self._record_round(previous, sealed, wall, mono))
        store = self._store_factory(sealed.number)
        if sealed.master_port and sealed.addrs:
            bootstrap = RendezvousStoreInfo(master_addr=sealed.addrs[0], master_port=sealed.master_port)
        else:  # a round sealed without them (an older elasticctl): agree in the store, as torch does
            bootstrap = RendezvousStoreInfo.build(rank, store, self._local_addr)
        self._round = sealed
        self._write_member(state=MemberState.TRAINING, round=sealed.number, rank=rank, world_size=sealed.world_size)
        # The agent starts the workers right after this, with this process's environment.
        self._marks = os.path.join(self._marks_root, f"round-{sealed.number}")
        os.makedirs(self._marks, exist_ok=True)
        self._export_worker_environment()
        log.info("[%s] round %d: rank %d of %d", self._node_id, sealed.number, rank, sealed.world_size)
        if rank == 0 and sealed.number > 2:
            self._ignore_errors(lambda: self._registry.delete_round_store(sealed.number - 2))
        return RendezvousInfo(store, rank, sealed.world_size, bootstrap)

    def num_nodes_waiting(self) -> int:
        worker_finished = self._round is not None and bool(self._worker_marks()[1])
        with self._lock:
            waiting = when_asked_for_waiting(self._round is not None, self._left, worker_finished,
                                             self._budget, self._recovery,
                                             worker_gave_up=self._round is not None and self._unrecoverable() is not None)
        if waiting is Waiting.OWN_VERDICT:
            self._changed = True  # our own verdict, not a new failure
            return 1
        if waiting is Waiting.NONE:
            return 0
        change = self._member.change(self._finished_peers)
        states: dict[str, str] = {}
        if change.lost:
            # A member whose key went: lost, left, or finished? Its record says (one read, once
            # per such member: a finished one is remembered, a lost one ends this round).
            states = self._member_states()
            finished = {node for node in change.lost if states.get(node) == MemberState.DONE}
            if finished:
                self._finished_peers |= finished
                log.info("[%s] round %d: %s finished; not a lost member: this node's workers keep running "
                         "to their own end", self._node_id, self._round.number, ", ".join(sorted(finished)))
                change = self._member.change(self._finished_peers)
        if not change.count:
            return 0
        self._changed = True
        why = [f"lost {', '.join(change.lost)}"] if change.lost else []
        why += [f"{', '.join(change.moved_on)} re-joining"] if change.moved_on else []
        why += [f"{', '.join(change.waiting)} waiting"] if change.waiting else []
        why += ["round superseded"] if change.superseded else []
        log.warning("[%s] round %d: %s; restarting workers without spending a restart",
                    self._node_id, self._round.number, "; ".join(why))
        if kill_for_lost(change.lost, states):
            self._kill_workers()
        return change.count

    def shutdown(self) -> bool:
        """Record the end, leave, then stop every thread and close the etcd client this handler
        started: a process that forks afterwards must find no thread inside gRPC. Idempotent."""
        if self._shut_down:
            return True
        self._shut_down = True
        self._stopping.set()
        self._requests.stop()  # no leave/down request acted on from here
        # torchrun calls shutdown from a `finally`: an exception in flight means the agent
        # crashed (a refused record, etcd gone for good), not that the workers succeeded.
        crashed = self._crashed or (sys.exc_info()[0] is not None and not self._finished)
        with self._lock:
            left = self._left
        if not left:  # a node that left recorded why when it did
            try:
                if crashed:
                    self._write_member(state=MemberState.FAILED, cause=FailureCause.AGENT_CRASHED,
                                       reason="agent crashed", lease=self._run_lease.id())
                else:
                    # DONE before the declaration goes: the others read it when they see it go.
                    self._write_member(state=MemberState.DONE, lease=self._run_lease.id())
                    self._registry.record_finished(self._node_id, self._run_lease.id())
                    self.set_closed()
            except ElasticctlError as exc:
                log.warning("[%s] cannot record the end of its agent: %s", self._node_id, exc)
            self._ignore_errors(self._member.leave)
        for verdict in self._verdicts:  # they see _stopping within 0.25 s; they may still queue events
            verdict.join(timeout=5)
        self._events.close(timeout=5)  # what the history writer has queued, then the writer
        self._view.stop()
        self._run_lease.stop()  # renewing stops; the lease is left for the job's other processes
        self._client.close()
        shutil.rmtree(self._marks_root, ignore_errors=True)
        return True

    def _before_joining(self, workers_ended: bool) -> None:
        """What every round starts with, in both modes (rendezvous/policy.py decides): the end
        of the last round's workers (complete, a stop, or a failure to judge or charge), then
        a stop or a quarantine the budget calls for."""
        if workers_ended:
            started, done = self._worker_marks()
            failure = self._worker_failure()
            repeated = repeated_failure(self._last_failure, failure)
            self._last_failure = failure
            decision = after_workers_ended(self._node_id, self._recovery, started, done,
                                           self._unrecoverable() or repeated)
            if decision.action is NodeAction.END:
                log.warning("[%s] round %d: every worker finished its script (local ranks %s) and one died "
                            "afterwards, at interpreter exit: the job is complete, not starting it again",
                            self._node_id, self._round.number, ", ".join(sorted(done)))
                # torch's RendezvousGracefulExitError would be the documented way out, but torch
                # 2.14's launch_agent then calls .is_failed() on the None run() returns; torchrun's
                # main treats SystemExit(0) as success, and shutdown() records "done".
                raise SystemExit(0)
            if decision.action is NodeAction.STOP:
                if decision.failure_event:
                    self._events.record_later(EventKind.WORKERS_FAILED, self._node_id, round=self._round.number,
                                              reason=decision.cause)
                self._stop(decision)
            if decision.action is NodeAction.JUDGE:
                self._workers_failed(self._round)
            if decision.action is NodeAction.CHARGE:
                self._events.record_later(EventKind.WORKERS_FAILED, self._node_id, round=self._round.number,
                                          reason="could not recover in process")
                self._charge(self._round)
        else:  # stopped for a membership change: what failed before is no longer the last start's
            self._last_failure = None
        with self._lock:
            decision, self._budget = before_join(self._budget)
        if decision.action is NodeAction.STOP:
            self._stop(decision)
        if decision.action is NodeAction.QUARANTINE:
            self._sit_out_quarantine()

    def _stop(self, decision: NodeDecision) -> None:
        """Leave the round as failed and end torchrun with ``decision``'s message."""
        with self._lock:
            self._left = True  # so that torchrun's shutdown does not close the job for the others
        self._leave(MemberState.FAILED, cause=FailureCause.STOPPED,
                    **({} if decision.cause is None else {"reason": decision.cause}))
        _stop_agent(decision.message)

    # -- hot recovery --------------------------------------------------------------------

    def _start_hot(self) -> RendezvousInfo:
        """Hot recovery: the workers form their generations themselves (elasticctl.train); the
        agent starts them in a round of this node alone, and again only when they failed in a
        way the runtime could not recover from in process, which is this node's own failure."""
        number = 1 if self._round is None else self._round.number + 1
        self._round = Round(number=number, members=(self._node_id,), addrs=(self._local_addr,))
        self._write_member(state=MemberState.TRAINING, recovery=RecoveryMode.HOT.value, starts=number)
        self._marks = os.path.join(self._marks_root, f"round-{number}")
        os.makedirs(self._marks, exist_ok=True)
        self._export_worker_environment()
        log.info("[%s] starting its workers (hot recovery, start %d)", self._node_id, number)
        # The agents of this node alone share this store; the workers build their own groups.
        bootstrap = RendezvousStoreInfo(master_addr=self._local_addr, master_port=get_free_port())
        return RendezvousInfo(dist.HashStore(), 0, 1, bootstrap)

    def _export_worker_environment(self) -> None:
        """Hand this start of the workers their environment: restarts spent so far, where they
        mark, and for hot recovery its settings, this node's address and the key their
        generations are signed with (the job's secret, bound to this run).

        Through os.environ because torch offers no other channel: its LocalElasticAgent starts
        every worker with a copy of the agent's environment plus its own variables (RANK, ...),
        right after next_rendezvous returns."""
        worker_environment.export(dataclasses.replace(
            self._worker_environment, restarts=self.restarts_spent, marks_dir=self._marks or "",
            node_addr=self._local_addr,
            rdzv_secret=self._secret.decode() if self._secret else ""))

    # -- failures ----------------------------------------------------------------------

    def _worker_marks(self) -> tuple[set[str], set[str]]:
        """Local ranks of this round's workers that started, and that finished their script."""
        try:
            names = os.listdir(self._marks) if self._marks else []
        except OSError:
            names = []
        started = {name.split("-", 1)[1] for name in names if name.startswith("started-")}
        done = {name.split("-", 1)[1] for name in names if name.startswith("done-")}
        return started, done

    def _unrecoverable(self) -> str | None:
        """Why a worker of this round failed in a way a restart would only repeat, if one did."""
        return self._first_mark("unrecoverable-", 2048, lambda text: " ".join(text.split()) or None)

    def _worker_failure(self) -> WorkerFailure | None:
        """What a worker of this round that raised said of it (the lowest local rank's readable
        record; elasticctl/job/worker_failure.py validates it), or None."""
        return self._first_mark("failure-", MAX_FAILURE_BYTES + 1, WorkerFailure.parse)

    def _first_mark(self, prefix: str, limit: int, read: Callable[[str], _Mark | None]) -> _Mark | None:
        """``read`` of the first of this round's ``<prefix><LOCAL_RANK>`` marks, lowest local rank
        first, that it accepts (its first ``limit`` characters); None when none is accepted."""
        def local_rank(name: str) -> tuple[int, str]:
            suffix = name[len(prefix):]
            return (int(suffix), "") if suffix.isdigit() else (1 << 30, suffix)

        try:
            names = sorted((n for n in os.listdir(self._marks) if n.startswith(prefix)), key=local_rank) \
                if self._marks else []
            for name in names:
                with open(os.path.join(self._marks, name), encoding="utf-8", errors="replace") as mark:
                    found = read(mark.read(limit))
                if found is not None:
                    return found
        except OSError:
            return None
        return None

    def _workers_failed(self, failed: Round) -> None:
        """Record the failure and re-join at once; the verdict follows from the evidence."""
        failed_at = time.monotonic()
        at_failure = self._member.change()  # what the view showed as the workers failed
        self._events.record_later(EventKind.WORKERS_FAILED, self._node_id, round=failed.number)
        try:
            self._member.bound_to_lease(
                lambda lease: self._registry.record_failure(failed.number, self._node_id, lease))
            cut_off = False
        except ElasticctlError:
            cut_off = True
        # Decided now when the evidence already is in (then the restarted workers see the
        # right count); otherwise gathered in the background while the node re-joins.
        if not self._judge(failed, failed_at, cut_off, at_failure, wait=False):
            verdict = threading.Thread(target=self._judge, args=(failed, failed_at, cut_off, at_failure),
                                       name="elasticctl-verdict", daemon=True)
            self._verdicts = [t for t in self._verdicts if t.is_alive()] + [verdict]
            verdict.start()

    def _judge(self, failed: Round, failed_at: float, cut_off: bool, at_failure,
               wait: bool = True) -> bool:
        """Reach the verdict on a failure and act on it; False if ``wait`` is off and it is open."""
        verdict: Verdict | None = None
        while verdict is None:
            try:
                failures = self._registry.failures_of_round(failed.number)
                gone = {m: t for m, t in self._view.gone_at.items() if m in failed.members}
                departed = self._departed(tuple(gone))
            except ElasticctlError:
                failures, gone, departed, cut_off = [], {}, frozenset(), True
            evidence = Evidence(node=self._node_id, round_members=failed.members, failed_at=failed_at,
                                gone_at=gone, departed=departed, failures=failures,
                                cut_off=cut_off or self._member.lease_lost,
                                waiting=at_failure.waiting, rejoining=at_failure.moved_on)
            verdict = failure_verdict(evidence, self._node_ttl, time.monotonic())
            if verdict is None:
                if not wait or self._stopping.is_set():
                    return False  # shutting down: the agent has no next round to charge
                self._view.wait_for(lambda: False, 0.25)  # more evidence arrives by watch; bounded
        self._events.record_later(EventKind.FAILURE_JUDGED, self._node_id, round=failed.number,
                                  charged=verdict.own, reason=verdict.reason or "")
        if not verdict.own:
            log.warning("[%s] workers failed in round %d because %s; not spending a restart",
                        self._node_id, failed.number, verdict.reason)
            return True
        self._charge(failed)
        return True

    def _charge(self, failed: Round) -> None:
        """One own failure (on the agent's thread, or a verdict thread's)."""
        with self._lock:
            self._budget = budget = charge(self._budget, self._rules, self._node_id, time.monotonic())
        log.warning("[%s] workers failed on their own in round %d (%d so far)",
                    self._node_id, failed.number, budget.spent)
        self._ignore_errors(lambda: self._write_member(restarts=budget.spent))
        if budget.stop_reason:
            self._events.record_later(EventKind.OVER_BUDGET, self._node_id, round=failed.number,
                                      reason=budget.stop_reason)

    def _sit_out_quarantine(self) -> None:
        until = time.time() + self._quarantine_seconds
        log.warning("[%s] failed %d times within %.0f s: quarantined for %.0f s", self._node_id,
                    self._rules.quarantine_after, self._rules.quarantine_window, self._quarantine_seconds)
        self._events.record_later(EventKind.QUARANTINED, self._node_id,
                                  reason=f"failed {self._rules.quarantine_after} times within "
                                         f"{self._rules.quarantine_window:.0f} s; sits out "
                                         f"{self._quarantine_seconds:.0f} s")
        self._leave(MemberState.QUARANTINED, until=round(until, 3))
        time.sleep(self._quarantine_seconds)  # the cooldown itself, not a synchronisation

    # -- history -------------------------------------------------------------------------

    def _record_round(self, previous: Round | None, sealed: Round, wall: float, mono: float) -> None:
        """Rank 0 of a new round: the members of ``previous`` (this node's last round) that are
        gone without a word of their own, the round, and the recovery it ends. Best-effort."""
        if previous is not None and previous.number < sealed.number:
            gone = [m for m in previous.members if m not in sealed.members]
            members = (self._ignore_errors(self._registry.members) or {}) if gone else {}
            said = {MemberState.LEFT, MemberState.FAILED, MemberState.QUARANTINED, MemberState.DONE}
            for node in gone:
                if members.get(node, {}).get("state") in said:
                    continue  # it recorded why itself
                # When its lease ended if that was seen, else (it did not re-declare) just before the round.
                seen = self._view.gone_at.get(node)
                lost_at = min(wall, wall - (mono - seen) if seen is not None else wall) - 1e-6
                self._events.record(EventKind.MEMBER_LOST, node, round=previous.number, at=lost_at,
                                    reason=f"not in round {sealed.number}, without leaving; "
                                           f"reported by {self._node_id}")
        try:
            history = self._events.read()
        except ElasticctlError as exc:
            log.warning("[%s] cannot read the event history: %s", self._node_id, exc)
            history = []
        # The rendezvous part of a recovery; the worker's first step records the whole of it.
        started = recovery_start(history, wall)
        self._events.record(EventKind.ROUND_FORMED, self._node_id, at=wall, round=sealed.number,
                            members=sealed.members, world_size=sealed.world_size,
                            duration=None if started is None else round(wall - started, 3))

    # -- membership ----------------------------------------------------------------------

    def _write_member(self, lease: int | None = None, **fields) -> None:
        # Held through the put: of two threads' writes, the one merged last is written last.
        # (Lock order: _record_lock, then _lock; nothing holding _lock writes the record.)
        with self._record_lock:
            self._record = {**self._record, **fields, "node": self._node_id, "addr": self._local_addr,
                            "pid": os.getpid(), "restarts": self.restarts_spent, "since": now()}
            record = self._record
            if lease is not None:
                self._registry.write_member(self._node_id, record, lease)
            else:
                self._member.bound_to_lease(
                    lambda member_lease: self._registry.write_member(self._node_id, record, member_lease))

    def _leave(self, state: MemberState, **fields) -> None:
        """Leave the round now: the others see it at once, not after node_ttl."""
        self._ignore_errors(lambda: self._write_member(state=state, lease=self._run_lease.id(), **fields))
        self._ignore_errors(self._member.leave)

    def _member_states(self) -> dict[str, str]:
        """Every member record's state, by node (one etcd read; empty if etcd did not answer)."""
        members = self._ignore_errors(self._registry.members) or {}
        return {node: record.get("state") for node, record in members.items() if isinstance(record, dict)}

    def _departed(self, nodes) -> frozenset[str]:
        """Those of ``nodes`` that are gone without a fault: left gracefully, or finished."""
        states = self._member_states()
        return frozenset(n for n in nodes if states.get(n) in (MemberState.LEFT, MemberState.DONE))

    def _kill_workers(self) -> None:
        """SIGKILL this agent's workers: they wait in a collective on a peer that is gone, so
        they can neither finish a step nor checkpoint (torch would give them 30 s)."""
        workers = psutil.Process().children(recursive=True)
        for proc in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(workers, timeout=5)

    # -- requests ------------------------------------------------------------------------

    def _on_requests(self, controls: dict[str, bytes]) -> None:
        """On the watch thread, at once: also while the node is joining a round."""
        request = request_for(controls, self._node_id)
        with self._lock:  # decided and marked at once: the agent's thread may be stopping the node
            action = on_request(request, self._left)
            if action is RequestAction.IGNORE:
                return
            self._left = True
        current = self._round  # the agent's field: read once
        where = f"round {current.number}" if current is not None else "the rendezvous"
        log.warning("[%s] %s requested: leaving %s", self._node_id, request, where)
        # Written now, on the watch thread: the SIGTERM below ends this process soon.
        self._events.record(EventKind.DOWN_REQUESTED if request == "down" else EventKind.LEAVE_REQUESTED,
                            self._node_id, round=None if current is None else current.number,
                            reason=f"leaving {where}")
        if action is RequestAction.LEAVE_AND_CLOSE:
            self._ignore_errors(self.set_closed)
        self._leave(MemberState.LEFT)
        # The agent turns SIGTERM into a clean stop of its workers (SIGTERM first, so
        # trainers checkpoint) and exits without closing the rendezvous. It does so by
        # raising SignalException out of torchrun's main: a requested stop is no crash, so
        # that exception is told in one line instead of a traceback.
        sys.excepthook = _quiet_signal_exit(sys.excepthook, f"{request} requested")
        os.kill(os.getpid(), signal.SIGTERM)

    def _ignore_errors(self, action):
        try:
            return action()
        except ElasticctlError as exc:
            log.warning("[%s] %s", self._node_id, exc)
            return None


def _stop_agent(reason: str) -> None:
    """End torchrun because this node stops (over budget, a failed group after a finish).

    The reason is the line the user needs, so it is printed alone, and torchrun exits 1
    through SystemExit: a RendezvousError would bury it under torch's traceback (about 50
    lines here, after the workers' own). torch's launch_agent still shuts the handler down
    (its ``finally``) and its ``record`` wrapper re-raises a non-zero SystemExit untouched.
    """
    log.error("%s", reason)
    sys.stderr.flush()
    raise SystemExit(1)


def _quiet_signal_exit(previous, why: str):
    """An excepthook that tells torch's SignalException (the agent stopped by a signal) in one
    line and leaves every other exception to ``previous``."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def hook(kind, value, traceback) -> None:
        if issubclass(kind, SignalException):
            print(f"torchrun: stopped its workers and exits ({why}).", file=sys.stderr, flush=True)
            return
        previous(kind, value, traceback)

    return hook

