"""The worker's state machine (elasticctl.train.worker.lifecycle), table-tested: every event in every
phase it may arrive in, the commands it gives, and the events it refuses."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from elasticctl.job.options import RecoveryMode
from elasticctl.train.worker.boundary import Agreed, BoundaryAction
from elasticctl.train.worker.lifecycle import (
    FINAL_CHECKPOINT_RETRY_DELAYS,
    FORM_ATTEMPTS,
    SAME_STEP_FAILURES,
    BoundaryAgreed,
    CancelJoin,
    Exit,
    FlagsAgreed,
    Finish,
    Form,
    Formed,
    FormFailed,
    GiveUpForming,
    IllegalTransition,
    JoinCancelled,
    Leave,
    Raise,
    RaisePeerLeaving,
    SaveBeforeLeave,
    SavedBeforeLeave,
    Started,
    StartStopTimer,
    StepFailed,
    StopForAgent,
    StoppedForAgent,
    Train,
    TrainReturned,
    WarnNothingTrained,
    Withdraw,
    LifecycleState,
    describe_failure,
    ended,
    final_checkpoint_retry,
    on_stop_request,
    transition,
    when_flags_agreed,
)
from elasticctl.train.phase import Phase

HOT, RESTART = RecoveryMode.HOT, RecoveryMode.RESTART
LOST = ConnectionError("Connection closed by peer")           # a peer lost: the step's collective raised
FROZE = RuntimeError("Timed out waiting 4000ms for recv operation to complete")  # a frozen peer
T = 100.0  # when the fault or change was noticed
LOST_WHY = describe_failure(LOST)


def state(mode=HOT, phase=Phase.TRAINING, **fields) -> LifecycleState:
    return LifecycleState(mode, phase, **fields)


def kept(**fields) -> LifecycleState:
    """A hot worker whose generations reconfigure one group, which it holds now."""
    return state(reconfigures=True, group_kept=True, **fields)


def agreed(pending=0, leaving=0, world=3) -> Agreed:
    return Agreed(pending, leaving, world)


def re_form(**fields) -> Form:
    return Form(recovering=True, **fields)


@pytest.mark.parametrize("before, event, after, commands", [
    # the first generation, in either mode: this worker's part in the job's generations first
    (state(HOT, Phase.FORMING), Started(), state(HOT, Phase.FORMING), (Form(connect=True),)),
    (state(RESTART, Phase.FORMING), Started(), state(RESTART, Phase.FORMING), (Form(connect=True),)),
    # ... keeping the group a sharded warm-up made, where the worker's generations reconfigure one
    (state(HOT, Phase.FORMING, reconfigures=True), Started(group_kept=True),
     state(HOT, Phase.FORMING, reconfigures=True, group_kept=True), (Form(connect=True, keep_group=True),)),
    (state(HOT, Phase.FORMING), Started(group_kept=True), state(HOT, Phase.FORMING), (Form(connect=True),)),
    # formed: training; a worker that reconfigures holds its group from now on
    (state(HOT, Phase.FORMING), Formed(), state(HOT, Phase.TRAINING), (Train(),)),
    (state(HOT, Phase.FORMING, reconfigures=True), Formed(), kept(), (Train(),)),
    (state(HOT, Phase.RE_FORMING, form_attempt=3, noticed_at=T, ending="x"), Formed(), state(HOT, Phase.TRAINING),
     (Train(),)),
    # a generation that fails to form is formed again, every group anew, up to FORM_ATTEMPTS times
    (state(HOT, Phase.FORMING), FormFailed(LOST), state(HOT, Phase.FORMING, form_attempt=2), (Form(sever=True),)),
    (state(HOT, Phase.RE_FORMING, form_attempt=4, noticed_at=T), FormFailed(LOST),
     state(HOT, Phase.RE_FORMING, form_attempt=5, noticed_at=T), (re_form(noticed_at=T, sever=True),)),
    (state(HOT, Phase.RE_FORMING, reconfigures=True, group_kept=True, noticed_at=T), FormFailed(LOST),
     state(HOT, Phase.RE_FORMING, reconfigures=True, form_attempt=2, noticed_at=T),
     (re_form(noticed_at=T, sever=True),)),
    (state(HOT, Phase.RE_FORMING, form_attempt=FORM_ATTEMPTS), FormFailed(LOST),
     state(HOT, Phase.FINISHED, form_attempt=FORM_ATTEMPTS), (GiveUpForming(FORM_ATTEMPTS),)),
    # ... but not when what a peer sent does not fit, nor in restart mode (the agent re-forms)
    (state(HOT, Phase.RE_FORMING), FormFailed(LOST, fatal=True), state(HOT, Phase.FINISHED), (Raise(LOST),)),
    (state(RESTART, Phase.FORMING), FormFailed(LOST), state(RESTART, Phase.FINISHED), (Raise(LOST),)),
    # told to stop while it waited for a generation: out, nothing to hand over
    (state(HOT, Phase.RE_FORMING), JoinCancelled(), state(HOT, Phase.LEAVING), (Withdraw(),)),
    (state(HOT, Phase.FORMING), JoinCancelled(), state(HOT, Phase.LEAVING), (Withdraw(),)),
    # the training function returned: the final checkpoint; at step 0 a warning first
    (state(), TrainReturned(step=40), state(phase=Phase.FINISHED), (Finish(),)),
    (state(), TrainReturned(step=0), state(phase=Phase.FINISHED), (WarnNothingTrained(), Finish())),
    # a failed step: hot mode re-forms, every group anew, the failed generation's connections
    # severed; the same step failing again and again is a bug
    (state(), StepFailed(7, LOST, noticed_at=T),
     state(phase=Phase.RE_FORMING, failures_at=(7, 1), noticed_at=T, ending=LOST_WHY),
     (re_form(noticed_at=T, sever=True, ending=LOST_WHY),)),
    (state(failures_at=(7, 1)), StepFailed(7, LOST, noticed_at=T),
     state(phase=Phase.RE_FORMING, failures_at=(7, 2), noticed_at=T, ending=LOST_WHY),
     (re_form(noticed_at=T, sever=True, ending=LOST_WHY),)),
    (state(failures_at=(7, SAME_STEP_FAILURES - 1)), StepFailed(7, LOST),
     state(phase=Phase.FINISHED, failures_at=(7, SAME_STEP_FAILURES)), (Raise(LOST, 7, repeated=SAME_STEP_FAILURES),)),
    (state(failures_at=(7, SAME_STEP_FAILURES - 1)), StepFailed(8, LOST, noticed_at=T),
     state(phase=Phase.RE_FORMING, failures_at=(8, 1), noticed_at=T, ending=LOST_WHY),
     (re_form(noticed_at=T, sever=True, ending=LOST_WHY),)),
    (state(RESTART), StepFailed(7, LOST), state(RESTART, Phase.FINISHED), (Raise(LOST, 7),)),
    # the group-keep rule: a lost peer destroys even a group that could be reconfigured, so that every
    # survivor's collective raises; after this worker's own collective timed out (a frozen peer)
    # nothing is pending, so the group is kept and the model wrapped anew on it
    (kept(), StepFailed(7, LOST, noticed_at=T),
     kept(phase=Phase.RE_FORMING, failures_at=(7, 1), noticed_at=T, ending=LOST_WHY),
     (re_form(noticed_at=T, sever=True, ending=LOST_WHY),)),
    (kept(), StepFailed(7, FROZE, timed_out=True, noticed_at=T),
     kept(phase=Phase.RE_FORMING, failures_at=(7, 1), noticed_at=T, ending=describe_failure(FROZE)),
     (re_form(noticed_at=T, keep_group=True, rewrap=True, ending=describe_failure(FROZE)),)),
    # ... which only a worker holding a reconfigurable group can
    (state(), StepFailed(7, FROZE, timed_out=True, noticed_at=T),
     state(phase=Phase.RE_FORMING, failures_at=(7, 1), noticed_at=T, ending=describe_failure(FROZE)),
     (re_form(noticed_at=T, ending=describe_failure(FROZE)),)),
    (state(reconfigures=True), StepFailed(7, FROZE, timed_out=True, noticed_at=T),
     state(phase=Phase.RE_FORMING, reconfigures=True, failures_at=(7, 1), noticed_at=T,
           ending=describe_failure(FROZE)),
     (re_form(noticed_at=T, ending=describe_failure(FROZE)),)),
    # the fatal rule: a fatal failure (replicas that disagree with no majority) ends the run at once
    (state(), StepFailed(7, LOST, fatal=True), state(phase=Phase.FINISHED), (Raise(LOST, 7),)),
    (kept(), StepFailed(7, FROZE, fatal=True, timed_out=True), kept(phase=Phase.FINISHED), (Raise(FROZE, 7),)),
    (state(RESTART), StepFailed(7, LOST, fatal=True), state(RESTART, Phase.FINISHED), (Raise(LOST, 7),)),
    # a boundary every worker agreed on: nothing to act on, the next step
    (state(), BoundaryAgreed(agreed(), me_leaving=False), state(), ()),
    # a change re-forms: a group that can be reconfigured is kept, and the model with it
    (state(), BoundaryAgreed(agreed(pending=2), me_leaving=False, change="n4 joining", noticed_at=T),
     state(phase=Phase.RE_FORMING, noticed_at=T, ending="n4 joining"), (re_form(noticed_at=T, ending="n4 joining"),)),
    (kept(), BoundaryAgreed(agreed(pending=2), me_leaving=False, change="n4 joining", noticed_at=T),
     kept(phase=Phase.RE_FORMING, noticed_at=T, ending="n4 joining"),
     (re_form(noticed_at=T, keep_group=True, ending="n4 joining"),)),
    # everyone leaves: with the job (the final checkpoint)
    (state(), BoundaryAgreed(agreed(leaving=3), me_leaving=True, noticed_at=T),
     state(phase=Phase.LEAVING, noticed_at=T, ending="3 leaving"), (Leave(with_job=True),)),
    # some leave: every worker checkpoints first, then decides on the outcome
    (state(), BoundaryAgreed(agreed(leaving=1), me_leaving=True, noticed_at=T),
     state(boundary=BoundaryAction.LEAVE, noticed_at=T, ending="1 leaving"), (SaveBeforeLeave(),)),
    (state(), BoundaryAgreed(agreed(leaving=1), me_leaving=False, noticed_at=T),
     state(boundary=BoundaryAction.RE_FORM, noticed_at=T, ending="1 leaving"), (SaveBeforeLeave(),)),
    (state(boundary=BoundaryAction.LEAVE), SavedBeforeLeave(saved=True, stop_requested=True),
     state(phase=Phase.LEAVING), (Leave(),)),
    (state(boundary=BoundaryAction.LEAVE), SavedBeforeLeave(saved=False, stop_requested=True),
     state(phase=Phase.LEAVING), (Leave(),)),
    (state(boundary=BoundaryAction.RE_FORM, noticed_at=T, ending="1 leaving"),
     SavedBeforeLeave(saved=True, stop_requested=False),
     state(phase=Phase.RE_FORMING, noticed_at=T, ending="1 leaving"), (re_form(noticed_at=T, ending="1 leaving"),)),
    (kept(boundary=BoundaryAction.RE_FORM, noticed_at=T, ending="1 leaving"),
     SavedBeforeLeave(saved=True, stop_requested=False),
     kept(phase=Phase.RE_FORMING, noticed_at=T, ending="1 leaving"),
     (re_form(noticed_at=T, keep_group=True, ending="1 leaving"),)),
    # told to stop after its flags went out: the state is on disk, so it leaves rather than re-form
    (state(boundary=BoundaryAction.RE_FORM), SavedBeforeLeave(saved=True, stop_requested=True),
     state(phase=Phase.LEAVING), (Leave(),)),
    # ... but with the checkpoint failed it re-forms, to hand the state over to the others
    (state(boundary=BoundaryAction.RE_FORM, noticed_at=T), SavedBeforeLeave(saved=False, stop_requested=True),
     state(phase=Phase.RE_FORMING, noticed_at=T), (re_form(noticed_at=T),)),
    # restart mode: a worker leaving stops every worker for the agent
    (state(RESTART), BoundaryAgreed(agreed(leaving=1), me_leaving=False),
     state(RESTART, Phase.LEAVING), (StopForAgent(),)),
    # the exit-code rule: the worker told to stop exits 0; the others raise PeerLeaving, so that
    # their agents re-form without the leaver
    (state(RESTART, Phase.LEAVING), StoppedForAgent(stop_requested=True), state(RESTART, Phase.FINISHED), (Exit(),)),
    (state(RESTART, Phase.LEAVING), StoppedForAgent(stop_requested=False), state(RESTART, Phase.FINISHED),
     (RaisePeerLeaving(),)),
    # restart mode has no pending change to act on (the agent sees membership changes)
    (state(RESTART), BoundaryAgreed(agreed(pending=1), me_leaving=False), state(RESTART), ()),
])
def test_transition(before, event, after, commands):
    assert transition(before, event) == (after, commands)


@pytest.mark.parametrize("before, event", [
    (state(phase=Phase.TRAINING), Started()),
    (state(phase=Phase.TRAINING), Formed()),
    (state(phase=Phase.TRAINING), FormFailed(LOST)),
    (state(phase=Phase.TRAINING), JoinCancelled()),
    (state(phase=Phase.RE_FORMING), StepFailed(step=1)),
    (state(phase=Phase.TRAINING), StoppedForAgent(stop_requested=True)),
    (state(RESTART, Phase.FINISHED), StoppedForAgent(stop_requested=False)),
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
    (Phase.FORMING, (CancelJoin(), StartStopTimer())),
    (Phase.RE_FORMING, (CancelJoin(), StartStopTimer())),
    (Phase.TRAINING, (StartStopTimer(),)),
    (Phase.LEAVING, (StartStopTimer(),)),
    (Phase.FINISHED, (StartStopTimer(),)),
])
def test_a_stop_request_ends_a_wait_for_a_generation_and_is_bounded(phase, commands):
    assert on_stop_request(phase) == commands


def test_ended_is_finished_whatever_the_phase():
    for phase in Phase:
        assert ended(state(phase=phase, boundary=BoundaryAction.LEAVE)) == state(phase=Phase.FINISHED)


@pytest.mark.parametrize(("attempt", "delay"), [
    (1, FINAL_CHECKPOINT_RETRY_DELAYS[0]),
    (2, FINAL_CHECKPOINT_RETRY_DELAYS[1]),
    (len(FINAL_CHECKPOINT_RETRY_DELAYS), FINAL_CHECKPOINT_RETRY_DELAYS[-1]),
    (len(FINAL_CHECKPOINT_RETRY_DELAYS) + 1, None),  # the last attempt failed: give up, saying why
    (0, None),
])
def test_the_final_checkpoint_is_retried_a_few_times_then_given_up(attempt, delay):
    assert final_checkpoint_retry(attempt) == delay


def test_a_failure_is_described_in_one_bounded_line():
    assert describe_failure(RuntimeError("a\n  b")) == "RuntimeError: a b"
    assert len(describe_failure(RuntimeError("x" * 1000))) == len("RuntimeError: ") + 300
    assert describe_failure(None) == "a failed step"


def test_every_run_ends_in_a_command_that_ends_it_or_a_phase_it_leaves():
    """Walk the machine from its start through every event sequence of up to six events: no state
    is a dead end, and every phase change is one the readers know (FORMING first, FINISHED last)."""
    events = [Formed(), FormFailed(LOST), FormFailed(LOST, fatal=True), JoinCancelled(), TrainReturned(step=3),
              StepFailed(3, LOST), StepFailed(3, FROZE, timed_out=True), BoundaryAgreed(agreed(pending=1), False),
              BoundaryAgreed(agreed(leaving=1), True), BoundaryAgreed(agreed(leaving=1), False),
              BoundaryAgreed(agreed(leaving=3), True), SavedBeforeLeave(True, True), SavedBeforeLeave(False, False),
              StoppedForAgent(True), StoppedForAgent(False)]
    ending = (Leave, StopForAgent, Exit, RaisePeerLeaving, Finish, Withdraw, Raise, GiveUpForming)
    for mode, reconfigures in itertools.product(RecoveryMode, (False, True)):
        frontier = [transition(LifecycleState(mode, reconfigures=reconfigures), Started(group_kept=True))[0]]
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
                    # a group is kept only by a worker whose generations reconfigure one
                    assert after.reconfigures or not after.group_kept, (current, after)
                    assert all(after.group_kept or not (isinstance(c, Form) and c.keep_group) for c in commands)
                    if any(isinstance(command, ending) for command in commands):
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
