"""The handler's policy, driven in process: a real etcd, the handler torch's agent would get, no torchrun.

The test plays torch's agent: it asks ``next_rendezvous`` for a round, writes the marks
the workers would write (``elasticctl.train.entry``) where the handler told them to, and
asks again, as the agent does after its workers ended. A node alone in its round is judged
at once (nobody else to blame), so each failure's charge is known when the call returns.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

import pytest
from support.helpers import wait_for

from elasticctl.etcd.client import EtcdClient
from elasticctl.job import environment
from elasticctl.job.events import EventLog
from elasticctl.job.records import EventKind, FailureCause, MemberState
from elasticctl.job.registry import Registry
from elasticctl.job.worker_failure import WorkerFailure


@pytest.fixture
def handler_for(default_etcd, run_id, monkeypatch):
    """``handler_for(node="a", max_nodes=1, **rdzv_conf)``: a node's handler for the run (min_nodes 1),
    shut down at teardown."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

    # The handler hands its workers their environment through this process's: restored after.
    for name in (environment.RESTARTS, environment.WORKER_MARKS):
        monkeypatch.delenv(name, raising=False)
    made = []

    def make(node="a", max_nodes=1, **conf):
        monkeypatch.setenv(environment.NODE, node)  # read when the handler is created
        params = RendezvousParameters("etcd3", default_etcd.endpoint, run_id, 1, max_nodes, local_addr="127.0.0.1",
                                      **conf)
        made.append(rendezvous_handler_registry.create_handler(params))
        return made[-1]

    yield make
    for handler in made:
        handler.shutdown()


@pytest.fixture
def records(default_etcd, run_id):
    """``records()``: the member records and the event history of the run, as etcd holds them."""
    client = EtcdClient(default_etcd.client_settings())
    registry = Registry(client, run_id)

    def read():
        return registry.members(), EventLog(client, registry.keys).read()

    yield read
    client.close()


def workers_ended(started=("0",), done=()) -> None:
    """What the workers of the current round marked before they ended."""
    marks = Path(os.environ[environment.WORKER_MARKS])
    for rank in started:
        (marks / f"started-{rank}").write_text("")
    for rank in done:
        (marks / f"done-{rank}").write_text("")


def test_failures_are_charged_until_the_node_stops_over_budget(handler_for, records):
    handler = handler_for(max_restarts=1, quarantine_after=5)
    first = handler.next_rendezvous()
    assert (first.rank, first.world_size, os.environ[environment.RESTARTS]) == (0, 1, "0")

    workers_ended()
    assert handler.num_nodes_waiting() == 0  # a failure is no membership change
    second = handler.next_rendezvous()       # the agent restarts its workers: charged at once
    assert handler.restarts_spent == 1
    assert os.environ[environment.RESTARTS] == "1"  # the restarted workers see the count
    members, _ = records()
    assert members["a"]["state"] == "training" and members["a"]["restarts"] == 1
    assert members["a"]["round"] == 2 and second.world_size == 1

    workers_ended()
    with pytest.raises(SystemExit) as stop:
        handler.next_rendezvous()
    assert stop.value.code == 1
    assert handler.restarts_spent == 2
    handler.shutdown()  # as torchrun's finally does; it writes what was queued
    members, events = records()
    assert members["a"]["state"] == "failed"
    assert [e.charged for e in events if e.kind is EventKind.FAILURE_JUDGED] == [True, True]
    over = [e for e in events if e.kind is EventKind.OVER_BUDGET]
    assert len(over) == 1 and "failed 2 times, more than the 1 restarts allowed" in over[0].reason
    assert not handler.is_closed()  # a node over budget stops alone: the job goes on


def test_a_finished_group_ends_the_node_instead_of_training_again(handler_for, records):
    handler = handler_for(max_restarts=3)
    handler.next_rendezvous()
    workers_ended(started=("0",), done=("0",))  # finished, then died at interpreter exit
    assert handler.num_nodes_waiting() == 0
    with pytest.raises(SystemExit) as end:
        handler.next_rendezvous()
    assert end.value.code == 0
    assert handler.restarts_spent == 0
    handler.shutdown()
    members, events = records()
    assert members["a"]["state"] == "done"
    assert handler.is_closed()  # the job is complete
    assert not [e for e in events if e.kind is EventKind.WORKERS_FAILED]


def test_a_worker_failing_after_another_finished_stops_the_node(handler_for, records):
    handler = handler_for(max_restarts=3)
    handler.next_rendezvous()
    workers_ended(started=("0", "1"), done=("0",))
    with pytest.raises(SystemExit) as stop:
        handler.next_rendezvous()
    assert stop.value.code == 1
    handler.shutdown()
    members, _ = records()
    assert members["a"]["state"] == "failed"
    assert members["a"]["reason"] == ("local worker(s) 1 failed after local worker(s) 0 had finished; "
                                      "the group is not started again")
    assert handler.restarts_spent == 0
    assert not handler.is_closed()


def test_an_agent_that_crashed_records_the_cause_its_node_reads(handler_for, records):
    handler = handler_for(max_restarts=3)
    handler.next_rendezvous()
    try:
        raise RuntimeError("the agent's own bug")
    except RuntimeError:
        handler.shutdown()  # torchrun's `finally`, with the exception in flight
    members, _ = records()
    assert (members["a"]["state"], members["a"]["cause"]) == (MemberState.FAILED, FailureCause.AGENT_CRASHED)
    assert not handler.is_closed()


def test_an_unrecoverable_worker_stops_the_node_without_spending_a_restart(handler_for, records):
    handler = handler_for(max_restarts=3)
    handler.next_rendezvous()
    workers_ended()
    Path(os.environ[environment.WORKER_MARKS], "unrecoverable-0").write_text("the disk is full")
    with pytest.raises(SystemExit) as stop:
        handler.next_rendezvous()
    assert stop.value.code == 1
    handler.shutdown()
    members, events = records()
    assert (members["a"]["state"], members["a"]["reason"]) == ("failed", "the disk is full")
    assert members["a"]["cause"] == FailureCause.STOPPED
    assert [e.reason for e in events if e.kind is EventKind.WORKERS_FAILED] == ["the disk is full"]
    assert handler.restarts_spent == 0


IMPORT_ERROR = WorkerFailure(kind="ZeroDivisionError", message="division by zero", file="/job/train.py", line=2,
                             in_script=True, trained=False)


def failed_with(record: str) -> None:
    """The workers of the current round ended, local rank 0 leaving ``record`` of its failure."""
    workers_ended()
    Path(os.environ[environment.WORKER_MARKS], "failure-0").write_text(record)


def test_the_same_failure_before_a_first_step_twice_stops_the_node(handler_for, records):
    handler = handler_for(max_restarts=5, quarantine_after=5)
    handler.next_rendezvous()
    failed_with(IMPORT_ERROR.to_json())
    handler.next_rendezvous()  # the first one: restarted, as any failure
    assert handler.restarts_spent == 1
    failed_with(IMPORT_ERROR.to_json())
    with pytest.raises(SystemExit) as stop:
        handler.next_rendezvous()
    assert stop.value.code == 1
    handler.shutdown()
    members, events = records()
    reason = ("its script failed the same way twice before its first step, ZeroDivisionError at line 2 of "
              "/job/train.py (division by zero), which every restart would repeat.")
    assert (members["a"]["state"], members["a"]["cause"], members["a"]["reason"]) == (
        "failed", FailureCause.STOPPED, reason)
    assert reason in [e.reason for e in events if e.kind is EventKind.WORKERS_FAILED]
    assert handler.restarts_spent == 1  # the second one spends nothing: the node stops on it


@pytest.mark.parametrize("second", [
    dataclasses.replace(IMPORT_ERROR, line=3).to_json(),          # another failure
    dataclasses.replace(IMPORT_ERROR, trained=True).to_json(),    # after training began
    '{"kind": "ZeroDivisionError", "line": "2"}',                 # not a record: nothing to compare
    "x" * 10000,
], ids=["another-line", "after-a-step", "malformed", "oversized"])
def test_anything_but_the_same_failure_before_a_first_step_keeps_the_budget(handler_for, second):
    handler = handler_for(max_restarts=5, quarantine_after=5)
    handler.next_rendezvous()
    failed_with(IMPORT_ERROR.to_json())
    handler.next_rendezvous()
    failed_with(second)
    handler.next_rendezvous()  # restarted again, charged
    assert handler.restarts_spent == 2


def test_repeated_own_failures_sit_out_a_quarantine_then_train_again(handler_for, records):
    handler = handler_for(max_restarts=5, quarantine_after=1, quarantine_seconds=0.2)
    handler.next_rendezvous()
    workers_ended()
    again = handler.next_rendezvous()  # charged, quarantine due: sits out 0.2 s, then joins
    assert again.world_size == 1 and handler.restarts_spent == 1
    handler.shutdown()
    _, events = records()
    kinds = [e.kind for e in events if e.node == "a"]
    assert EventKind.QUARANTINED in kinds
    assert kinds.index(EventKind.QUARANTINED) > kinds.index(EventKind.FAILURE_JUDGED)


def test_a_newcomer_restarts_the_workers_without_spending_a_restart(handler_for):
    # max_restarts=0: a restart charged to node a would stop it.
    a = handler_for("a", max_nodes=2, max_restarts=0, last_call_timeout=1)
    assert a.next_rendezvous().world_size == 1  # alone after the last call
    b = handler_for("b", max_nodes=2, max_restarts=0, last_call_timeout=1)
    joined = {}
    newcomer = threading.Thread(target=lambda: joined.update(info=b.next_rendezvous()), daemon=True)
    newcomer.start()
    wait_for(a.num_nodes_waiting, 30, "node a to see node b waiting")
    again = a.next_rendezvous()  # the agent stopped its workers for the change, and asks again
    newcomer.join(30)
    assert again.world_size == 2 and joined["info"].world_size == 2
    assert {again.rank, joined["info"].rank} == {0, 1}
    assert a.restarts_spent == 0
