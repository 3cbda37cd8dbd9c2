"""What a worker does at a step boundary, given what every worker agreed on: a pure decision.

At each boundary (:meth:`elasticctl.train.state.State.commit`) the workers of a generation
sum two flags: a membership change is pending (a member lost or gone on, a newcomer
waiting: hot mode only), and how many workers are leaving (told to stop with SIGTERM).
:func:`at_boundary` turns the sums into what this worker does. When the sums are agreed is
the membership's business (:mod:`elasticctl.train.groups.membership`): restart mode at the same
boundary, hot mode at the next one (the all-reduce runs asynchronously meanwhile), a
generation of one at once. Where they travel (CPU tensors on gloo: the training group, or a
side group beside NCCL) is :func:`elasticctl.train.groups.process_group.control_channel`'s.
"""

from __future__ import annotations

import dataclasses
import enum

# The job's recovery mode, as the flag, the spec and the worker settings carry it: RESTART, one
# generation per process (torchrun's agent re-forms the job); HOT, the workers re-form in process.
from elasticctl.job.options import RecoveryMode


class BoundaryAction(enum.Enum):
    CONTINUE = "continue"                # train on in this generation
    RE_FORM = "re-form"                  # hot: a change, or others leaving: the next generation, in process
    LEAVE = "leave"                      # hot: this worker leaves; the others keep the state
    LEAVE_WITH_JOB = "leave with the job"  # hot: every worker leaves: a final checkpoint first
    STOP_FOR_AGENT = "stop for the agent"  # restart: a worker leaves: every rank saves a final
    #                                      checkpoint, then the process ends and the agent re-forms


@dataclasses.dataclass(frozen=True)
class Agreed:
    """The flags as every worker of the generation summed them."""

    pending: int     # workers that saw a membership change pending
    leaving: int     # workers leaving
    world_size: int


def checkpoint_before_leave(mode: RecoveryMode, agreed: Agreed) -> bool:
    """Whether every worker of the generation saves a checkpoint at this boundary before some of
    them leave (hot mode, some but not all leaving): the same answer on every worker, from the
    agreed flags alone.

    Why: the leavers trust the others to keep the state, and the others may not be able to.
    A ``down`` reaches the workers at different moments: those told before this boundary's
    flags went out leave now, a worker told a moment later stays, and it may be left below
    MIN (or as half of a sharded node) where no generation forms; then it is told to stop too,
    and the steps since the last checkpoint would be lost with it. So a partial leave costs one
    checkpoint, and nothing the job trained is lost whatever follows it. A leave of everyone
    (:attr:`BoundaryAction.LEAVE_WITH_JOB`) and restart mode save a final checkpoint anyway."""
    return mode is RecoveryMode.HOT and 0 < agreed.leaving < agreed.world_size


def at_boundary(mode: RecoveryMode, agreed: Agreed, me_leaving: bool) -> BoundaryAction:
    """``me_leaving``: this worker's own flag was in ``agreed.leaving`` (one told to stop after the
    flags went out re-forms with the others and leaves at the next boundary, so that a worker
    that sees "not everyone leaves" can trust that some worker keeps the state)."""
    if mode is RecoveryMode.RESTART:
        # A pending change does not exist here: the agent sees membership changes and restarts.
        return BoundaryAction.STOP_FOR_AGENT if agreed.leaving else BoundaryAction.CONTINUE
    if not (agreed.pending or agreed.leaving):
        return BoundaryAction.CONTINUE
    if me_leaving:
        return BoundaryAction.LEAVE_WITH_JOB if agreed.leaving >= agreed.world_size else BoundaryAction.LEAVE
    return BoundaryAction.RE_FORM
