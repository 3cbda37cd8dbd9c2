"""The worker's state machine (elasticctl.train.lifecycle), table-tested: every event in every
phase it may arrive in, the commands it gives, and the events it refuses."""

from __future__ import annotations

import dataclasses

import pytest

from elasticctl.job.options import RecoveryMode
from elasticctl.train.boundary import Agreed, BoundaryAction
from elasticctl.train.lifecycle import (
    FlagsAgreed,
    when_flags_agreed,
    FORM_ATTEMPTS,
    SAME_STEP_FAILURES,
    BoundaryAgreed,
    Command,
    Formed,
    FormFailed,
    IllegalTransition,
    JoinCancelled,
    SavedBeforeLeave,
    Started,
    StepFailed,
    TrainReturned,
    WorkerState,
    ended,
    on_stop_request,
    transition,
)
from elasticctl.train.phase import Phase

HOT, RESTART = RecoveryMode.HOT, RecoveryMode.RESTART
C = Command


def state(mode=HOT, phase=Phase.TRAINING, **fields) -> WorkerState:
    return WorkerState(mode, phase, **fields)


def agreed(pending=0, leaving=0, world=3) -> Agreed:
    return Agreed(pending, leaving, world)


@pytest.mark.parametrize("before, event, after, commands", [
    # the first generation, in either mode
    (state(HOT, Phase.FORMING), Started(), state(HOT, Phase.FORMING), (C.FORM,)),
    (state(RESTART, Phase.FORMING), Started(), state(RESTART, Phase.FORMING), (C.FORM,)),
    (state(HOT, Phase.FORMING), Formed(), state(HOT, Phase.TRAINING), (C.TRAIN,)),
    (state(HOT, Phase.RE_FORMING, form_attempt=3), Formed(), state(HOT, Phase.TRAINING), (C.TRAIN,)),
    # a generation that fails to form is formed again, every group anew, up to FORM_ATTEMPTS times
    (state(HOT, Phase.FORMING), FormFailed(), state(HOT, Phase.FORMING, form_attempt=2), (C.RE_FORM_AFTER_FAILURE,)),
    (state(HOT, Phase.RE_FORMING, form_attempt=4), FormFailed(),
     state(HOT, Phase.RE_FORMING, form_attempt=5), (C.RE_FORM_AFTER_FAILURE,)),
    (state(HOT, Phase.RE_FORMING, form_attempt=FORM_ATTEMPTS), FormFailed(),
     state(HOT, Phase.FINISHED, form_attempt=FORM_ATTEMPTS), (C.GIVE_UP_FORMING,)),
    # ... but not when what a peer sent does not fit, nor in restart mode (the agent re-forms)
    (state(HOT, Phase.RE_FORMING), FormFailed(fatal=True), state(HOT, Phase.FINISHED), (C.RAISE,)),
    (state(RESTART, Phase.FORMING), FormFailed(), state(RESTART, Phase.FINISHED), (C.RAISE,)),
    # told to stop while it waited for a generation: out, nothing to hand over
    (state(HOT, Phase.RE_FORMING), JoinCancelled(), state(HOT, Phase.LEAVING), (C.WITHDRAW,)),
    (state(HOT, Phase.FORMING), JoinCancelled(), state(HOT, Phase.LEAVING), (C.WITHDRAW,)),
    # the training function returned: the final checkpoint; at step 0 a warning first
    (state(), TrainReturned(step=40), state(phase=Phase.FINISHED), (C.FINISH,)),
    (state(), TrainReturned(step=0), state(phase=Phase.FINISHED), (C.WARN_NOTHING_TRAINED, C.FINISH)),
    # a failed step: hot mode re-forms, every group anew; the same step failing again and again is a bug
    (state(), StepFailed(step=7), state(phase=Phase.RE_FORMING, failures_at=(7, 1)), (C.RE_FORM_AFTER_FAILURE,)),
    (state(failures_at=(7, 1)), StepFailed(step=7),
     state(phase=Phase.RE_FORMING, failures_at=(7, 2)), (C.RE_FORM_AFTER_FAILURE,)),
    (state(failures_at=(7, SAME_STEP_FAILURES - 1)), StepFailed(step=7),
     state(phase=Phase.FINISHED, failures_at=(7, SAME_STEP_FAILURES)), (C.RAISE,)),
    (state(failures_at=(7, SAME_STEP_FAILURES - 1)), StepFailed(step=8),
     state(phase=Phase.RE_FORMING, failures_at=(8, 1)), (C.RE_FORM_AFTER_FAILURE,)),
    (state(RESTART), StepFailed(step=7), state(RESTART, Phase.FINISHED), (C.RAISE,)),
    # ... but a fatal failure (replicas that disagree with no majority) ends the run at once
    (state(), StepFailed(step=7, fatal=True), state(phase=Phase.FINISHED), (C.RAISE,)),
    (state(RESTART), StepFailed(step=7, fatal=True), state(RESTART, Phase.FINISHED), (C.RAISE,)),
    # a boundary every worker agreed on: a change re-forms (the group may be kept)
    (state(), BoundaryAgreed(agreed(pending=2), me_leaving=False), state(phase=Phase.RE_FORMING), (C.RE_FORM,)),
    # everyone leaves: with the job (the final checkpoint)
    (state(), BoundaryAgreed(agreed(leaving=3), me_leaving=True), state(phase=Phase.LEAVING), (C.LEAVE_WITH_JOB,)),
    # some leave: every worker checkpoints first, then decides on the outcome
    (state(), BoundaryAgreed(agreed(leaving=1), me_leaving=True),
     state(boundary=BoundaryAction.LEAVE), (C.SAVE_BEFORE_LEAVE,)),
    (state(), BoundaryAgreed(agreed(leaving=1), me_leaving=False),
     state(boundary=BoundaryAction.RE_FORM), (C.SAVE_BEFORE_LEAVE,)),
    (state(boundary=BoundaryAction.LEAVE), SavedBeforeLeave(saved=True, stop_requested=True),
     state(phase=Phase.LEAVING), (C.LEAVE,)),
    (state(boundary=BoundaryAction.LEAVE), SavedBeforeLeave(saved=False, stop_requested=True),
     state(phase=Phase.LEAVING), (C.LEAVE,)),
    (state(boundary=BoundaryAction.RE_FORM), SavedBeforeLeave(saved=True, stop_requested=False),
     state(phase=Phase.RE_FORMING), (C.RE_FORM,)),
    # told to stop after its flags went out: the state is on disk, so it leaves rather than re-form
    (state(boundary=BoundaryAction.RE_FORM), SavedBeforeLeave(saved=True, stop_requested=True),
     state(phase=Phase.LEAVING), (C.LEAVE,)),
    # ... but with the checkpoint failed it re-forms, to hand the state over to the others
    (state(boundary=BoundaryAction.RE_FORM), SavedBeforeLeave(saved=False, stop_requested=True),
     state(phase=Phase.RE_FORMING), (C.RE_FORM,)),
    # restart mode: a worker leaving stops every worker for the agent
    (state(RESTART), BoundaryAgreed(agreed(leaving=1), me_leaving=False),
     state(RESTART, Phase.LEAVING), (C.STOP_FOR_AGENT,)),
    # restart mode has no pending change to act on (the agent sees membership changes)
    (state(RESTART), BoundaryAgreed(agreed(pending=1), me_leaving=False), state(RESTART), (C.TRAIN,)),
])
def test_transition(before, event, after, commands):
    assert transition(before, event) == (after, commands)


@pytest.mark.parametrize("before, event", [
    (state(phase=Phase.TRAINING), Started()),
    (state(phase=Phase.TRAINING), Formed()),
    (state(phase=Phase.TRAINING), FormFailed()),
    (state(phase=Phase.TRAINING), JoinCancelled()),
    (state(phase=Phase.RE_FORMING), StepFailed(step=1)),
    (state(phase=Phase.RE_FORMING), TrainReturned(step=1)),
    (state(phase=Phase.FORMING), BoundaryAgreed(agreed(pending=1), me_leaving=False)),
    (state(phase=Phase.LEAVING), Formed()),
    (state(phase=Phase.FINISHED), StepFailed(step=1)),
    # an outcome of the checkpoint before a leave with none asked for, and anything else while one is
    (state(), SavedBeforeLeave(saved=True, stop_requested=False)),
    (state(boundary=BoundaryAction.LEAVE), StepFailed(step=3)),
    (state(boundary=BoundaryAction.LEAVE), TrainReturned(step=3)),
])
def test_an_event_its_phase_cannot_have_is_refused(before, event):
    with pytest.raises(IllegalTransition):
        transition(before, event)


@pytest.mark.parametrize("phase, commands", [
    (Phase.FORMING, (C.CANCEL_JOIN, C.START_STOP_TIMER)),
    (Phase.RE_FORMING, (C.CANCEL_JOIN, C.START_STOP_TIMER)),
    (Phase.TRAINING, (C.START_STOP_TIMER,)),
    (Phase.LEAVING, (C.START_STOP_TIMER,)),
    (Phase.FINISHED, (C.START_STOP_TIMER,)),
])
def test_a_stop_request_ends_a_wait_for_a_generation_and_is_bounded(phase, commands):
    assert on_stop_request(phase) == commands


def test_ended_is_finished_whatever_the_phase():
    for phase in Phase:
        assert ended(state(phase=phase, boundary=BoundaryAction.LEAVE)) == state(phase=Phase.FINISHED)


def test_every_run_ends_in_a_command_that_ends_it_or_a_phase_it_leaves():
    """Walk the machine from its start through every event sequence of up to six events: no state
    is a dead end, and every phase change is one the readers know (FORMING first, FINISHED last)."""
    events = [Formed(), FormFailed(), FormFailed(fatal=True), JoinCancelled(), TrainReturned(step=3),
              StepFailed(step=3), BoundaryAgreed(agreed(pending=1), False), BoundaryAgreed(agreed(leaving=1), True),
              BoundaryAgreed(agreed(leaving=1), False), BoundaryAgreed(agreed(leaving=3), True),
              SavedBeforeLeave(True, True), SavedBeforeLeave(False, False)]
    ending = {C.LEAVE, C.LEAVE_WITH_JOB, C.STOP_FOR_AGENT, C.FINISH, C.WITHDRAW, C.RAISE, C.GIVE_UP_FORMING}
    for mode in RecoveryMode:
        frontier = [transition(WorkerState(mode), Started())[0]]
        for _ in range(6):
            following = []
            for current in frontier:
                moves = []
                for event in events:
                    try:
                        moves.append(transition(current, event))
                    except IllegalTransition:
                        continue
                assert moves, f"{current} accepts no event"
                for after, commands in moves:
                    if ending & set(commands):
                        assert after.phase in (Phase.LEAVING, Phase.FINISHED), (current, after, commands)
                    else:
                        assert after.phase in (Phase.FORMING, Phase.RE_FORMING, Phase.TRAINING), (current, after)
                        following.append(after)
            frontier = list({dataclasses.astuple(s): s for s in following}.values())


@pytest.mark.parametrize(("mode", "world_size", "when"), [
    (RecoveryMode.RESTART, 1, FlagsAgreed.ALONE),
    (RecoveryMode.HOT, 1, FlagsAgreed.ALONE),
    (RecoveryMode.RESTART, 3, FlagsAgreed.AT_THIS_BOUNDARY),   # the agent waits for the workers to stop
    (RecoveryMode.HOT, 3, FlagsAgreed.AT_THE_NEXT_BOUNDARY),   # the all-reduce runs behind the next step
])
def test_when_a_boundary_s_flags_are_agreed(mode, world_size, when):
    assert when_flags_agreed(mode, world_size) is when
