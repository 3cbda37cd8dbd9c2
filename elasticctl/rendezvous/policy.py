"""What a node does when its workers end, before it joins a round, and when asked: pure decisions.

The handler (:mod:`elasticctl.rendezvous.handler`) gathers the facts (the workers' marks,
the budget, the view) and acts; the rules live here, beside :mod:`elasticctl.rendezvous.verdicts`
(whose fault a failure was), so that each can be read and tested as a table:

* :func:`after_workers_ended`: the agent asks for a new round because its workers ended
  (not for a membership change). A group with a finished worker is ended, never trained
  again: complete if every worker that started finished, a stop otherwise. A worker that
  marked its failure unrecoverable stops the node without spending a restart. Otherwise
  the failure is judged (restart mode: from the evidence, charged or free) or charged at
  once (hot mode: the runtime could not recover in process, the node's own failure).
* :func:`repeated_failure`: a script that failed the same way twice in a row before its first
  step stops the node at once, as a worker marked unrecoverable does: a restart would only
  repeat it.
* :func:`charge`: one own failure spent; over ``max_restarts`` the node stops, too many
  within ``quarantine_window`` it sits out a quarantine.
* :func:`before_join`: a stop or a quarantine the budget holds is acted on before the
  node joins again.
* :func:`when_asked_for_waiting`: what ``num_nodes_waiting`` answers from.
* :func:`on_request`: an ``elasticctl leave`` / ``down`` for this node.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping, Set

from elasticctl.job.options import BY_NAME, RecoveryMode
from elasticctl.job.records import MemberState
from elasticctl.job.worker_failure import WorkerFailure
from elasticctl.rendezvous.verdicts import quarantine_due


@dataclasses.dataclass(frozen=True)
class BudgetRules:
    """The node's restart budget as configured (None: no limit, no quarantine)."""

    max_restarts: int | None = None
    quarantine_after: int | None = None
    quarantine_window: float = BY_NAME["quarantine_window"].default


@dataclasses.dataclass(frozen=True)
class Budget:
    """What the node has spent, and what that calls for; immutable: the handler replaces it
    whole under its lock (the agent's thread and the verdict threads both charge)."""

    spent: int = 0
    counted_at: tuple[float, ...] = ()  # when own failures were counted (monotonic), since the last quarantine
    stop_reason: str | None = None      # over budget: the node stops before it joins again
    quarantine: bool = False            # due: the node sits out before it joins again


class NodeAction(enum.Enum):
    JOIN = "join"              # join the next round
    JUDGE = "judge"            # restart mode: record the failure, judge it from the evidence, join at once
    CHARGE = "charge"          # hot mode: the node's own failure, charged now
    END = "end"                # every worker finished (one died afterwards): the job is complete here, exit 0
    STOP = "stop"              # the node stops (exit 1) naming why; the others continue
    QUARANTINE = "quarantine"  # sit out the quarantine, then join


@dataclasses.dataclass(frozen=True)
class NodeDecision:
    action: NodeAction
    message: str = ""           # STOP: the line the user reads
    cause: str | None = None    # STOP: why, in the member record
    failure_event: bool = False  # STOP: the workers' failure is recorded in the history, with ``cause``


def after_workers_ended(node: str, recovery: RecoveryMode, started: Set[str], done: Set[str],
                        unrecoverable: str | None) -> NodeDecision:
    """The workers of this node's round ended on their own; ``started``/``done``: the local
    ranks that marked so, ``unrecoverable``: the reason a worker marked, if one did."""
    if done:
        failed = sorted(set(started) - set(done))
        if not failed:
            return NodeDecision(NodeAction.END)
        cause = (f"local worker(s) {', '.join(failed)} failed after local worker(s) "
                 f"{', '.join(sorted(done))} had finished; the group is not started again")
        return NodeDecision(NodeAction.STOP, f"The node '{node}' stops: {cause}.", cause)
    if unrecoverable is not None:
        return NodeDecision(NodeAction.STOP, f"The node '{node}' stops without restarting its workers: "
                            f"{unrecoverable}", unrecoverable, failure_event=True)
    return NodeDecision(NodeAction.CHARGE if recovery is RecoveryMode.HOT else NodeAction.JUDGE)


def repeated_failure(previous: WorkerFailure | None, current: WorkerFailure | None) -> str | None:
    """Why the node stops at once after its workers' ``current`` failure, the start before having
    ended on ``previous`` (None: that start or this one left no failure record); None keeps the
    usual policy.

    The rule: the same exception type at the same place (file and line of the script's own code),
    neither time after a trained step and neither time possibly its peers' doing. Before its
    first step a script has read only its code, its files and its environment, which a restart
    hands it unchanged: the third start would fail as the first two did. A different failure, or
    one after training began, is judged as any failure is.
    """
    if previous is None or current is None:
        return None
    if not (previous.in_script and current.in_script) or previous.trained or current.trained:
        return None
    if (previous.kind, previous.file, previous.line) != (current.kind, current.file, current.line):
        return None
    return (f"its script failed the same way twice before its first step, {current.kind} at line "
            f"{current.line} of {current.file} ({current.message or 'no message'}), which every restart "
            "would repeat.")


def charge(budget: Budget, rules: BudgetRules, node: str, now: float) -> Budget:
    """``budget`` after one own failure at ``now``: over the limit a stop is due, else maybe a
    quarantine (which starts a new count)."""
    spent, counted_at = budget.spent + 1, (*budget.counted_at, now)
    if rules.max_restarts is not None and spent > rules.max_restarts:
        return dataclasses.replace(budget, spent=spent, counted_at=counted_at, stop_reason=(
            f"The node '{node}' stops: its workers failed {spent} times, more than the "
            f"{rules.max_restarts} restarts allowed; the other nodes continue."))
    if rules.quarantine_after is not None and quarantine_due(counted_at, now, rules.quarantine_window,
                                                             rules.quarantine_after):
        return dataclasses.replace(budget, spent=spent, counted_at=(), quarantine=True)
    return dataclasses.replace(budget, spent=spent, counted_at=counted_at)


def before_join(budget: Budget) -> tuple[NodeDecision, Budget]:
    """Stop, sit out, or join; and the budget with a quarantine taken (it is sat out once)."""
    taken = dataclasses.replace(budget, quarantine=False)
    if budget.stop_reason:
        return NodeDecision(NodeAction.STOP, budget.stop_reason), taken
    if budget.quarantine:
        return NodeDecision(NodeAction.QUARANTINE), taken
    return NodeDecision(NodeAction.JOIN), taken


class Waiting(enum.Enum):
    """What ``num_nodes_waiting`` answers from."""

    NONE = "none"                # 0: no round yet, left, a finished group, or hot mode (the workers re-form)
    OWN_VERDICT = "own verdict"  # 1: the budget calls for a stop or a quarantine; restart the agent for it
    MEMBERSHIP = "membership"    # the watched view: members lost or gone on, newcomers


def when_asked_for_waiting(in_round: bool, left: bool, worker_finished: bool, budget: Budget,
                           recovery: RecoveryMode, worker_gave_up: bool = False) -> Waiting:
    """``worker_gave_up``: a worker of this round marked itself unrecoverable (a restart would fail
    the same way): it is about to exit, and its node stops on that verdict. A peer lost at the same
    moment (a full shared disk ends every node's workers together) must not restart the workers
    first: the node would wait for a new round instead of stopping."""
    if not in_round or left or worker_finished or worker_gave_up:
        return Waiting.NONE  # a finished worker: the group is ending, a restart would train again
    if budget.stop_reason or budget.quarantine:
        return Waiting.OWN_VERDICT
    if recovery is RecoveryMode.HOT:
        return Waiting.NONE
    return Waiting.MEMBERSHIP


def kill_for_lost(lost: Iterable[str], states: Mapping[str, str]) -> bool:
    """Whether this node's workers are killed at once for members gone from its round: yes
    unless every one left gracefully (its workers then wait in a collective on a dead peer)."""
    return any(states.get(node) != MemberState.LEFT for node in lost)


class RequestAction(enum.Enum):
    IGNORE = "ignore"                   # none for this node, or it has left already
    LEAVE = "leave"                     # leave the round; the others continue
    LEAVE_AND_CLOSE = "leave and close"  # ``down``: close the job, then leave


def on_request(request: str | None, left: bool) -> RequestAction:
    if request is None or left:
        return RequestAction.IGNORE
    return RequestAction.LEAVE_AND_CLOSE if request == "down" else RequestAction.LEAVE
