"""A worker's run as one explicit state machine: a pure transition function, table-tested.

The runtime (:mod:`elasticctl.train.runtime`) is its executor: it feeds :func:`transition` what
happened (an :data:`Event`) and carries out the commands it gets back (:class:`Command`), whose
outcomes are the next events. Every decision about where the worker goes next is made here, from
values alone:

* which generation comes next and how (the first one, after a change agreed at a step boundary,
  after a failed step; a failed formation tried again, up to :data:`FORM_ATTEMPTS`);
* what a step boundary every worker agreed on means (:func:`elasticctl.train.worker.boundary.at_boundary`),
  with the checkpoint taken before some workers leave
  (:func:`elasticctl.train.worker.boundary.checkpoint_before_leave`) and what its outcome changes;
* when a boundary's flags are agreed: at once, at the next boundary, or alone
  (:func:`when_flags_agreed`);
* which failures a new generation can fix (not the same step failing again and again);
* how the run ends: the training function returned, the worker left or was let go, it was told to
  stop while it waited for a generation, or it gave up.

The executor never assigns a phase itself: the machine's state is replaced whole after each
transition, so the threads that read it (the SIGTERM handler, the no-step watchdog, the loss
watcher) see one consistent value. A stop request (SIGTERM) is not part of the state: the handler
runs between two bytecodes of the training thread, so the executor keeps it in a flag of its own
and hands it in with the events that depend on it; what the handler does at once is
:func:`on_stop_request`'s.
"""

from __future__ import annotations

import dataclasses
import enum

from elasticctl.errors import ElasticctlError
from elasticctl.job.options import RecoveryMode
from elasticctl.train.worker.boundary import Agreed, BoundaryAction, at_boundary, checkpoint_before_leave
from elasticctl.train.phase import Phase

FORM_ATTEMPTS = 5       # generations in a row that fail while they form
SAME_STEP_FAILURES = 3  # failures at one step, none lost: a bug in the script, not a peer
# Seconds to wait before each retry of a final checkpoint that failed: the last chance to keep
# the trained state, so a few tries (space freed by a prune elsewhere, a transient error).
FINAL_CHECKPOINT_RETRY_DELAYS = (1.0, 2.0, 4.0)


@dataclasses.dataclass(frozen=True)
class LifecycleState:
    """Where a worker is: its phase and what the machine remembers across events."""

    mode: RecoveryMode
    phase: Phase = Phase.FORMING
    # This worker's generations reconfigure one process group in place (train/groups/reconfigure.py's
    # group_strategy, fixed for the worker's life); else each builds its own.
    reconfigures: bool = False
    group_kept: bool = False                # it holds a group the next generation can reconfigure
    failures_at: tuple[int, int] = (-1, 0)  # (step, failures at it in a row)
    form_attempt: int = 1                   # the attempt at forming the generation now forming
    boundary: BoundaryAction | None = None  # an agreed boundary waiting for its checkpoint before a leave
    noticed_at: float | None = None         # when the fault or change being recovered from was noticed
    ending: str | None = None               # why the generation in use ends (for its last log line)


# -- commands: what the executor does next; the outcome of each is the event in parentheses -----

@dataclasses.dataclass(frozen=True)
class Form:
    """Into the next generation: the group in use down (or kept), the generation sealed, its groups
    built or reconfigured, the state in sync, the model wrapped (Formed, FormFailed, JoinCancelled).

    ``connect``: the first of the run (this worker's part in the job's generations is made first);
    ``recovering``: the generation ends a recovery, from the fault or change noticed at
    ``noticed_at`` (its timeline is recorded at the first step); ``keep_group``: the process group
    is reconfigured in place, not destroyed and built anew; ``rewrap``: the model is wrapped anew
    on the kept group (a failed step left its modules half-way); ``sever``: the failed
    generation's connections are shut down first, so that peers still waiting on this worker in
    its collectives learn of the failure now (train/groups/connections.py); ``ending``: why the generation
    in use ends."""

    connect: bool = False
    recovering: bool = False
    noticed_at: float | None = None
    keep_group: bool = False
    rewrap: bool = False
    sever: bool = False
    ending: str | None = None


@dataclasses.dataclass(frozen=True)
class Train:
    """The script's function in the generation in use (TrainReturned, BoundaryAgreed, StepFailed)."""


@dataclasses.dataclass(frozen=True)
class SaveBeforeLeave:
    """Every worker's checkpoint before some leave (SavedBeforeLeave)."""


@dataclasses.dataclass(frozen=True)
class Leave:
    """Out of the generation; ``with_job``: every worker leaves, so the final checkpoint first
    (else the others keep the state)."""

    with_job: bool = False


@dataclasses.dataclass(frozen=True)
class StopForAgent:
    """Restart mode: every rank saves the same final checkpoint and waits for the others
    (StoppedForAgent); the agent re-forms without the leavers."""


@dataclasses.dataclass(frozen=True)
class Exit:
    """Out of the run: the groups down, the process ends with status 0 (a worker told to stop)."""


@dataclasses.dataclass(frozen=True)
class RaisePeerLeaving:
    """Out of the run with :class:`elasticctl.train.script.PeerLeaving`: a worker not told to stop
    whose peer leaves; its agent sees a failure and re-forms without the leaver."""


@dataclasses.dataclass(frozen=True)
class Finish:
    """The final checkpoint, every rank done, out of the generations."""


@dataclasses.dataclass(frozen=True)
class WarnNothingTrained:
    """The training function returned at step 0."""


@dataclasses.dataclass(frozen=True)
class Withdraw:
    """Out of the generations without a generation to leave."""


@dataclasses.dataclass(frozen=True)
class Raise:
    """The failure ends the worker (its node restarts it, or not). ``repeated``: the times in a row
    it failed at ``step`` (0: not a repeat; logged when the repeats are what end it)."""

    failure: BaseException
    step: int = -1
    repeated: int = 0


@dataclasses.dataclass(frozen=True)
class GiveUpForming:
    """:data:`FORM_ATTEMPTS` generations in a row failed to form."""

    attempts: int = FORM_ATTEMPTS


@dataclasses.dataclass(frozen=True)
class CancelJoin:
    """End the wait for a generation (a stop request while forming)."""


@dataclasses.dataclass(frozen=True)
class StartStopTimer:
    """A stop must reach a boundary in bounded time."""


Command = (Form | Train | SaveBeforeLeave | Leave | StopForAgent | Exit | RaisePeerLeaving | Finish
           | WarnNothingTrained | Withdraw | Raise | GiveUpForming | CancelJoin | StartStopTimer)
# The commands after which the run is over or on its way out: the phase is LEAVING or FINISHED.
ENDING = (Leave, StopForAgent, Exit, RaisePeerLeaving, Finish, Withdraw, Raise, GiveUpForming)


# -- events -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Started:
    """The run begins. ``group_kept``: a group the first generation can reconfigure was made before
    it (the sharded warm-up's)."""

    group_kept: bool = False


@dataclasses.dataclass(frozen=True)
class Formed:
    """The generation formed: groups up, the state in sync, the model wrapped."""


@dataclasses.dataclass(frozen=True)
class FormFailed:
    """The generation did not form (``failure``). ``fatal``: another one would fail alike (what a
    peer sent does not fit this worker's state)."""

    failure: BaseException | None = None
    fatal: bool = False


@dataclasses.dataclass(frozen=True)
class BoundaryAgreed:
    """A step boundary's flags, agreed by every worker. ``me_leaving``: this worker's own flag was
    in ``agreed.leaving``; ``change``: the membership change pending, in words; ``noticed_at``: when
    this worker read the flags."""

    agreed: Agreed
    me_leaving: bool
    change: str = "a membership change"
    noticed_at: float | None = None


@dataclasses.dataclass(frozen=True)
class SavedBeforeLeave:
    """The checkpoint before a leave: written and agreed on every rank (``saved``) or not;
    ``stop_requested``: this worker was told to stop, by now."""

    saved: bool
    stop_requested: bool


@dataclasses.dataclass(frozen=True)
class StoppedForAgent:
    """Restart mode: the final checkpoint of a stop is saved and every rank reached it;
    ``stop_requested``: this worker was told to stop, by now."""

    stop_requested: bool


@dataclasses.dataclass(frozen=True)
class StepFailed:
    """The script's function raised ``failure`` at ``step`` (a peer lost, or its own failure),
    noticed at ``noticed_at``. ``fatal``: a failure another generation would only repeat or spread
    (replicas that disagree with no majority): the run ends at once, in either mode.
    ``timed_out``: the failure is a collective that waited its whole timeout (a frozen peer)."""

    step: int
    failure: BaseException | None = None
    fatal: bool = False
    timed_out: bool = False
    noticed_at: float | None = None


@dataclasses.dataclass(frozen=True)
class JoinCancelled:
    """Told to stop while it waited for a generation."""


@dataclasses.dataclass(frozen=True)
class TrainReturned:
    """The script's function returned, at ``step``."""

    step: int


Event = (Started | Formed | FormFailed | BoundaryAgreed | SavedBeforeLeave | StoppedForAgent | StepFailed
         | JoinCancelled | TrainReturned)


class IllegalTransition(ElasticctlError):
    """An event the worker's phase cannot have (a bug in the executor, never a user's mistake)."""


# Which phases each event may arrive in.
_ARRIVES_IN: dict[type, tuple[Phase, ...]] = {
    Started: (Phase.FORMING,),
    Formed: (Phase.FORMING, Phase.RE_FORMING),
    FormFailed: (Phase.FORMING, Phase.RE_FORMING),
    JoinCancelled: (Phase.FORMING, Phase.RE_FORMING),
    BoundaryAgreed: (Phase.TRAINING,),
    SavedBeforeLeave: (Phase.TRAINING,),
    StoppedForAgent: (Phase.LEAVING,),
    StepFailed: (Phase.TRAINING,),
    TrainReturned: (Phase.TRAINING,),
}


def transition(state: LifecycleState, event: Event) -> tuple[LifecycleState, tuple[Command, ...]]:
    """The worker's next state and what the executor does, for ``event`` in ``state``."""
    allowed = _ARRIVES_IN[type(event)]
    if state.phase not in allowed or (isinstance(event, SavedBeforeLeave)) != (state.boundary is not None):
        raise IllegalTransition(f"{type(event).__name__} in phase {state.phase.value}"
                                f"{' with a boundary pending' if state.boundary else ''}")
    if isinstance(event, Started):
        state = dataclasses.replace(state, group_kept=event.group_kept and state.reconfigures)
        return state, (Form(connect=True, keep_group=state.group_kept),)
    if isinstance(event, Formed):
        return dataclasses.replace(state, phase=Phase.TRAINING, form_attempt=1, noticed_at=None, ending=None,
                                   group_kept=state.reconfigures), (Train(),)
    if isinstance(event, FormFailed):
        # Whatever the failed formation left of a group is of no further use.
        state = dataclasses.replace(state, group_kept=False, ending=None)
        if event.fatal or state.mode is RecoveryMode.RESTART:
            return dataclasses.replace(state, phase=Phase.FINISHED), (Raise(event.failure),)
        if state.form_attempt >= FORM_ATTEMPTS:
            return dataclasses.replace(state, phase=Phase.FINISHED), (GiveUpForming(FORM_ATTEMPTS),)
        return (dataclasses.replace(state, form_attempt=state.form_attempt + 1),
                (_form_after_failure(state, timed_out=False),))
    if isinstance(event, JoinCancelled):
        return dataclasses.replace(state, phase=Phase.LEAVING), (Withdraw(),)
    if isinstance(event, TrainReturned):
        warn = (WarnNothingTrained(),) if event.step == 0 else ()
        return dataclasses.replace(state, phase=Phase.FINISHED), (*warn, Finish())
    if isinstance(event, StepFailed):
        if event.fatal or state.mode is not RecoveryMode.HOT:
            return dataclasses.replace(state, phase=Phase.FINISHED), (Raise(event.failure, event.step),)
        step, count = state.failures_at
        count = count + 1 if step == event.step else 1
        if count >= SAME_STEP_FAILURES:
            return (dataclasses.replace(state, phase=Phase.FINISHED, failures_at=(event.step, count)),
                    (Raise(event.failure, event.step, repeated=count),))
        state = dataclasses.replace(state, phase=Phase.RE_FORMING, failures_at=(event.step, count),
                                    noticed_at=event.noticed_at, ending=describe_failure(event.failure))
        return state, (_form_after_failure(state, timed_out=event.timed_out),)
    if isinstance(event, BoundaryAgreed):
        action = at_boundary(state.mode, event.agreed, event.me_leaving)
        if action is BoundaryAction.CONTINUE:
            return state, ()  # train on: the script's function goes on with its next step
        if action is BoundaryAction.STOP_FOR_AGENT:
            return dataclasses.replace(state, phase=Phase.LEAVING), (StopForAgent(),)
        state = dataclasses.replace(state, noticed_at=event.noticed_at,
                                    ending=f"{event.agreed.leaving} leaving" if event.agreed.leaving else event.change)
        if checkpoint_before_leave(state.mode, event.agreed):
            return dataclasses.replace(state, boundary=action), (SaveBeforeLeave(),)
        return _after_boundary(state, action)
    if isinstance(event, SavedBeforeLeave):
        action, state = state.boundary, dataclasses.replace(state, boundary=None)
        # The state is on disk: a worker told to stop since its flags went out need not re-form
        # (perhaps below MIN, where it would only wait) to hand it over.
        if event.saved and event.stop_requested and action is BoundaryAction.RE_FORM:
            return dataclasses.replace(state, phase=Phase.LEAVING), (Leave(),)
        return _after_boundary(state, action)
    if isinstance(event, StoppedForAgent):
        # The worker told to stop ends as asked (status 0); the others are restarted by their
        # agents, which re-form without it from the checkpoint every rank just saved.
        return (dataclasses.replace(state, phase=Phase.FINISHED),
                (Exit(),) if event.stop_requested else (RaisePeerLeaving(),))
    raise IllegalTransition(f"unknown event {event!r}")


def _after_boundary(state: LifecycleState, action: BoundaryAction) -> tuple[LifecycleState, tuple[Command, ...]]:
    if action is BoundaryAction.LEAVE:
        return dataclasses.replace(state, phase=Phase.LEAVING), (Leave(),)
    if action is BoundaryAction.LEAVE_WITH_JOB:
        return dataclasses.replace(state, phase=Phase.LEAVING), (Leave(with_job=True),)
    # A change every member agreed on at a step boundary has no collective pending: the group is
    # kept where this worker's generations reconfigure theirs.
    return dataclasses.replace(state, phase=Phase.RE_FORMING), (
        Form(recovering=True, noticed_at=state.noticed_at, keep_group=state.group_kept, ending=state.ending),)


def _form_after_failure(state: LifecycleState, *, timed_out: bool) -> Form:
    """After a failure every group is rebuilt, even where it could be reconfigured: on gloo a peer's
    death reaches only the collectives that wait on it directly, and the survivor that saw it
    passes it on by shutting the failed generation's connections down, which leaves that group of
    no further use (pinned in tests/process/test_torch_reconfigure.py). Unless this worker's own
    collective timed out (a frozen peer): it has waited the whole timeout already, and so has every
    survivor whose collective waited on the frozen peer or on it, which the generation, sealed
    only when they all arrive, waits for anyway. Its group, which recovers from a timed-out
    collective by a reconfigure (pinned there too), is kept; the modules the failed step left
    half-way are not: the model is wrapped anew on it."""
    keep = state.group_kept and timed_out
    return Form(recovering=state.phase is not Phase.FORMING, noticed_at=state.noticed_at, keep_group=keep,
                rewrap=keep, sever=not timed_out, ending=state.ending)


def describe_failure(failure: BaseException | None) -> str:
    """A failure in one line, for the log line of the generation it ends."""
    if failure is None:
        return "a failed step"
    return f"{type(failure).__name__}: {' '.join(str(failure).split())[:300]}"


def final_checkpoint_retry(attempt: int) -> float | None:
    """Seconds to wait before trying the final checkpoint again after ``attempt`` (from 1) failed;
    None: give up, the trained state since the last checkpoint is lost."""
    if 1 <= attempt <= len(FINAL_CHECKPOINT_RETRY_DELAYS):
        return FINAL_CHECKPOINT_RETRY_DELAYS[attempt - 1]
    return None


def ended(state: LifecycleState) -> LifecycleState:
    """The run is over, whatever ended it (a command that ends it, or an exception the executor
    did not expect): the phase every reader sees from now on."""
    return dataclasses.replace(state, phase=Phase.FINISHED, boundary=None)


def on_stop_request(phase: Phase) -> tuple[Command, ...]:
    """What the SIGTERM handler does at once, in ``phase``: the stop is acted on at the next step
    boundary every worker agrees on, within a bound; between generations there is no boundary
    to wait for, so the wait for one ends."""
    if phase in (Phase.FORMING, Phase.RE_FORMING):
        return (CancelJoin(), StartStopTimer())
    return (StartStopTimer(),)


class FlagsAgreed(enum.Enum):
    """When a step boundary's flags (a change pending, workers leaving) are summed and read."""

    ALONE = "alone"                          # a generation of one: its own flags are the sum, no collective
    AT_THIS_BOUNDARY = "at this boundary"    # a blocking all-reduce, read before the next step
    AT_THE_NEXT_BOUNDARY = "at the next boundary"  # an asynchronous one, read one step later


def when_flags_agreed(mode: RecoveryMode, world_size: int) -> FlagsAgreed:
    """Restart mode agrees at once: the agent waits for these workers to stop before its node can
    re-form, so a step more would only delay it. Hot mode lets the all-reduce run behind the next
    step and reads it there: a change costs one step's delay and no step waits for the flags."""
    if world_size == 1:
        return FlagsAgreed.ALONE
    return FlagsAgreed.AT_THIS_BOUNDARY if mode is RecoveryMode.RESTART else FlagsAgreed.AT_THE_NEXT_BOUNDARY
