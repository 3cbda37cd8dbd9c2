"""What a node does when its workers end, before it joins, and when asked: table-driven, no etcd."""

from __future__ import annotations

import pytest

from elasticctl.job.options import RecoveryMode
from elasticctl.job.worker_failure import WorkerFailure
from elasticctl.rendezvous.policy import (
    Budget,
    BudgetRules,
    NodeAction,
    RequestAction,
    Waiting,
    after_workers_ended,
    before_join,
    charge,
    kill_for_lost,
    on_request,
    repeated_failure,
    when_asked_for_waiting,
)

E = frozenset()
HOT, RESTART = RecoveryMode.HOT, RecoveryMode.RESTART


@pytest.mark.parametrize(("mode", "started", "done", "unrecoverable", "action", "message"), [
    # failed, nothing marked: restart mode judges from the evidence, hot mode charges at once
    (RESTART, {"0", "1"}, E, None, NodeAction.JUDGE, ""),
    (HOT, {"0", "1"}, E, None, NodeAction.CHARGE, ""),
    (RESTART, E, E, None, NodeAction.JUDGE, ""),  # died before the entry marked anything
    # every worker that started finished, one died at interpreter exit: the job is complete
    (RESTART, {"0", "1"}, {"0", "1"}, None, NodeAction.END, ""),
    (HOT, {"0"}, {"0"}, None, NodeAction.END, ""),
    # one failed after another finished: never trained again, the node stops
    (RESTART, {"0", "1"}, {"0"}, None, NodeAction.STOP,
     "The node 'a' stops: local worker(s) 1 failed after local worker(s) 0 had finished; "
     "the group is not started again."),
    # ... a finish wins over an unrecoverable mark (the job is complete)
    (RESTART, {"0"}, {"0"}, "disk full", NodeAction.END, ""),
    # a worker said a restart would fail the same way: stop, spending nothing
    (RESTART, {"0"}, E, "disk full", NodeAction.STOP, "The node 'a' stops without restarting its workers: disk full"),
    (HOT, {"0"}, E, "disk full", NodeAction.STOP, "The node 'a' stops without restarting its workers: disk full"),
])
def test_after_workers_ended(mode, started, done, unrecoverable, action, message):
    decision = after_workers_ended("a", mode, started, done, unrecoverable)
    assert decision.action is action
    assert decision.message == message
    if unrecoverable and action is NodeAction.STOP:
        assert (decision.cause, decision.failure_event) == (unrecoverable, True)


RULES = BudgetRules(max_restarts=2, quarantine_after=2, quarantine_window=600.0)


@pytest.mark.parametrize(("rules", "budget", "now", "expected"), [
    # within budget, the first in the window
    (RULES, Budget(), 10.0, Budget(spent=1, counted_at=(10.0,))),
    # the second within the window: quarantine due, a new count starts
    (RULES, Budget(spent=1, counted_at=(10.0,)), 20.0, Budget(spent=2, quarantine=True)),
    # ... not when the first fell out of the window
    (RULES, Budget(spent=1, counted_at=(10.0,)), 700.0, Budget(spent=2, counted_at=(10.0, 700.0))),
    # over the budget: a stop, whatever the quarantine says
    (RULES, Budget(spent=2), 30.0, Budget(spent=3, counted_at=(30.0,), stop_reason=(
        "The node 'a' stops: its workers failed 3 times, more than the 2 restarts allowed; "
        "the other nodes continue."))),
    (BudgetRules(max_restarts=0), Budget(), 1.0, Budget(spent=1, counted_at=(1.0,), stop_reason=(
        "The node 'a' stops: its workers failed 1 times, more than the 0 restarts allowed; "
        "the other nodes continue."))),
    # no limit, no quarantine: only counted
    (BudgetRules(), Budget(spent=41), 1.0, Budget(spent=42, counted_at=(1.0,))),
])
def test_charge(rules, budget, now, expected):
    assert charge(budget, rules, "a", now) == expected


@pytest.mark.parametrize(("budget", "action", "after"), [
    (Budget(spent=1), NodeAction.JOIN, Budget(spent=1)),
    (Budget(spent=2, quarantine=True), NodeAction.QUARANTINE, Budget(spent=2)),  # sat out once
    (Budget(spent=3, stop_reason="over"), NodeAction.STOP, Budget(spent=3, stop_reason="over")),
    (Budget(spent=3, stop_reason="over", quarantine=True), NodeAction.STOP, Budget(spent=3, stop_reason="over")),
])
def test_before_join(budget, action, after):
    decision, taken = before_join(budget)
    assert decision.action is action
    assert taken == after
    if action is NodeAction.STOP:
        assert decision.message == "over" and decision.cause is None


def test_a_node_failing_on_its_own_walks_through_quarantine_to_its_stop():
    """The rules composed as the handler runs them: charge, then decide before joining."""
    rules, budget, seen = BudgetRules(max_restarts=2, quarantine_after=2, quarantine_window=600.0), Budget(), []
    for now in (10.0, 20.0, 30.0):
        budget = charge(budget, rules, "a", now)
        decision, budget = before_join(budget)
        seen.append(decision.action)
    assert seen == [NodeAction.JOIN, NodeAction.QUARANTINE, NodeAction.STOP]
    assert budget.spent == 3


@pytest.mark.parametrize(("in_round", "left", "finished", "budget", "mode", "waiting"), [
    (False, False, False, Budget(), RESTART, Waiting.NONE),     # no round yet
    (True, True, False, Budget(), RESTART, Waiting.NONE),       # left: nothing to restart
    (True, False, True, Budget(stop_reason="x"), RESTART, Waiting.NONE),  # a finished worker: the group ends
    (True, False, False, Budget(stop_reason="x"), RESTART, Waiting.OWN_VERDICT),
    (True, False, False, Budget(quarantine=True), HOT, Waiting.OWN_VERDICT),
    (True, False, False, Budget(), HOT, Waiting.NONE),       # hot: the workers re-form by themselves
    (True, False, False, Budget(spent=5), RESTART, Waiting.MEMBERSHIP),
])
def test_when_asked_for_waiting(in_round, left, finished, budget, mode, waiting):
    assert when_asked_for_waiting(in_round, left, finished, budget, mode) is waiting


@pytest.mark.parametrize("mode", [RESTART, HOT])
def test_a_worker_that_gave_up_is_not_restarted_for_a_peer_lost_at_the_same_moment(mode):
    # Every node's final checkpoint failed on a shared full disk: the peer that stopped first is
    # "lost" to this node, whose own worker is about to exit with its unrecoverable mark.
    assert when_asked_for_waiting(True, False, False, Budget(), mode, worker_gave_up=True) is Waiting.NONE
    assert when_asked_for_waiting(True, False, False, Budget(), RESTART, worker_gave_up=False) is Waiting.MEMBERSHIP


@pytest.mark.parametrize(("lost", "states", "kill"), [
    (("b",), {"b": "left"}, False),            # a graceful leave: the workers stop cleanly
    (("b",), {}, True),                        # no record: lost
    (("b", "c"), {"b": "left", "c": "training"}, True),
    (("b",), {"b": "failed"}, True),
    ((), {}, False),                           # only newcomers or re-joiners
])
def test_kill_for_lost(lost, states, kill):
    assert kill_for_lost(lost, states) is kill


@pytest.mark.parametrize(("request_", "left", "action"), [
    (None, False, RequestAction.IGNORE),
    ("leave", False, RequestAction.LEAVE),
    ("down", False, RequestAction.LEAVE_AND_CLOSE),
    ("leave", True, RequestAction.IGNORE),   # asked twice, or stopping on its own verdict already
    ("down", True, RequestAction.IGNORE),
])
def test_on_request(request_, left, action):
    assert on_request(request_, left) is action


# -- the same failure twice before a first step ----------------------------------------------------

def failure(kind="ZeroDivisionError", file="/job/train.py", line=3, in_script=True, trained=False,
            message="division by zero") -> WorkerFailure:
    return WorkerFailure(kind=kind, message=message, file=file, line=line, in_script=in_script, trained=trained)


@pytest.mark.parametrize(("previous", "current", "stops"), [
    (failure(), failure(), True),                                 # an import-time error, twice
    (failure(), failure(message="division by zero!"), True),      # the message may differ (a value in it)
    (None, failure(), False),                                     # the first failure: usual policy
    (failure(), None, False),                                     # this start left no record (killed)
    (failure(), failure(kind="KeyError"), False),                 # another type
    (failure(), failure(line=4), False),                          # another line
    (failure(), failure(file="/job/model.py"), False),            # another file
    (failure(trained=True), failure(), False),                    # the first one came after a step
    (failure(), failure(trained=True), False),                    # this one after training began
    (failure(in_script=False), failure(in_script=False), False),  # its peers' doing, maybe (a collective)
    (failure(), failure(in_script=False), False),
])
def test_repeated_failure(previous, current, stops):
    reason = repeated_failure(previous, current)
    if not stops:
        assert reason is None
        return
    assert reason == (f"its script failed the same way twice before its first step, ZeroDivisionError at line 3 "
                      f"of /job/train.py ({current.message}), which every restart would repeat.")


def test_a_repeated_failure_stops_the_node_as_an_unrecoverable_mark_does():
    decision = after_workers_ended("a", RESTART, {"0"}, E, repeated_failure(failure(), failure()))
    assert decision.action is NodeAction.STOP and decision.failure_event
    assert decision.message.startswith("The node 'a' stops without restarting its workers: its script failed "
                                       "the same way twice before its first step, ZeroDivisionError at line 3")
