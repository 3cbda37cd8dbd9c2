"""What a worker does at a step boundary, given what every worker agreed on: a table."""

from __future__ import annotations

import pytest

from elasticctl.job.options import RecoveryMode
from elasticctl.train.worker.boundary import Agreed, BoundaryAction, at_boundary, checkpoint_before_leave

A = BoundaryAction


@pytest.mark.parametrize(("mode", "agreed", "me_leaving", "action"), [
    # nothing agreed: train on
    (RecoveryMode.HOT, Agreed(0, 0, 4), False, A.CONTINUE),
    (RecoveryMode.RESTART, Agreed(0, 0, 4), False, A.CONTINUE),
    # hot: a change pending anywhere re-forms everyone
    (RecoveryMode.HOT, Agreed(1, 0, 4), False, A.RE_FORM),
    (RecoveryMode.HOT, Agreed(4, 0, 4), False, A.RE_FORM),
    # hot: others leave, this one stays: re-form without them
    (RecoveryMode.HOT, Agreed(0, 1, 4), False, A.RE_FORM),
    # hot: this one leaves, the others keep the state
    (RecoveryMode.HOT, Agreed(0, 1, 4), True, A.LEAVE),
    (RecoveryMode.HOT, Agreed(1, 3, 4), True, A.LEAVE),
    # hot: everyone leaves: with the whole job (a final checkpoint)
    (RecoveryMode.HOT, Agreed(0, 4, 4), True, A.LEAVE_WITH_JOB),
    (RecoveryMode.HOT, Agreed(0, 1, 1), True, A.LEAVE_WITH_JOB),   # a generation of one
    (RecoveryMode.HOT, Agreed(1, 0, 1), False, A.RE_FORM),         # alone, a newcomer waiting
    # hot: told to stop after the flags went out: not in the count, re-forms and leaves at the next
    (RecoveryMode.HOT, Agreed(0, 3, 4), False, A.RE_FORM),
    # restart: any worker leaving stops every rank for the agent; changes are the agent's business
    (RecoveryMode.RESTART, Agreed(0, 1, 4), True, A.STOP_FOR_AGENT),
    (RecoveryMode.RESTART, Agreed(0, 1, 4), False, A.STOP_FOR_AGENT),
    (RecoveryMode.RESTART, Agreed(0, 4, 4), True, A.STOP_FOR_AGENT),
    (RecoveryMode.RESTART, Agreed(1, 0, 4), False, A.CONTINUE),
])
def test_at_boundary(mode, agreed, me_leaving, action):
    assert at_boundary(mode, agreed, me_leaving) is action


@pytest.mark.parametrize(("mode", "agreed", "saves"), [
    # hot, some but not all leaving: everyone saves first (the stayers may not be able to go on)
    (RecoveryMode.HOT, Agreed(pending=0, leaving=2, world_size=3), True),
    (RecoveryMode.HOT, Agreed(pending=1, leaving=1, world_size=4), True),
    # nobody leaving, or everyone (the whole job saves its final checkpoint anyway)
    (RecoveryMode.HOT, Agreed(pending=1, leaving=0, world_size=3), False),
    (RecoveryMode.HOT, Agreed(pending=0, leaving=3, world_size=3), False),
    # restart mode: every rank saves when anyone stops for the agent
    (RecoveryMode.RESTART, Agreed(pending=0, leaving=1, world_size=3), False),
])
def test_checkpoint_before_a_partial_leave(mode, agreed, saves):
    assert checkpoint_before_leave(mode, agreed) is saves
