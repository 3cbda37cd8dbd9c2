"""When a worker aborts its training group on a lost member (freeze detection, train/groups/lost_member_abort.py):
the decision, table-driven (backend, phase, the loss's generation against the running one)."""

from __future__ import annotations

import pytest

from elasticctl.train.groups.lost_member_abort import LossAction, backend_aborts, loss_action
from elasticctl.train.phase import Phase

ABORT, NO_ABORT, NOTHING = LossAction.ABORT, LossAction.NO_ABORT, LossAction.NOTHING


@pytest.mark.parametrize(("backend", "aborts"), [
    ("nccl", True),
    ("cpu:gloo,cuda:nccl", True),   # the NCCL part of a mixed group has a working abort
    ("gloo", False),                # gloo's abort is a no-op: nothing to gain
    ("cpu:gloo,cuda:gloo", False),
    ("renamed_gloo", True),         # a backend elasticctl does not know: torch's abort, a no-op if it has none
])
def test_which_backends_abort(backend, aborts):
    assert backend_aborts(backend) is aborts


@pytest.mark.parametrize(("backend", "phase", "running", "lost_round", "lost", "aborted", "action"), [
    # a member of the generation it trains in is lost: abort where the backend can
    ("nccl", Phase.TRAINING, 4, 4, ("c.0",), None, ABORT),
    ("gloo", Phase.TRAINING, 4, 4, ("c.0",), None, NO_ABORT),
    # once per generation; the next generation's loss aborts again
    ("nccl", Phase.TRAINING, 4, 4, ("c.0", "d.0"), 4, NOTHING),
    ("nccl", Phase.TRAINING, 5, 5, ("d.0",), 4, ABORT),
    # a loss reported for an earlier generation (the record is older than the group): over
    ("nccl", Phase.TRAINING, 5, 4, ("c.0",), None, NOTHING),
    # nobody lost
    ("nccl", Phase.TRAINING, 4, 4, (), None, NOTHING),
    # not training: the training thread builds or tears down the group itself, or trains no more
    ("nccl", Phase.FORMING, None, 4, ("c.0",), None, NOTHING),
    ("nccl", Phase.RE_FORMING, 4, 4, ("c.0",), None, NOTHING),
    ("nccl", Phase.LEAVING, 4, 4, ("c.0",), None, NOTHING),
    ("nccl", Phase.FINISHED, 4, 4, ("c.0",), None, NOTHING),
    ("gloo", Phase.RE_FORMING, 4, 4, ("c.0",), None, NOTHING),
])
def test_when_a_lost_member_aborts_the_training_group(backend, phase, running, lost_round, lost, aborted, action):
    assert loss_action(backend, phase, running, lost_round, lost, aborted) is action
