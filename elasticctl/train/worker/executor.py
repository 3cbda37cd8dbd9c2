"""The executor of a worker's state machine (:mod:`elasticctl.train.worker.lifecycle`): it feeds the pure
transition function what happened and carries out the commands it gets back, through parts that
each own their state and never call one another:

* :class:`~elasticctl.train.worker.generation_manager.GenerationManager`: the membership, the
  process groups, the store, the generation in use;
* :class:`~elasticctl.train.worker.step_boundary.StepBoundary`: the boundary flags in flight and
  the one read of the stop request per boundary;
* :class:`~elasticctl.train.worker.checkpoint_duty.CheckpointDuty`: periodic, before a leave,
  final, restore;
* :class:`~elasticctl.train.worker.watch_supervisor.Watches`: stragglers, the replica check, non-finite;
* :class:`~elasticctl.train.worker.model_placement.ModelPlacement`: the state in sync, the model
  wrapped, per generation;
* :class:`~elasticctl.train.worker.reporter.Reporter`: the script's events, the job's history,
  progress, a recovery's timeline;
* :class:`~elasticctl.train.worker.liveness.LivenessBoard` and
  :class:`~elasticctl.train.worker.watchdog.Watchdog`: what the other threads read, and the
  no-step and stop clocks that read it.

The executor decides nothing: whether a group is kept, a model re-wrapped, a failure fatal or
retried, a worker's exit 0 or :class:`~elasticctl.train.script.PeerLeaving` are the machine's,
carried in its events and commands. A step boundary's event is transitioned where it happens
(inside :meth:`State.commit`), once; when it calls for more than the next step the boundary
leaves the script's function with the machine's next state and commands."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elasticctl.errors import ElasticctlError
from elasticctl.job import environment as environment_names
from elasticctl.job.environment import WorkerEnvironment
from elasticctl.job.options import RecoveryMode
from elasticctl.job.records import EventKind
from elasticctl.train import entry as worker_entry
from elasticctl.train.worker import lifecycle
from elasticctl.train import script as worker_env
from elasticctl.train.worker.boundary import Agreed
from elasticctl.train.group import Group
from elasticctl.train.worker.lifecycle import (CancelJoin, Command, Exit, Finish, Form, GiveUpForming, Leave, Raise,
                                        RaisePeerLeaving, SaveBeforeLeave, StartStopTimer, StopForAgent, Train,
                                        WarnNothingTrained, Withdraw, LifecycleState, on_stop_request, transition)
from elasticctl.train.phase import Phase
from elasticctl.train.groups.reconfigure import (GroupStrategy, group_strategy, is_collective_timeout,
                                          torch_can_reconfigure)
from elasticctl.train.watches.replica_check import ReplicasDisagree
from elasticctl.train.sample_ledger import SampleLedger
from elasticctl.train.state import State
from elasticctl.train.state_transfer.transfer import DEFAULT_BUCKET_BYTES, check_bucket_bytes
from elasticctl.train.worker.checkpoint_duty import CheckpointDuty
from elasticctl.train.worker.forming import GenerationForming
from elasticctl.train.worker.inbox import Inbox, InboxEvent, StopRequested
from elasticctl.train.worker.generation_manager import GenerationManager
from elasticctl.train.worker.liveness import LivenessBoard
from elasticctl.train.worker.model_placement import ModelPlacement
from elasticctl.train.worker.place import worker_place
from elasticctl.train.worker.reporter import Reporter
from elasticctl.train.worker.step_boundary import StepBoundary
from elasticctl.train.worker.watchdog import Watchdog, no_step_warning_after
from elasticctl.train.worker.watch_supervisor import Watches

log = logging.getLogger(__name__)


def _no_seam(runtime: Runtime) -> None:
    return None


# A seam for tests: called on the training thread right after a step boundary has read the stop
# flag, so that a test can deliver a stop there (one that boundary did not send), not by timing.
after_stop_flag_read: Callable[[Runtime], None] = _no_seam


class _Boundary(BaseException):
    """Raised out of the script's function at a step boundary every worker agreed on, whose
    transition calls for more than the next step (a BaseException, like KeyboardInterrupt: a
    script's ``except Exception`` must not swallow it). It carries the machine's next state and
    commands: the boundary's event is transitioned once, where it happened."""

    def __init__(self, agreed: Agreed, state: LifecycleState, commands: tuple[Command, ...]) -> None:
        super().__init__(f"{agreed.leaving} of {agreed.world_size} workers leaving" if agreed.leaving
                         else "membership change")
        self.state = state
        self.commands = commands


class Runtime:
    """Drives :func:`elasticctl.train.runtime.run`; see the module docstring."""

    def __init__(self, state: State, *, checkpoint_dir: str | None = None, checkpoint_every: int = 0,
                 backend: str | None = None, wrap: Callable[[torch.nn.Module, Group], torch.nn.Module] | None = None,
                 pg_timeout: float | None = None, keep: int = 3, async_checkpoint: bool = True,
                 on_event: Callable[..., object] | None = None, no_step_warning: float | None = None,
                 transfer_bucket_bytes: int = DEFAULT_BUCKET_BYTES, sharded: bool | str = False) -> None:
        self.state = state
        state.bind(self)
        # Decoded once; everything this worker's runtime starts is handed this object.
        self.environment = environment = WorkerEnvironment.from_env()
        self.place = place = worker_place(environment, backend, pg_timeout)
        bucket_bytes = check_bucket_bytes(transfer_bucket_bytes)
        self.liveness = LivenessBoard()
        self.reporter = Reporter(environment, worker=place.worker, node=place.node, on_event=on_event,
                                 recoveries_in_progress=environment.recovery is not RecoveryMode.HOT)
        self.checkpoints = CheckpointDuty(state, worker_env.checkpoint_dir(checkpoint_dir, environment),
                                          every=checkpoint_every, keep=keep, async_save=async_checkpoint,
                                          sharded=bool(sharded), device=place.device, environment=environment,
                                          worker=place.worker, emit=self.reporter.emit)
        self.model = ModelPlacement(state, place, wrap=wrap, sharded=sharded, bucket_bytes=bucket_bytes,
                                    restore_from_checkpoint=self._restore_from_checkpoint,
                                    emit=self.reporter.emit, bucket_observers=lambda: self.watches.bucket_observers())
        # Whether this worker's generations reconfigure one process group or build one each
        # (train/groups/reconfigure.py); restart mode has one generation per process either way.
        choice = group_strategy(place.backend, torch_can_reconfigure(), sharded=bool(sharded),
                                default_wrap=wrap is None, kept_mesh=self.model.keeps_mesh,
                                forced_rebuild=environment_names.rebuild_groups())
        self.generations = GenerationManager(environment, place, group_choice=choice, keeps_mesh=self.model.keeps_mesh,
                                             sharded=bool(sharded), phase=lambda: self.phase)
        membership = self.generations.membership
        # What other threads and the SIGTERM handler tell the worker (train/worker/inbox.py).
        self.inbox = Inbox(place.worker, self._on_inbox)
        self.boundary = StepBoundary(membership.mode, stop_requested=lambda: self.inbox.stop_requested,
                                     after_stop_flag_read=lambda: after_stop_flag_read(self))
        self.watches = Watches(environment.settings, worker=place.worker, node=place.node, record=self.reporter.record,
                               request_leave=self.reporter.request_leave, roster=self.generations.roster.nodes,
                               control_group=lambda: self.generations.control_group,
                               replica_set=self.model.replica_set, sharded=sharded,
                               non_finite=state.scaler is None)
        self.watchdog = Watchdog(place.worker, self.liveness,
                                 no_step_warning or no_step_warning_after(membership.node_ttl),
                                 step=lambda: self.state.step, warn=self._warn_no_step)
        self.forming = GenerationForming(state, generations=self.generations, model=self.model,
                                         checkpoints=self.checkpoints, boundary=self.boundary, watches=self.watches,
                                         reporter=self.reporter, liveness=self.liveness)
        # ELASTICCTL_SAMPLE_LEDGER: the samples each step trained (State.commit writes), per start
        self.ledger = SampleLedger.from_environment()
        # The machine's state (train/worker/lifecycle.py), replaced whole by each transition.
        self._worker_state = LifecycleState(membership.mode, reconfigures=membership.recovers_in_process
                                         and choice.strategy is GroupStrategy.RECONFIGURE)

    # -- what other threads and the tests read -------------------------------------------------

    @property
    def phase(self) -> Phase:
        """Where the worker is (read by other threads: the state is replaced whole)."""
        return self._worker_state.phase

    @property
    def running_generation(self) -> int | None:
        """The generation of the training group in use (None: none yet)."""
        return self.generations.running_generation

    @property
    def group(self) -> Group | None:
        """The generation in use, as the training function sees it (None: between generations)."""
        return self.generations.group

    @property
    def worker(self) -> str:
        return self.place.worker

    @property
    def membership(self):
        """How this worker's generations come about (restart or hot mode)."""
        return self.generations.membership

    # -- the loop ------------------------------------------------------------------------------

    def run(self, train: Callable[[State, Group], object]) -> None:
        self.inbox.start()
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self.watchdog.start()
        try:
            self._execute(train, lifecycle.Started(
                group_kept=self.model.warm_up(self.generations.group_alone_maker())))
        finally:
            self._set_state(lifecycle.ended(self._worker_state))
            self.watchdog.stop()
            signal.signal(signal.SIGTERM, previous)
            self.inbox.close()
            self._close()

    def _execute(self, train: Callable[[State, Group], object], started: lifecycle.Started) -> None:
        """Carry out the worker's state machine: each command's outcome is an event, whose
        transition gives the next commands, until a command ends the run."""
        commands = self._transition(started)
        while commands:
            following: tuple[Command, ...] = ()
            for command in commands:
                following = self._do(command, train) or following
            commands = following

    def _set_state(self, state: LifecycleState) -> None:
        self._worker_state = state
        self.liveness.phase(state.phase)

    def _transition(self, event: lifecycle.Event) -> tuple[Command, ...]:
        state, commands = transition(self._worker_state, event)
        self._set_state(state)
        return commands

    def _do(self, command: Command, train: Callable[[State, Group], object]) -> tuple[Command, ...] | None:
        """Carry out ``command``; the commands its outcome leads to (None: it has no outcome)."""
        if isinstance(command, Form):
            if command.connect:
                self.generations.membership.connect()
            return self._transition(self.forming.form(command, self._worker_state.form_attempt))
        if isinstance(command, Train):
            return self._train(train)
        if isinstance(command, SaveBeforeLeave):
            saved = self.checkpoints.before_leave(self.boundary.stop_requested)
            return self._transition(lifecycle.SavedBeforeLeave(saved, stop_requested=self.boundary.stop_requested))
        if isinstance(command, StopForAgent):
            self.checkpoints.final_of_stop(self.boundary.stop_requested)
            dist.barrier()
            return self._transition(lifecycle.StoppedForAgent(stop_requested=self.boundary.stop_requested))
        if isinstance(command, Leave):
            self._leave(with_job=command.with_job)
        elif isinstance(command, Exit):
            self.forming.tear_down()
        elif isinstance(command, RaisePeerLeaving):
            raise worker_env.PeerLeaving("A peer is leaving the job; restarting to re-form without it.")
        elif isinstance(command, Finish):
            self._finish()
        elif isinstance(command, WarnNothingTrained):
            self._warn_no_step("its training function returned at step 0: nothing was trained "
                               "(does it call state.commit() after each step?)")
        elif isinstance(command, Withdraw):
            log.warning("[%s] told to stop while it waited for a generation; leaving at step %d",
                        self.worker, self.state.step)
            self.generations.withdraw()
        elif isinstance(command, Raise):
            if command.repeated:
                log.error("[%s] failed %d times at step %d: %s", self.worker, command.repeated, command.step,
                          command.failure)
            raise command.failure
        elif isinstance(command, GiveUpForming):
            raise ElasticctlError(f"The worker '{self.worker}' could not form a generation in "
                                  f"{command.attempts} attempts; its node restarts it.")
        else:
            raise lifecycle.IllegalTransition(f"the training thread does not carry out {command!r}")
        return None

    def _train(self, train: Callable[[State, Group], object]) -> tuple[Command, ...]:
        """The script's function in the generation in use, until it returns, a boundary every
        worker agreed on calls for a change, or a step fails."""
        if self.ledger is not None:
            self.ledger.started(self.state.step, self.state.sampler)
        try:
            train(self.state, self.generations.group)
        except _Boundary as boundary:  # transitioned where it happened (step_done)
            self._set_state(boundary.state)
            return boundary.commands
        except Exception as exc:
            event = step_failure(self.state.step, exc, noticed_at=time.time())
            if event.fatal:
                # Replicas with no majority: every node restarting (or re-forming) would train on
                # from state no one can vouch for, so each node stops with the sentence instead.
                log.error("[%s] %s", self.worker, exc)
                worker_entry.note_unrecoverable(str(exc))
            return self._transition(event)
        return self._transition(lifecycle.TrainReturned(self.state.step))

    # -- generations ---------------------------------------------------------------------------

    def _restore_from_checkpoint(self, **event: Any) -> Any:
        return self.checkpoints.restore(self.generations.membership.recovers_in_process, **event)

    # -- signals and silences ------------------------------------------------------------------

    def _on_sigterm(self, signum, frame) -> None:
        self.inbox.put(StopRequested())  # all a signal handler does: the inbox's thread acts

    def _on_inbox(self, event: InboxEvent) -> None:
        """On the inbox's thread: a stop request is acted on at the next step boundary every worker
        agrees on; what cannot wait for one is done now, as the lifecycle says."""
        if isinstance(event, StopRequested):  # the flag the next boundary reads is set already
            worker_entry.note_stop_request()
            for command in on_stop_request(self.phase):
                if isinstance(command, CancelJoin):
                    self.generations.membership.cancel()  # between generations there is no boundary to wait for
                elif isinstance(command, StartStopTimer):
                    self.watchdog.start_stop_timer()

    def _warn_no_step(self, what: str) -> None:
        log.warning("[%s] %s", self.worker, what)
        self.reporter.record(EventKind.NO_STEP, step=self.state.step, reason=what)

    # -- step boundaries (State.commit) --------------------------------------------------------

    def before_step_applied(self, loss: float | None = None) -> bool:
        """Called by :meth:`State.commit` before the optimizer step; whether to apply it.

        Non-finite gradients are named, and the step skipped with ``--skip-non-finite 1``
        (:mod:`elasticctl.train.watches.non_finite_watch`: the same answer on every worker). Hot mode,
        sharded model: the workers of each shard group agree that all of their gradients arrived
        (:meth:`ModelPlacement.before_step_applied`). Restart mode restores every worker from
        the checkpoint anyway."""
        if self.phase is not Phase.TRAINING:
            return True
        self.model.before_step_applied(hot=self.generations.membership.mode is RecoveryMode.HOT)
        return self.watches.before_step(self.generations.group, self.state.step, loss, self.state.model.parameters(),
                                        sharded=self.model.sharded is not None)

    def step_done(self, samples: int = 0, loss: float | None = None) -> None:
        """Called by :meth:`State.commit` after the step is applied; may raise _Boundary. In this
        order: the step's clocks; the recovery it ends; the flags of the last boundary, agreed
        since; the watches' exchanges (before the checkpoint, so that a diverged replica is named
        before it is saved); the periodic checkpoint and the peer copies; progress; this
        boundary's flags."""
        self.liveness.boundary()
        if self.phase is not Phase.TRAINING:
            return
        group, step = self.generations.group, self.state.step
        self.watches.step_done()
        self.reporter.first_step(group, step)
        self._act_on(self.boundary.in_flight())
        self.watches.at_boundary(group, step, self.state.model)
        self.checkpoints.at_boundary(step)
        self.model.at_boundary(group)
        if self.reporter.publishes_progress(group):
            self.reporter.progress(group, samples, step=step, epoch=int(getattr(self.state.sampler, "epoch", 0)),
                                   loss=loss, last_checkpoint_step=self.checkpoints.last_step,
                                   **self.checkpoints.health())
        membership = self.generations.membership
        self._act_on(self.boundary.send(membership.change_pending(), group.world_size,
                                        self.generations.control_group))
        self.watches.next_step()

    def _act_on(self, agreed: Agreed | None) -> None:
        """Leave the script's function if what the workers agreed on calls for more than the next
        step (the machine's transition, taken here, once)."""
        if agreed is None:
            return
        change = self.generations.membership.describe_change() if agreed.pending else ""
        event = lifecycle.BoundaryAgreed(agreed, me_leaving=self.boundary.leaving_sent, change=change,
                                         noticed_at=time.time())
        state, commands = transition(self._worker_state, event)
        if commands:
            raise _Boundary(agreed, state, commands)

    def checkpoint_now(self) -> None:
        """:meth:`State.checkpoint`: a save at a point every worker reaches (not a boundary)."""
        if self.phase is Phase.TRAINING:
            self.checkpoints.now()

    # -- endings -------------------------------------------------------------------------------

    def _leave(self, with_job: bool) -> None:
        """This worker was told to stop (SIGTERM): a final checkpoint if the whole job stops
        (the state lives on in the others otherwise), then out of the generation."""
        if with_job:
            self.checkpoints.final_of_stop(self.boundary.stop_requested)
        self.generations.membership.leave()
        self.forming.tear_down()
        log.warning("[%s] left at step %d%s", self.worker, self.state.step,
                    " with the whole job (final checkpoint)" if with_job else "")

    def _finish(self) -> None:
        self.checkpoints.final()
        self.boundary.drain()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # every rank done with its collectives before gloo's pairs close
        self.generations.membership.leave()
        self.forming.tear_down()

    def _close(self) -> None:
        if self.ledger is not None:
            self.ledger.close()
        self.checkpoints.close()
        self.reporter.close()
        self.generations.close()


def step_failure(step: int, failure: Exception, noticed_at: float | None) -> lifecycle.StepFailed:
    """The event of a step that raised ``failure``, with the facts the machine decides on: whether
    it is fatal (replicas that disagree with no majority: another generation would train on from
    state no one can vouch for) and whether it is a collective's timeout (a frozen peer, after
    which the group may be kept: train/worker/lifecycle.py)."""
    return lifecycle.StepFailed(step, failure, fatal=isinstance(failure, ReplicasDisagree),
                                timed_out=is_collective_timeout(failure), noticed_at=noticed_at)
