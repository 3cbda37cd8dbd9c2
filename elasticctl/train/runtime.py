"""The worker-side elastic runtime: a script hands it its state and its training function.

:func:`run` calls ``train(state, group)`` for each generation of workers. The script
ends each step with :meth:`State.commit`; a step boundary is where membership changes:

* **Hot recovery** (the job runs with ``--recovery hot``: the worker environment has hot settings).
  Survivors never restart. A peer's crash makes the step's collective raise at once; a
  frozen peer makes it time out (the process group's timeout is the node TTL). The
  workers then tear the process group down, agree on the next generation in etcd
  (:mod:`elasticctl.train.generations`), build a new group on a fresh store, bring every
  member to the most advanced state (the workers that hold it send it in buckets when steps
  differ or a member is new: :mod:`elasticctl.train.transfer`), re-shard the sampler at the
  exact global position and re-enter ``train``. Joiners, and leavers (SIGTERM), are admitted or let go at a step boundary
  that every worker agrees on: each boundary all-reduces two flags (a change is
  pending; a worker is leaving) asynchronously, and the result is read at the next.
  Replicas stay bit-identical: either every survivor applied the step in flight, or the
  ones that did send their state to the others.
* **Restart mode** (anything else, plain torchrun too): one generation per process, as
  torchrun's round set up; a failure ends the worker and the agent restarts the group,
  which resumes from the newest checkpoint. SIGTERM still ends at a step boundary with a
  final checkpoint.

In either mode every ``--straggler-interval`` steps the workers exchange their own step times
and rank 0 names (and, with ``--evict-stragglers``, asks to leave) a node that sets everyone's
pace: :mod:`elasticctl.train.stragglers`. Every ``--replica-check`` steps they exchange a
checksum of their parameters: rank 0 names (and, with ``--evict-diverged``, asks to leave) a
node whose replica differs from its replicas' majority, and replicas with no majority stop the
job: :mod:`elasticctl.train.replica_check`.

The flags, the straggler exchange and the replica check's are CPU tensors on gloo, never the GPU's: the training
group carries them when it is gloo, a gloo side group over the same ranks otherwise (NCCL),
built and torn down with each generation (why: ``process_group.control_channel``). No step
waits for the device on elasticctl's behalf.

The two modes are two :class:`elasticctl.train.membership.Membership` implementations
(``RestartMembership``, ``HotMembership``), which join generations and return them. Where the
worker goes next is one pure state machine, :func:`elasticctl.train.lifecycle.transition` (it
takes :func:`elasticctl.train.boundary.at_boundary`'s decision at a boundary); the
:class:`Runtime` is its executor.

What the runtime cannot handle in process (etcd unreachable for the whole join timeout,
a process group that will not come down) ends the worker with a non-zero status, and the
node's restart path takes over.

Why one module of over 500 lines: the executor's commands share its fields (the group in use
and its store, the checkpointer, the flags in flight, the last boundary), written on the
training thread; the SIGTERM handler, the watchdog and the loss watcher read the machine's
state (replaced whole) and the last boundary. What can stand alone already does: the decisions
(``lifecycle.py``, ``boundary.py``, the recovery sources' plans in ``recovery/``), the two modes
(``membership.py``), the state (``state.py``), a new generation's state sync (``state_sync.py``)
and the peers' copies of shards (``peer_copies.py``), checkpoints (``checkpoint.py``) and the
process-group set-up (``process_group.py``).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elasticctl.train import script as worker_env
from elasticctl.train import entry as worker_entry
from elasticctl.train.checkpoint import CheckpointError, Checkpointer
from elasticctl.train.group import Group
from elasticctl.errors import ConfigError, ElasticctlError
from elasticctl.job import environment as environment_names
from elasticctl.job.environment import WorkerEnvironment
from elasticctl.job.records import EventKind, Round
from elasticctl.rendezvous.member import JoinCancelled
from elasticctl.job.options import RecoveryMode
from elasticctl.train import lifecycle
from elasticctl.train.boundary import Agreed, BoundaryAction, at_boundary
from elasticctl.train.lifecycle import Command, WorkerState, on_stop_request, transition
from elasticctl.train.connections import GenerationConnections
from elasticctl.train.loss_abort import LossAbort, backend_aborts
from elasticctl.train.membership import HotMembership, Membership, RestartMembership
from elasticctl.train.peer_copies import PeerCopies
from elasticctl.train.phase import Phase
from elasticctl.train.process_group import (build_control_group, build_generation_group,
                                            reconfigure_generation_group, reset_group_counter)
from elasticctl.train.replica_check import ReplicasDisagree
from elasticctl.train.replica_watch import ReplicaWatch
from elasticctl.train.sample_ledger import SampleLedger
from elasticctl.train.non_finite_watch import NonFiniteWatch
from elasticctl.train.ddp_hooks import observe_buckets
from elasticctl.train.reconfigure import (GroupStrategy, ReconfigurableGroup, group_strategy, is_collective_timeout,
                                          next_group, torch_can_reconfigure)
from elasticctl.train.sharded_checkpoint import ShardedStateCheckpointer
from elasticctl.train.shards import ShardedModel, hsdp_layout, is_sharded
from elasticctl.train.state import State, StateError
from elasticctl.train.state_sync import GenerationStateSync
from elasticctl.train.straggler_watch import StragglerWatch
from elasticctl.train.timeline import describe_timeline, recovery_timeline
from elasticctl.train.transfer import DEFAULT_BUCKET_BYTES, check_bucket_bytes

log = logging.getLogger(__name__)

EXIT_RECOVERY_FAILED = 75  # the worker cannot recover in process: its node restarts it
TEARDOWN_BOUND = 10.0      # seconds a process group may take to come down before the worker exits
# Seconds to wait before each retry of a final checkpoint that failed: the last chance to keep
# the trained state, so a few tries (space freed by a prune elsewhere, a transient error).
FINAL_CHECKPOINT_RETRY_DELAYS = (1.0, 2.0, 4.0)
AGREED_FAILURE_BYTES = 1024  # the longest failure text one rank tells the others
# A worker told to stop (SIGTERM) leaves at its next step boundary; one that reaches none in
# this many seconds (a script that never calls state.commit) exits without one, well before
# torch's agent SIGKILLs its workers (30 s after its SIGTERM) with a page of tracebacks.
STOP_BOUND = 10.0
EXIT_STOPPED_WITHOUT_BOUNDARY = 143  # 128 + SIGTERM: what the signal's default action returns


def _no_seam(runtime: Runtime) -> None:
    return None


# A seam for tests: called on the training thread right after a step boundary has read the stop
# flag, so that a test can deliver a stop there (one that boundary did not send), not by timing.
after_stop_flag_read: Callable[[Runtime], None] = _no_seam


def no_step_warning_after(node_ttl: float | None) -> float:
    """Seconds without a step boundary after which a worker warns: twice the longer of the node
    TTL and a minute. A joiner waits for a boundary to be admitted and a leaver to be let go;
    a step longer than this is rare, a script that never calls ``state.commit`` is not."""
    return 2 * max(node_ttl or 0.0, 60.0)


class _Boundary(BaseException):
    """Raised out of the script's function at a step boundary every worker agreed on (a
    BaseException, like KeyboardInterrupt: a script's ``except Exception`` must not swallow it)."""

    def __init__(self, action: BoundaryAction, agreed: Agreed) -> None:
        super().__init__(f"{agreed.leaving} of {agreed.world_size} workers leaving" if agreed.leaving
                         else "membership change")
        self.action = action
        self.agreed = agreed
        self.leaving = agreed.leaving


class Runtime:
    """Drives :func:`run`; see the module docstring."""

    def __init__(self, state: State, *, checkpoint_dir: str | None = None, checkpoint_every: int = 0,
                 backend: str | None = None, wrap: Callable[[torch.nn.Module, Group], torch.nn.Module] | None = None,
                 pg_timeout: float | None = None, keep: int = 3, async_checkpoint: bool = True,
                 on_event: Callable[..., object] | None = None, no_step_warning: float | None = None,
                 transfer_bucket_bytes: int = DEFAULT_BUCKET_BYTES, sharded: bool | str = False) -> None:
        self.state = state
        state.bind(self)
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if torch.cuda.is_available():
            torch.cuda.set_device(self.local_rank)
            self.device, default_backend = torch.device("cuda", self.local_rank), "nccl"
        else:
            self.device, default_backend = torch.device("cpu"), "gloo"
        self.backend = backend or default_backend
        # Decoded once; everything this worker's runtime starts is handed this object.
        self.environment = WorkerEnvironment.from_env()
        settings = self.environment.settings  # the worker settings, None outside elasticctl's handler
        hot = self.environment.recovery is RecoveryMode.HOT
        default_timeout = (settings.hot.node_ttl if hot else None) or 60.0
        self.pg_timeout = datetime.timedelta(seconds=pg_timeout or default_timeout)
        self.membership: Membership = (HotMembership(settings.hot, self._connect_generations) if hot
                                       else RestartMembership(self.backend, self.pg_timeout, self.environment))
        self.checkpoint_dir = worker_env.checkpoint_dir(checkpoint_dir, self.environment)
        self.checkpoint_every = checkpoint_every
        self.keep = keep
        self.transfer_bucket_bytes = check_bucket_bytes(transfer_bucket_bytes)
        self.async_checkpoint = async_checkpoint
        self._on_event = on_event
        # ELASTICCTL_SAMPLE_LEDGER: the samples each step trained (State.commit writes), per start
        self.ledger = SampleLedger.from_environment()
        self._wrap = wrap or self._ddp
        self._wrap_given = wrap is not None
        if sharded not in (False, True, "hsdp"):
            raise ConfigError(f"run(..., sharded={sharded!r}) is not one of False, True or 'hsdp'.")
        # sharded="hsdp": the wrap shards on hsdp_mesh(group), a mesh kept across generations where
        # the groups are reconfigured in place; else each generation's mesh is new (train/shards.py).
        self._keeps_mesh = sharded == "hsdp"
        self._sharded = ShardedModel(wrap) if sharded else None
        if sharded and (wrap is None or state.optimizer is None):
            raise ConfigError("run(..., sharded=True) needs the wrap that shards the model (wrap=...) and an "
                              "optimizer in the state.")
        self.node = self.environment.node or "local"
        self.worker = f"{self.node}.{self.local_rank}"
        # Everything below changes on the training thread (the SIGTERM handler runs there too,
        # between two bytecodes); the no-step watchdog, the stop timer and the loss watcher only
        # read the worker's state (its phase) and _last_boundary, each replaced whole.
        self._worker_state = WorkerState(self.membership.mode)  # the machine's (train/lifecycle.py)
        self._failure: BaseException | None = None  # the failure a RAISE command raises
        self._ending: str | None = None  # why the generation in use ends (for the log), once decided
        self.store: Any = None  # the current generation's TCPStore (hot mode), kept alive with its group
        # The current generation's group for the boundary flags and the straggler exchange (CPU
        # tensors on gloo; None: the training group is gloo and carries them): process_group.py.
        self.control_group: Any = None
        self._checkpointer: Checkpointer | None = None
        self._group: Group | None = None  # the current generation's, while the phase is TRAINING (and its end)
        # This boundary's flags, summed asynchronously over the group, read at the next boundary.
        self._flags_sent: tuple[torch.Tensor, Any] | None = None  # (the flags, torch's Work), on control_group
        self._leaving = False       # told to stop (SIGTERM); acted on at an agreed boundary
        self._leaving_sent = False  # _leaving as this worker sent it with the last flags
        self._noticed_at: float | None = None  # when this worker noticed the fault or change
        # When the fault or change this generation recovers from was noticed; cleared once its
        # first step is recorded (None: the generation ends no recovery, or it is recorded).
        self._recovering_since: float | None = None
        self._recovery_marks: dict[str, float] = {}  # phase -> wall time it ended (train/timeline.py)
        # The job's event history (False: not under elasticctl), made here and not on first use:
        # the watchdog thread records too, and must not race the training thread to create it.
        from elasticctl.job.events import EventLog

        self._events: Any = EventLog.from_env(self.environment) or False
        self._progress: Any = None
        self._samples_since = (time.monotonic(), 0)
        self.no_step_warning = no_step_warning or no_step_warning_after(self.membership.node_ttl)
        self._last_boundary = time.monotonic()  # of this process: the last step boundary, or start
        self._longest_step = 0.0  # seconds between two boundaries, the longest seen
        self._watchdog = threading.Event()  # set: the run is over
        # Stragglers: this worker's own step times and the exchange of them (train/straggler_watch.py).
        self._stragglers = StragglerWatch(None if settings is None else settings.stragglers, self.worker, self.node,
                                          control_group=lambda: self.control_group, record=self._record,
                                          request_leave=self._request_leave)
        # Silent corruption: the replicas' parameter checksums compared (train/replica_watch.py).
        self._replicas = ReplicaWatch(None if settings is None else settings.replicas, self.worker, self.node,
                                      control_group=lambda: self.control_group, replica_set=self._replica_set,
                                      sharded=sharded, record=self._record, request_leave=self._request_leave)
        # NaN and infinities: who produced them, and the step skipped if asked (train/non_finite_watch.py).
        self._non_finite = NonFiniteWatch(None if settings is None else settings.non_finite, self.worker, self.node,
                                          enabled=state.scaler is None, control_group=lambda: self.control_group,
                                          record=self._record)
        self._registry: Any = None
        if state.peer_copies and not sharded:
            raise ConfigError("State(peer_copies=...) is for a sharded model (run(..., sharded=True)); a replicated "
                              "model's replicas already are its copies.")
        # In-memory copies of the shards, on a buddy (train/peer_copies.py); None: not asked for.
        self._peer_copies = (PeerCopies(state.peer_copies, worker=self.worker, timeout=self.pg_timeout,
                                        bucket_bytes=self.transfer_bucket_bytes, emit=self._emit)
                             if state.peer_copies else None)
        # Whether this worker's generations reconfigure one process group or build one each
        # (train/reconfigure.py); restart mode has one generation per process either way.
        self.group_choice = group_strategy(self.backend, torch_can_reconfigure(), sharded=bool(sharded),
                                           default_wrap=wrap is None, kept_mesh=self._keeps_mesh,
                                           forced_rebuild=environment_names.rebuild_groups())
        self.reconfigurable: ReconfigurableGroup | None = None  # the group kept across generations
        self._step_timed_out = False  # the last failed step's collective timed out (a frozen peer)
        self._connections: GenerationConnections | None = None  # hot mode: its generations' groups' connections
        self._wrapped: tuple[Any, torch.nn.Module] | None = None  # (the group it was wrapped on, the DDP)
        self._state_sync = GenerationStateSync(state, device=self.device, transport=self._training_group_device(),
                                               bucket_bytes=self.transfer_bucket_bytes,
                                               restore_from_checkpoint=self._restore_from_checkpoint,
                                               emit=self._emit, worker=self.worker, sharded=self._sharded,
                                               peer_copies=self._peer_copies)

    # -- the loop ------------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        """Where the worker is (read by other threads: the state is replaced whole)."""
        return self._worker_state.phase

    def run(self, train: Callable[[State, Group], object]) -> None:
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        threading.Thread(target=self._watch_steps, name="elasticctl-no-step", daemon=True).start()
        try:
            self._execute(train)
        finally:
            self._worker_state = lifecycle.ended(self._worker_state)
            self._watchdog.set()
            signal.signal(signal.SIGTERM, previous)
            self._close()

    def _execute(self, train: Callable[[State, Group], object]) -> None:
        """Carry out the worker's state machine (train/lifecycle.py): each command's outcome is
        the next event, until a command ends the run."""
        event: lifecycle.Event | None = lifecycle.Started()
        while event is not None:
            self._worker_state, commands = transition(self._worker_state, event)
            event = None
            for command in commands:
                event = self._do(command, train) or event

    def _do(self, command: Command, train: Callable[[State, Group], object]) -> lifecycle.Event | None:
        if command is Command.FORM:
            self._warm_up_sharding()
            self.membership.connect()
            return self._form(rebuild=False)
        if command is Command.RE_FORM:
            return self._form(rebuild=False)
        if command is Command.RE_FORM_AFTER_FAILURE:
            return self._form(rebuild=True)
        if command is Command.TRAIN:
            return self._train(train)
        if command is Command.SAVE_BEFORE_LEAVE:
            return lifecycle.SavedBeforeLeave(self._saved_before_leave(), stop_requested=self._leaving)
        if command in (Command.LEAVE, Command.LEAVE_WITH_JOB):
            self._leave(everyone=command is Command.LEAVE_WITH_JOB)
        elif command is Command.STOP_FOR_AGENT:
            self._stop_for_agent()
        elif command is Command.FINISH:
            self._finish()
        elif command is Command.WARN_NOTHING_TRAINED:
            self._warn_no_step("its training function returned at step 0: nothing was trained "
                               "(does it call state.commit() after each step?)")
        elif command is Command.WITHDRAW:
            log.warning("[%s] told to stop while it waited for a generation; leaving at step %d",
                        self.worker, self.state.step)
            try:
                self.membership.leave()
            except ElasticctlError as exc:  # etcd away: the declaration goes with its lease instead
                log.warning("[%s] could not withdraw its declaration: %s", self.worker, exc)
        elif command is Command.RAISE:
            step, count = self._worker_state.failures_at
            if count >= lifecycle.SAME_STEP_FAILURES:
                log.error("[%s] failed %d times at step %d: %s", self.worker, count, step, self._failure)
            raise self._failure
        elif command is Command.GIVE_UP_FORMING:
            raise ElasticctlError(f"The worker '{self.worker}' could not form a generation in "
                                  f"{lifecycle.FORM_ATTEMPTS} attempts; its node restarts it.")
        else:
            raise lifecycle.IllegalTransition(f"the training thread does not carry out '{command.value}'")
        return None

    def _train(self, train: Callable[[State, Group], object]) -> lifecycle.Event:
        """The script's function in the generation in use, until it returns, a boundary every
        worker agreed on calls for a change, or a step fails."""
        if self.ledger is not None:
            self.ledger.started(self.state.step, self.state.sampler)
        try:
            train(self.state, self._group)
        except _Boundary as boundary:
            self._ending = (f"{boundary.leaving} leaving" if boundary.leaving
                            else self.membership.describe_change())
            return lifecycle.BoundaryAgreed(boundary.agreed, me_leaving=self._leaving_sent)
        except Exception as exc:
            self._failure = exc
            # A collective that timed out (a frozen peer): the group may be kept (reconfigure.next_group)
            self._step_timed_out = is_collective_timeout(exc)
            self._ending = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            # Replicas with no majority: every node restarting (or re-forming) would train on
            # from state no one can vouch for, so each node stops with the sentence instead.
            fatal = isinstance(exc, ReplicasDisagree)
            if fatal:
                log.error("[%s] %s", self.worker, exc)
                worker_entry.note_unrecoverable(str(exc))
            return lifecycle.StepFailed(self.state.step, fatal=fatal)
        return lifecycle.TrainReturned(self.state.step)

    def _warm_up_sharding(self) -> None:
        """Hot mode with a kept HSDP mesh: before its first generation, make this worker's group
        (alone, as the first reconfigure would) and run a throwaway sharded step in that world of
        one (ShardedModel.warm_up), so that a worker joining a running job does not make the running
        workers wait through torch's first-use costs. A warm-up that fails costs nothing but the
        time: the first generation pays those costs instead."""
        if (self._sharded is None or not self._keeps_mesh or not self.membership.recovers_in_process
                or self.group_choice.strategy is not GroupStrategy.RECONFIGURE):
            return
        started = time.monotonic()
        try:
            self.reconfigurable = ReconfigurableGroup(self.backend, self.pg_timeout, with_mesh=True)
            alone = Group(number=0, rank=0, world_size=1, local_rank=self.local_rank, device=self.device,
                          model=self.state.model, members=(self.worker,), local_world_size=1, timeout=self.pg_timeout)
            self._sharded.warm_up(self.state, alone)
        except Exception as exc:  # noqa: BLE001 - torch's errors of a script's own wrap or optimizer
            log.warning("[%s] the sharded warm-up before joining failed (the first generation pays its cost "
                        "instead): %s", self.worker, " ".join(str(exc).split())[:300])
            return
        self._emit("warmed_up", seconds=round(time.monotonic() - started, 3))

    def _form(self, rebuild: bool) -> lifecycle.Event:
        """Into the next generation (the first one: :meth:`Membership.connect` came first): the
        current group down (kept where it is reconfigured in place: train/reconfigure.py, after a
        change agreed at a boundary or a collective that timed out), the generation sealed, its
        groups built or reconfigured, the state in sync. ``rebuild``: after a failure (every group
        anew, unless this worker's collective timed out: reconfigure.next_group)."""
        if self._group is not None:  # a generation ends: what ended it, and when it was noticed
            log.warning("[%s] generation %s ends at step %d: %s", self.worker, self._group.number,
                        self.state.step, self._ending)
            self._noticed_at = self._noticed_at or time.time()
            self._recovery_marks = {}
        first = self._worker_state.phase is Phase.FORMING
        timed_out, self._step_timed_out = rebuild and self._step_timed_out, False
        if rebuild and not timed_out and self._connections is not None:
            # The peers still waiting on this worker in the failed generation's collectives learn
            # of it now, not at their timeout (train/connections.py); a timeout every survivor
            # waits out alike, and keeps its group.
            self._connections.sever()
        step = next_group(self.group_choice.strategy, group_alive=self.reconfigurable is not None, failed=rebuild,
                          timed_out=timed_out)
        if rebuild and step is GroupStrategy.RECONFIGURE:
            # The group is kept, not the modules a failed step left half-way: DDP is wrapped anew on
            # it, a sharded model re-wrapped on the same kept mesh (its caches stay warm).
            self._wrapped = None
            if self._sharded is not None:
                self._sharded.after_failure = True
        self.teardown(keep_group=step is GroupStrategy.RECONFIGURE)
        self.mark_recovery("torn_down")
        try:
            sealed = self.membership.join()
        except JoinCancelled:
            return lifecycle.JoinCancelled()
        self.mark_recovery("sealed")
        # Only gloo's connections (train/connections.py): an NCCL group's own sockets are its
        # abort's business, so with NCCL only the gloo side group's are recorded.
        records_training_group = self._connections is not None and not backend_aborts(self.backend)
        connections_before = self._connections.current() if records_training_group else None
        try:
            if not sealed.groups_ready:
                if self.group_choice.strategy is GroupStrategy.RECONFIGURE:
                    rows = (hsdp_layout(sealed.generation.members, sealed.world_size, self.local_world_size)
                            if self._keeps_mesh else None)
                    self.reconfigurable, self.store = reconfigure_generation_group(
                        self.reconfigurable, sealed.generation, sealed.rank, self.backend, self.pg_timeout,
                        mesh_rows=rows)
                else:
                    self.store = build_generation_group(sealed.generation, sealed.rank, self.backend,
                                                        self.pg_timeout, self.device)
            if self._connections is not None and connections_before is None:
                connections_before = self._connections.current()
            self.control_group = build_control_group(self.backend, self.pg_timeout)
            if connections_before is not None:
                self._connections.record_build(connections_before, sealed.generation.master_port)
            if not sealed.groups_ready:
                self.mark_recovery("group_reconfigured" if step is GroupStrategy.RECONFIGURE else "group_built")
            self.start_generation(sealed.generation, sealed.rank, sealed.world_size,
                                  None if first else self._noticed_at)
        except StateError as exc:  # what a peer sent does not fit: another generation would send the same
            self._failure = exc
            return lifecycle.FormFailed(fatal=True)
        except Exception as exc:  # noqa: BLE001 - a taken port, a peer lost while connecting or sending
            self._failure = exc
            if not dist.is_initialized():
                reset_group_counter()  # the failed init left torch's group counter raised
            if self.membership.recovers_in_process:
                log.warning("[%s] generation %d did not form (attempt %d of %d): %s", self.worker,
                            sealed.generation.number, self._worker_state.form_attempt, lifecycle.FORM_ATTEMPTS,
                            " ".join(str(exc).split())[:300])
            return lifecycle.FormFailed()
        return lifecycle.Formed()

    def _on_sigterm(self, signum, frame) -> None:
        self._leaving = True  # acted on at the next step boundary every worker agrees on
        worker_entry.note_stop_request()
        for command in on_stop_request(self.phase):
            if command is Command.CANCEL_JOIN:
                self.membership.cancel()  # between generations there is no boundary to wait for
            elif command is Command.START_STOP_TIMER:
                # A script whose steps are long gets twice its longest step to reach the boundary.
                bound = threading.Timer(max(STOP_BOUND, 2 * self._longest_step), self._exit_without_boundary,
                                        args=(self._last_boundary,))
                bound.daemon = True
                bound.start()

    def _exit_without_boundary(self, boundary_at_signal: float) -> None:
        """Still running after SIGTERM (STOP_BOUND s, or twice the longest step) without a step
        boundary since: leave now."""
        if self._watchdog.is_set() or self._last_boundary != boundary_at_signal:
            return  # the run ended, or a boundary came (it acts on the stop, and may be saving)
        log.error("[%s] told to stop, it reached no step boundary (state.commit) within %g s: "
                  "exiting at step %d without a final checkpoint", self.worker,
                  max(STOP_BOUND, 2 * self._longest_step), self.state.step)
        sys.stderr.flush()
        os._exit(EXIT_STOPPED_WITHOUT_BOUNDARY)

    def _watch_steps(self) -> None:
        """Warn (log and event) each time no step boundary came for ``no_step_warning`` seconds."""
        warned_for = None
        while not self._watchdog.wait(min(5.0, self.no_step_warning / 4)):
            last = self._last_boundary
            if self.phase is not Phase.TRAINING or last == warned_for:
                continue  # between generations waiting is normal; warn once per silence
            idle = time.monotonic() - last
            if idle >= self.no_step_warning:
                warned_for = last
                self._warn_no_step(f"no step boundary for {idle:.0f} s at step {self.state.step}: a joiner "
                                   "is admitted and a leaver let go only at one (does the training "
                                   "function call state.commit() after each step?)")

    def _warn_no_step(self, what: str) -> None:
        log.warning("[%s] %s", self.worker, what)
        self._record(EventKind.NO_STEP, step=self.state.step, reason=what)

    # -- generations ---------------------------------------------------------------------

    def _connect_generations(self):
        """Hot mode: this worker's part in its job's generations, from its environment."""
        from elasticctl.etcd.client import EtcdClient
        from elasticctl.train.generations import Generations

        etcd = self.environment.etcd_settings(retry_timeout=30.0)
        if etcd is None:
            raise ElasticctlError(f"{environment_names.WORKER_SETTINGS} asks for hot recovery but {environment_names.ETCD} "
                                  f"or {environment_names.JOB} is not.")
        if self.backend == "nccl":
            # A lost peer must raise in this process, not end it (why: environment.NCCL_HOT_RECOVERY).
            for name, value in environment_names.NCCL_HOT_RECOVERY.items():
                os.environ.setdefault(name, value)
        addr = self.environment.node_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
        # The connections of each generation's groups, shut down when one fails (train/connections.py):
        # never etcd's, whose client lives on across generations.
        self._connections = GenerationConnections(self.worker, other_ports={e.port for e in etcd.endpoints})
        generations = Generations(EtcdClient(etcd), self.environment.job_keys(), self.worker, addr,
                                  self.membership.settings, self.environment.secret_bytes(),
                                  sharded=self._sharded is not None)
        # A member lost while this worker may wait in a collective with it: abort the group
        # where the backend can (train/loss_abort.py), not wait for the collective's timeout.
        generations.on_member_lost(LossAbort(self.worker, self.backend,
                                             lambda: (self.phase, self.running_generation)).on_lost)
        return generations

    @property
    def running_generation(self) -> int | None:
        """The generation of the training group in use (None: none yet)."""
        group = self._group
        return None if group is None else group.number

    def mark_recovery(self, phase: str) -> None:
        """The wall time a phase of the recovery in progress ended (the membership marks its own;
        a phase repeated by a second attempt to form keeps its last time)."""
        self._recovery_marks[phase] = time.time()

    def start_generation(self, generation: Round, rank: int, world_size: int, noticed_at: float | None) -> Group:
        """Train in ``generation`` (its process group is up): the state in sync, the sampler
        re-dealt, the model wrapped. Called by the membership."""
        self._checkpointer = self._checkpointer_for(rank)
        group = Group(number=generation.number, rank=rank, world_size=world_size, local_rank=self.local_rank,
                      device=self.device, model=self.state.model, members=generation.members,
                      local_world_size=self.local_world_size, timeout=self.pg_timeout,
                      mesh_groups=(self.reconfigurable.mesh_groups if self.reconfigurable is not None
                                   and self._keeps_mesh else None))
        if self._sharded is not None:
            # The shards move between the modules of this generation's mesh: wrapped first.
            held = self.state.step if self.state.live else -1  # whether or not its shards still fit
            self._state_sync.rewrap(group)
            self.mark_recovery("module_kept" if self._sharded.kept else "rewrapped")
            group = dataclasses.replace(group, shard=self._sharded.position.index)
            sent_from = self._state_sync.sync_shards(rank, world_size, generation.number, held)
            model = self.state.model
        else:
            # DDP broadcasts rank 0's parameters when it wraps: the state is in sync before.
            sent_from = self._state_sync.sync_state(rank, world_size, generation.number)
            model = self._wrap(self.state.model, group)
            if self._wrap_given and is_sharded(model):
                raise ConfigError("The wrap sharded the model (its parameters are DTensors): pass "
                                  "run(..., sharded=True), so that checkpoints and hot recovery move shards.")
        self.mark_recovery("state_synced")
        if self.state.sampler is not None:  # the global position stays; the deal changes
            self.state.sampler.num_replicas, self.state.sampler.rank = world_size, rank
        group = dataclasses.replace(group, model=model)
        self._group = group
        self._noticed_at = None
        self._flags_sent = None
        self._stragglers.new_generation()
        self._replicas.new_generation()
        self._non_finite.new_generation()
        log.info("[%s] generation %d: rank %d of %d at step %d%s; boundary collectives on %s", self.worker,
                 generation.number, rank, world_size, self.state.step,
                 f" (state from rank {', '.join(map(str, sent_from))})" if sent_from else "",
                 self._describe_control_group())
        if rank == 0:
            self._progress_publisher()
            if self.membership.records_generations:
                duration = None if noticed_at is None else round(time.time() - noticed_at, 3)
                self._record(EventKind.ROUND_FORMED, round=generation.number, members=generation.members,
                             world_size=world_size, duration=duration, reason="workers' generation (hot)")
        self._recovering_since = noticed_at
        self._last_boundary = time.monotonic()  # steps (and silences) count from here
        self._samples_since = (time.monotonic(), 0)
        return group

    def teardown(self, keep_group: bool = False) -> None:
        """Take the process groups down, bounded: one that will not come down ends the worker.
        ``keep_group``: the next generation reconfigures this worker's group in place
        (train/reconfigure.py: only after a change agreed at a boundary, when nothing is pending)."""
        self._flags_sent = None
        self._group = None
        if self._peer_copies is not None:
            self._peer_copies.freeze()  # a copy round still out commits nothing now
        if keep_group and self.reconfigurable is not None:
            # The group stays; the generation's store goes (its port may be the next one's).
            self.reconfigurable.release_store()
            self.store = None
            return
        self.reconfigurable = None
        # destroy_process_group() below takes the side group down with the training group; the
        # last reference goes here, so that its gloo threads and sockets go with it. (A failed
        # generation's connections were shut down before: train/connections.py.)
        self.control_group = None
        if not dist.is_initialized():
            return
        stuck = threading.Timer(TEARDOWN_BOUND, _exit_stuck, args=(self.worker,))
        stuck.daemon = True
        stuck.start()
        try:
            if self.backend == "nccl":
                dist.group.WORLD.abort()  # unblocks NCCL kernels waiting on a lost peer
            dist.destroy_process_group()
        finally:
            stuck.cancel()
        self.store = None

    def _restore_from_checkpoint(self, **event: Any) -> Any:
        """The newest checkpoint into the state (its Restored; None: there is none). In hot mode the
        script also hears ``state_restored`` (source checkpoint, with ``event``'s fields)."""
        restored = self._checkpointer.restore(**self.state.objects()) if self._checkpointer else None
        if restored is not None:
            self.state.step = restored.step
            self.state.update_fields(restored.extra.get("fields", {}))
            log.info("[%s] resumed from %s at step %d", self.worker, restored.path, restored.step)
            self._emit("resume", step=restored.step, epoch=self._epoch(), consumed=self._consumed(),
                       from_world_size=restored.world_size, path=str(restored.path))
            if self.membership.recovers_in_process:
                self._emit("state_restored", step=restored.step, source="checkpoint", path=str(restored.path),
                           **event)
        self.state.live = True
        return restored

    def _checkpointer_for(self, rank: int) -> Checkpointer | None:
        if not self.checkpoint_dir:
            return None
        if self._checkpointer is None:
            kind = ShardedStateCheckpointer if self._sharded is not None else Checkpointer
            return kind(self.checkpoint_dir, keep=self.keep, async_save=self.async_checkpoint,
                        device=self.device, environment=self.environment)
        self._checkpointer.follow_rank(rank)
        return self._checkpointer

    # -- step boundaries -----------------------------------------------------------------

    def before_step_applied(self, loss: float | None = None) -> bool:
        """Called by :meth:`State.commit` before the optimizer step; whether to apply it.

        Non-finite gradients are named, and the step skipped with ``--skip-non-finite 1``
        (:mod:`elasticctl.train.non_finite_watch`: the same answer on every worker). Hot mode,
        sharded model: the workers of each shard group agree that all of their gradients
        arrived, so that a peer lost mid-backward leaves no node with its shards at two steps (the
        next generation's state sync needs one step per row:
        :meth:`ShardedModel.agree_gradients_complete`). Restart mode restores every worker from
        the checkpoint anyway."""
        if self.phase is not Phase.TRAINING:
            return True
        if self._sharded is not None and self.membership.mode is RecoveryMode.HOT:
            self._sharded.agree_gradients_complete()
        return self._non_finite.before_step(self._group, self.state.step, loss, self.state.model.parameters(),
                                            sharded=self._sharded is not None)

    def step_done(self, samples: int = 0, loss: float | None = None) -> None:
        """Called by :meth:`State.commit` after the step is applied; may raise _Boundary."""
        now = time.monotonic()
        if self.phase is Phase.TRAINING:  # a step within a generation (not the wait for one)
            self._longest_step = max(self._longest_step, now - self._last_boundary)
        self._last_boundary = now
        if self.phase is not Phase.TRAINING:
            return
        self._stragglers.step_done()
        group = self._group
        self._record_first_step(group)
        self._act_on(self._flags_in_flight())
        self._stragglers.at_boundary(group, self.state.step)
        self._replicas.at_boundary(group, self.state.step, self.state.model)  # before the checkpoint of the step
        if self._checkpointer and self.checkpoint_every and self.state.step % self.checkpoint_every == 0:
            self._save()
        if self._peer_copies is not None:
            self._peer_copies.at_boundary(self.state, self._sharded, group)
        self._publish_progress(group, samples, loss)
        self._act_on(self._send_flags(group))
        self._stragglers.next_step()

    def _act_on(self, agreed: Agreed | None) -> None:
        """Leave the script's function if what the workers agreed on calls for it."""
        if agreed is None:
            return
        action = at_boundary(self.membership.mode, agreed, self._leaving_sent)
        if action is not BoundaryAction.CONTINUE:
            self._noticed_at = time.time()
            raise _Boundary(action, agreed)

    def _flags_in_flight(self) -> Agreed | None:
        """The flags sent at the previous boundary, agreed on since (None: none in flight)."""
        if self._flags_sent is None:
            return None
        flags, work = self._flags_sent
        work.wait()
        self._flags_sent = None
        pending, leaving = (int(v) for v in flags.tolist())
        return Agreed(pending, leaving, self._group.world_size)

    def _send_flags(self, group: Group) -> Agreed | None:
        """This boundary's flags to every worker, agreed when the machine's rule says
        (:func:`lifecycle.when_flags_agreed`). CPU tensors on the control group: reading them
        never waits for a GPU."""
        pending = self.membership.change_pending()
        # Read once: the SIGTERM handler sets it between any two bytecodes, and what this boundary
        # sends must be what it records having sent (a worker that sent "leaving" while recording
        # that it did not would re-form while the others enter the final checkpoint without it).
        leaving = self._leaving_sent = self._leaving
        after_stop_flag_read(self)
        when = lifecycle.when_flags_agreed(self.membership.mode, group.world_size)
        if when is lifecycle.FlagsAgreed.ALONE:
            return Agreed(int(pending), int(leaving), 1)
        flags = torch.tensor([int(pending), int(leaving)], dtype=torch.int64)
        self._flags_sent = (flags, dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=self.control_group,
                                                   async_op=True))
        return self._flags_in_flight() if when is lifecycle.FlagsAgreed.AT_THIS_BOUNDARY else None

    def _replica_set(self) -> int | None:
        """This worker's replica-set key for the replica check: every worker one set (DDP), the
        shard index on an HSDP mesh, None for a sharded model without replicas."""
        if self._sharded is None:
            return 0
        return self._sharded.position.index if self._sharded.replicate_dim is not None else None

    def _request_leave(self, node: str) -> None:
        """Ask ``node`` to leave as ``elasticctl leave`` does, on the event writer thread (the
        training thread never waits for etcd)."""
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

    def _ddp(self, model: torch.nn.Module, group: Group) -> torch.nn.Module:
        """The default wrapping (DDP), timing this worker's own part of each step when the job
        watches for stragglers (the hook's why: elasticctl.train.stragglers). On a group
        reconfigured in place the DDP it was wrapped on goes on: its reducer follows the group's
        live size (tests/process/test_torch_reconfigure.py), as long as no newcomer joined: a
        DDP's first steps run collectives of their own (the bucket order is agreed from rank 0
        after the first), so with a newcomer every member wraps anew, on the same group."""
        world = dist.group.WORLD if dist.is_initialized() else None
        if (self._wrapped is not None and world is not None and self._wrapped[0] is world
                and self._state_sync.continued):
            return self._wrapped[1]
        # On a reconfigurable group no collective at the wrap: the state sync already made every
        # replica equal.
        wrapped = observe_buckets(_ddp(model, group, init_sync=self.reconfigurable is None),
                                  (self._stragglers.bucket_observer(), self._non_finite.bucket_observer()))
        self._wrapped = (world, wrapped) if self.reconfigurable is not None else None
        return wrapped

    def _record_first_step(self, group: Group) -> None:
        """The first step of a generation formed after a fault or change ends that recovery: its
        timeline goes to the script (every rank) and, from rank 0, to the job's history."""
        if self._recovering_since is None:
            return
        noticed, self._recovering_since = self._recovering_since, None
        self.mark_recovery("first_step")
        timeline = recovery_timeline(noticed, self._recovery_marks)
        self._emit("recovery_timeline", round=group.number, noticed=noticed, **timeline)
        if group.rank == 0:
            self._record(EventKind.RECOVERY_FINISHED, round=group.number, world_size=group.world_size,
                         step=self.state.step, duration=round(time.time() - noticed, 3),
                         reason=describe_timeline(timeline))

    def _publish_progress(self, group: Group, samples: int, loss: float | None) -> None:
        if self._progress is None or group.rank != 0:
            return
        began, count = self._samples_since
        count += samples * group.world_size
        self._samples_since = (began, count)
        elapsed = time.monotonic() - began
        self._progress.publish(step=self.state.step, epoch=self._epoch(), loss=loss,
                               samples_per_s=count / elapsed if elapsed > 0 and count else None,
                               world_size=group.world_size,
                               last_checkpoint_step=self._checkpointer.last_step if self._checkpointer else None,
                               **self._checkpoint_health())

    def checkpoint_now(self) -> None:
        """:meth:`State.checkpoint`: a save at a point every worker reaches (not a boundary)."""
        if self._checkpointer is not None and self.phase is Phase.TRAINING:
            self._save()  # even at a step already saved: the state may have moved on (a new epoch)

    # -- endings -------------------------------------------------------------------------

    def _leave(self, everyone: bool) -> None:
        """This worker was told to stop (SIGTERM): a final checkpoint if the whole job stops
        (the state lives on in the others otherwise), then out of the generation."""
        if everyone:
            self._stop_checkpoint()
        self.membership.leave()
        self.teardown()
        log.warning("[%s] left at step %d%s", self.worker, self.state.step,
                    " with the whole job (final checkpoint)" if everyone else "")

    def _saved_before_leave(self) -> bool:
        """Every worker of the generation, at the boundary where some of them leave: a checkpoint
        of the step all of them trained (:func:`elasticctl.train.boundary.checkpoint_before_leave`),
        agreed on by every rank. False without a checkpoint directory, or when the write failed on
        any rank: one attempt, not the final checkpoint's retries, since the state lives on in the
        workers that stay (a full disk must not end them); the leave goes on as without it."""
        if self._checkpointer is None:
            return False
        saved = self._checkpointer.last_step == self.state.step or self._save(blocking=True)
        failure = self._agree_on_failure(None if saved else str(self._checkpointer.failure or "the write failed"))
        if failure is not None:
            log.warning("[%s] the checkpoint of step %d before %s leave failed (%s); the workers that stay "
                        "keep the state", self.worker, self.state.step, "it and others" if self._leaving
                        else "others", failure)
            return False
        self._emit("final_checkpoint", step=self.state.step, signalled=self._leaving)
        return True

    def _stop_for_agent(self) -> None:
        """Restart mode, a worker was told to stop: every rank saves the same final checkpoint;
        the signalled ones exit 0, the others raise PeerLeaving (their agent re-forms without
        the leaver, from that checkpoint)."""
        self._stop_checkpoint()
        dist.barrier()
        if not self._leaving:
            raise worker_env.PeerLeaving("A peer is leaving the job; restarting to re-form without it.")
        self.teardown()

    def _finish(self) -> None:
        self._final_checkpoint()
        if self._flags_sent is not None:
            self._flags_sent[1].wait()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # every rank done with its collectives before gloo's pairs close
        self.membership.leave()
        self.teardown()

    def _final_checkpoint(self) -> None:
        """The checkpoint of the state training ends with, retried, and agreed on by every rank: if
        it failed on any, every rank raises the same CheckpointError (naming why, e.g. the disk is
        full) and marks its worker unrecoverable, so that no node restarts workers only to re-train
        the steps since the last good checkpoint and fail on the same disk again."""
        if self._checkpointer is None:
            return
        self._report_background_failure()
        # Every rank takes part in each attempt (a writer that fails, the others that wait for
        # it): no rank waits in a collective through all the retries, longer than a timeout.
        for attempt, delay in enumerate((*FINAL_CHECKPOINT_RETRY_DELAYS, None), start=1):
            saved = self._checkpointer.last_step == self.state.step or self._save(blocking=True)
            failure = self._agree_on_failure(None if saved else str(self._checkpointer.failure or "the write failed"))
            if failure is None:
                return
            if delay is None:
                message = (f"The final checkpoint failed {attempt} times, the training of step "
                           f"{self.state.step} is not saved: {failure}")
                worker_entry.note_unrecoverable(message)
                raise CheckpointError(message)
            log.warning("[%s] retrying the final checkpoint of step %d in %g s", self.worker,
                        self.state.step, delay)
            time.sleep(delay)

    def _agree_on_failure(self, failure: str | None) -> str | None:
        """The failure of the lowest rank that had one, on every rank (None: no rank failed).

        A fixed-size byte tensor rather than ``broadcast_object_list``: nothing a peer sends is
        unpickled."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return failure
        device = self._training_group_device()
        world = dist.get_world_size()
        first = torch.tensor([dist.get_rank() if failure is not None else world], dtype=torch.int64, device=device)
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        source = int(first.item())
        if source == world:
            return None
        text = torch.zeros(AGREED_FAILURE_BYTES, dtype=torch.uint8, device=device)
        if source == dist.get_rank():
            encoded = failure.encode()[:AGREED_FAILURE_BYTES]
            text[:len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
        dist.broadcast(text, source)
        sent = bytes(text.cpu().tolist()).rstrip(b"\0").decode(errors="replace")
        return sent if source == dist.get_rank() else f"{sent.rstrip('.')} (on rank {source})."

    def _stop_checkpoint(self) -> None:
        """The final checkpoint of a stop (SIGTERM), reported on every rank."""
        self._final_checkpoint()
        if self._checkpointer is not None:
            self._emit("final_checkpoint", step=self.state.step, signalled=self._leaving)

    def _save(self, blocking: bool | None = None) -> bool:
        """Checkpoint the state; False if the write failed (or, async, if the previous one did).

        A failed checkpoint costs training nothing: no re-formation, no restart. The
        checkpointer logs it and records a ``checkpoint_failed`` event, the progress record
        carries it to status, doctor and the dashboard, and the next save tries again (space
        may have come back). Only rank 0 writes, and no collective runs here, so the other
        ranks need not hear of it.
        """
        self._report_background_failure()  # else save() would raise it and skip this save
        began = time.perf_counter()
        try:
            self._checkpointer.save(self.state.step, self._epoch(), extra={"fields": self.state.fields},
                                    blocking=blocking, **self.state.objects())
        except CheckpointError as exc:
            self._emit("checkpoint_failed", step=self.state.step, reason=str(exc))
            return False
        if self._checkpointer.is_writer:  # blocked_ms: how long the training thread stood still for it
            self._emit("checkpoint", step=self.state.step, epoch=self._epoch(), consumed=self._consumed(),
                       blocked_ms=round((time.perf_counter() - began) * 1000, 2),
                       **{"async": not blocking and self._checkpointer.async_save})
        return True

    def _report_background_failure(self) -> None:
        """Wait for a background write; a failure of it is reported like a blocking one's."""
        try:
            self._checkpointer.wait()
        except CheckpointError as exc:
            self._emit("checkpoint_failed", step=getattr(exc, "step", None), reason=str(exc))

    def _checkpoint_health(self) -> dict:
        """The progress record's checkpoint fields: set while checkpoints fail."""
        failure = self._checkpointer.failure if self._checkpointer else None
        if failure is None:
            return {}
        return {"checkpoint_error": str(failure), "checkpoint_failures": self._checkpointer.failures_in_a_row}

    def _close(self) -> None:
        if self.ledger is not None:
            self.ledger.close()
        if self._checkpointer is not None:
            try:
                self._checkpointer.close()
            except CheckpointError:
                pass  # a write that failed while the worker stopped otherwise: logged and recorded
        if self._progress is not None:
            self._progress.close()
        if self._events:  # False: not under elasticctl
            self._events.flush(5.0)
        self.membership.close()
        self.control_group = None  # destroyed with the training group (the run ended without a teardown)
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- helpers -------------------------------------------------------------------------

    def _training_group_device(self) -> torch.device:
        """Where the tensors of the runtime's collectives on the training group live (once per
        generation: the state sync and transfer; the final checkpoint's agreement)."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def _describe_control_group(self) -> str:
        """For the generation's log line: where the boundary flags and straggler exchange go."""
        if self.control_group is None:
            return f"the training group ({self.backend})"
        return f"a side group ({dist.get_backend(self.control_group)}) beside the training group ({self.backend})"

    def _epoch(self) -> int:
        return int(getattr(self.state.sampler, "epoch", 0))

    def _consumed(self) -> int | None:
        consumed = getattr(self.state.sampler, "consumed", None)
        return None if consumed is None else int(consumed)

    def _emit(self, kind: str, **fields: Any) -> None:
        if self._on_event is not None:
            self._on_event(kind, **fields)

    def _progress_publisher(self) -> None:
        if self._progress is None:
            from elasticctl.job.progress import ProgressPublisher

            self._progress = ProgressPublisher.from_env(0, recoveries=self.membership.mode is RecoveryMode.RESTART,
                                                        environment=self.environment)

    def _record(self, kind: EventKind, node: str | None = None, **fields) -> None:
        """Record an event of ``node`` (default: this worker's; "": the job's own) on the event
        writer thread."""
        if self._events:
            self._events.record_later(kind, self.node if node is None else node, **fields)


def _ddp(model: torch.nn.Module, group: Group, init_sync: bool = True) -> torch.nn.Module:
    if group.world_size == 1 and not dist.is_initialized():
        return model
    return DistributedDataParallel(model, device_ids=[group.local_rank] if group.device.type == "cuda" else None,
                                   init_sync=init_sync)


def _exit_stuck(worker: str) -> None:
    log.error("[%s] its process group did not come down within %g s; the node restarts the worker",
              worker, TEARDOWN_BOUND)
    sys.stderr.flush()
    os._exit(EXIT_RECOVERY_FAILED)


def run(state: State, train: Callable[[State, Group], object], **options: Any) -> None:
    """Train ``state`` with ``train(state, group)``, generation after generation; see the module
    docstring. ``options``: ``checkpoint_dir`` (default: the one elasticctl hands out),
    ``checkpoint_every`` (steps; 0: only a final checkpoint), ``backend``, ``wrap``
    (``(model, group) -> model``, default DDP), ``pg_timeout`` (seconds), ``keep`` (checkpoints
    kept), ``async_checkpoint`` (periodic saves written by a background thread; default on).

    ``on_event(kind, **fields)``, if given, hears what the runtime did, for the script's own
    records: ``"resume"`` after a checkpoint restore (step, epoch, consumed, from_world_size,
    path); ``"checkpoint"`` on the writing rank after each save (step, epoch, consumed,
    async, blocked_ms: how long the save held up training); ``"checkpoint_failed"`` on the
    writing rank when a save (or the background write of the previous one) failed (step,
    reason); training goes on; ``"final_checkpoint"`` on every
    rank when a stop (SIGTERM) ends training with a final checkpoint (step, signalled: this
    worker was the one told to stop); ``"recovery_timeline"`` on every rank at the first step
    after a fault or change (round, noticed: the wall time the fault was seen, then the seconds
    from it to the end of each phase: torn_down, sealed, group_built or group_reconfigured, rewrapped or module_kept (sharded models),
    state_synced, first_step;
    see elasticctl/train/timeline.py). ``no_step_warning``: seconds without a step boundary
    (``state.commit``) after which the worker warns (default :func:`no_step_warning_after`).
    ``transfer_bucket_bytes``: the largest message of a hot recovery's state transfer (default
    64 MiB; :mod:`elasticctl.train.transfer`).

    ``sharded=True``: ``wrap`` shards the model (FSDP2 ``fully_shard`` on a mesh it builds); the
    runtime wraps a new module for each generation's mesh (``group.model``, also ``state.model``:
    use these, not the model object the script made), writes sharded checkpoints (DCP, resharded
    on load) and in hot mode moves shards: :mod:`elasticctl.train.shards`. ``sharded="hsdp"``: the
    wrap shards on :func:`elasticctl.train.shards.hsdp_mesh` (replicated across nodes, sharded
    within one), and where groups are reconfigured in place (``recovery_timeline``'s
    ``group_reconfigured``) that mesh and the module sharded on it outlive generations: a change
    agreed at a step boundary re-forms its groups, a survivor keeps its module and its shards, and
    only a newcomer wraps; after a frozen peer's timeout the groups are kept and the module is
    re-wrapped on the same mesh; after a lost peer every group, and so the module, is made anew.

    In hot mode ``"state_restored"`` on a rank whose state was restored when its generation formed:
    step, source ("replica": senders, nbytes, seconds; "checkpoint": path; "peer_copy": the shards
    held in memory, ``State(peer_copies=K)``: trained, redone, copies_of, copy_holders, nbytes,
    seconds), and for a sharded model the shard this worker holds (and, from a checkpoint,
    ``missing``: the shards that had no replica). With peer copies, ``"peer_copy"`` at the first
    step boundary after each copy round every worker agreed was whole (step, shard, nbytes sent,
    copies_of: the shards received, seconds)."""
    Runtime(state, **options).run(train)
