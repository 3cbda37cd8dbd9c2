"""A worker's run as one explicit state machine: a pure transition function, table-tested.

The runtime (:mod:`elasticctl.train.runtime`) is its executor: it feeds :func:`transition` what
happened (an :data:`Event`) and carries out the commands it gets back (:class:`Command`), whose
outcomes are the next events. Every decision about where the worker goes next is made here, from
values alone:

* which generation comes next and how (the first one, after a change agreed at a step boundary,
  after a failed step; a failed formation tried again, up to :data:`FORM_ATTEMPTS`);
* what a step boundary every worker agreed on means (:func:`elasticctl.train.boundary.at_boundary`),
  with the checkpoint taken before some workers leave
  (:func:`elasticctl.train.boundary.checkpoint_before_leave`) and what its outcome changes;
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
from elasticctl.train.boundary import Agreed, BoundaryAction, at_boundary, checkpoint_before_leave
from elasticctl.train.phase import Phase

FORM_ATTEMPTS = 5       # generations in a row that fail while they form
SAME_STEP_FAILURES = 3  # failures at one step, none lost: a bug in the script, not a peer


class Command(enum.Enum):
    """What the executor does next. The outcome of each is the event in parentheses."""

    FORM = "form"                        # the first generation: seal it, its groups, the state in sync (Formed, FormFailed)
    RE_FORM = "re-form"                  # the next one after a change agreed at a boundary: the group may be kept
    RE_FORM_AFTER_FAILURE = "re-form after a failure"  # the next one after a failure: every group rebuilt
    TRAIN = "train"                      # the script's function (TrainReturned, BoundaryAgreed, StepFailed)
    SAVE_BEFORE_LEAVE = "save before a leave"  # every worker's checkpoint before some leave (SavedBeforeLeave)
    LEAVE = "leave"                      # out of the generation; the others keep the state
    LEAVE_WITH_JOB = "leave with the job"  # the final checkpoint, then out: every worker leaves
    STOP_FOR_AGENT = "stop for the agent"  # restart mode: the final checkpoint, then the agent re-forms
    FINISH = "finish"                    # the final checkpoint, every rank done, out of the generations
    WARN_NOTHING_TRAINED = "warn that nothing was trained"
    WITHDRAW = "withdraw"                # out of the generations without a generation to leave
    RAISE = "raise"                      # the failure ends the worker (its node restarts it, or not)
    GIVE_UP_FORMING = "give up forming"  # FORM_ATTEMPTS generations in a row failed to form
    CANCEL_JOIN = "cancel the join"      # end the wait for a generation (SIGTERM while forming)
    START_STOP_TIMER = "start the stop timer"  # a stop must reach a boundary in bounded time


@dataclasses.dataclass(frozen=True)
class WorkerState:
    """Where a worker is: its phase and what the machine remembers across events."""

    mode: RecoveryMode
    phase: Phase = Phase.FORMING
    failures_at: tuple[int, int] = (-1, 0)  # (step, failures at it in a row)
    form_attempt: int = 1                   # the attempt at forming the generation now forming
    boundary: BoundaryAction | None = None  # an agreed boundary waiting for its checkpoint before a leave


# -- events -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Started:
    """The run begins."""


@dataclasses.dataclass(frozen=True)
class Formed:
    """The generation formed: groups up, the state in sync, the model wrapped."""


@dataclasses.dataclass(frozen=True)
class FormFailed:
    """The generation did not form. ``fatal``: another one would fail alike (what a peer sent does
    not fit this worker's state)."""

    fatal: bool = False


@dataclasses.dataclass(frozen=True)
class BoundaryAgreed:
    """A step boundary's flags, agreed by every worker, call for something other than going on.
    ``me_leaving``: this worker's own flag was in ``agreed.leaving``."""

    agreed: Agreed
    me_leaving: bool


@dataclasses.dataclass(frozen=True)
class SavedBeforeLeave:
    """The checkpoint before a leave: written and agreed on every rank (``saved``) or not;
    ``stop_requested``: this worker was told to stop, by now."""

    saved: bool
    stop_requested: bool


@dataclasses.dataclass(frozen=True)
class StepFailed:
    """The script's function raised at ``step`` (a peer lost, or its own failure). ``fatal``: a
    failure another generation would only repeat or spread (replicas that disagree with no
    majority): the run ends at once, in either mode."""

    step: int
    fatal: bool = False


@dataclasses.dataclass(frozen=True)
class JoinCancelled:
    """Told to stop while it waited for a generation."""


@dataclasses.dataclass(frozen=True)
class TrainReturned:
    """The script's function returned, at ``step``."""

    step: int


Event = Started | Formed | FormFailed | BoundaryAgreed | SavedBeforeLeave | StepFailed | JoinCancelled | TrainReturned


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
    StepFailed: (Phase.TRAINING,),
    TrainReturned: (Phase.TRAINING,),
}


def transition(state: WorkerState, event: Event) -> tuple[WorkerState, tuple[Command, ...]]:
    """The worker's next state and what the executor does, for ``event`` in ``state``."""
    allowed = _ARRIVES_IN[type(event)]
    if state.phase not in allowed or (isinstance(event, SavedBeforeLeave)) != (state.boundary is not None):
        raise IllegalTransition(f"{type(event).__name__} in phase {state.phase.value}"
                                f"{' with a boundary pending' if state.boundary else ''}")
    if isinstance(event, Started):
        return state, (Command.FORM,)
    if isinstance(event, Formed):
        return dataclasses.replace(state, phase=Phase.TRAINING, form_attempt=1), (Command.TRAIN,)
    if isinstance(event, FormFailed):
        if event.fatal or state.mode is RecoveryMode.RESTART:
            return dataclasses.replace(state, phase=Phase.FINISHED), (Command.RAISE,)
        if state.form_attempt >= FORM_ATTEMPTS:
            return dataclasses.replace(state, phase=Phase.FINISHED), (Command.GIVE_UP_FORMING,)
        return (dataclasses.replace(state, form_attempt=state.form_attempt + 1),
                (Command.RE_FORM_AFTER_FAILURE,))
    if isinstance(event, JoinCancelled):
        return dataclasses.replace(state, phase=Phase.LEAVING), (Command.WITHDRAW,)
    if isinstance(event, TrainReturned):
        warn = (Command.WARN_NOTHING_TRAINED,) if event.step == 0 else ()
        return dataclasses.replace(state, phase=Phase.FINISHED), (*warn, Command.FINISH)
    if isinstance(event, StepFailed):
        if event.fatal or state.mode is not RecoveryMode.HOT:
            return dataclasses.replace(state, phase=Phase.FINISHED), (Command.RAISE,)
        step, count = state.failures_at
        count = count + 1 if step == event.step else 1
        if count >= SAME_STEP_FAILURES:
            return dataclasses.replace(state, phase=Phase.FINISHED, failures_at=(event.step, count)), (Command.RAISE,)
        return (dataclasses.replace(state, phase=Phase.RE_FORMING, failures_at=(event.step, count)),
                (Command.RE_FORM_AFTER_FAILURE,))
    if isinstance(event, BoundaryAgreed):
        action = at_boundary(state.mode, event.agreed, event.me_leaving)
        if action is BoundaryAction.CONTINUE:
            return state, (Command.TRAIN,)  # nothing to do: the executor does not report these
        if action is BoundaryAction.STOP_FOR_AGENT:
            return dataclasses.replace(state, phase=Phase.LEAVING), (Command.STOP_FOR_AGENT,)
        if checkpoint_before_leave(state.mode, event.agreed):
            return dataclasses.replace(state, boundary=action), (Command.SAVE_BEFORE_LEAVE,)
        return _after_boundary(state, action)
    if isinstance(event, SavedBeforeLeave):
        action, state = state.boundary, dataclasses.replace(state, boundary=None)
        # The state is on disk: a worker told to stop since its flags went out need not re-form
        # (perhaps below MIN, where it would only wait) to hand it over.
        if event.saved and event.stop_requested and action is BoundaryAction.RE_FORM:
            return dataclasses.replace(state, phase=Phase.LEAVING), (Command.LEAVE,)
        return _after_boundary(state, action)
    raise IllegalTransition(f"unknown event {event!r}")


def _after_boundary(state: WorkerState, action: BoundaryAction) -> tuple[WorkerState, tuple[Command, ...]]:
    if action is BoundaryAction.LEAVE:
        return dataclasses.replace(state, phase=Phase.LEAVING), (Command.LEAVE,)
    if action is BoundaryAction.LEAVE_WITH_JOB:
        return dataclasses.replace(state, phase=Phase.LEAVING), (Command.LEAVE_WITH_JOB,)
    return dataclasses.replace(state, phase=Phase.RE_FORMING), (Command.RE_FORM,)


def ended(state: WorkerState) -> WorkerState:
    """The run is over, whatever ended it (a command that ends it, or an exception the executor
    did not expect): the phase every reader sees from now on."""
    return dataclasses.replace(state, phase=Phase.FINISHED, boundary=None)


def on_stop_request(phase: Phase) -> tuple[Command, ...]:
    """What the SIGTERM handler does at once, in ``phase``: the stop is acted on at the next step
    boundary every worker agrees on, within a bound; between generations there is no boundary
    to wait for, so the wait for one ends."""
    if phase in (Phase.FORMING, Phase.RE_FORMING):
        return (Command.CANCEL_JOIN, Command.START_STOP_TIMER)
    return (Command.START_STOP_TIMER,)


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
