"""The worker's parts (elasticctl.train.worker) that stand alone: the liveness snapshot the other
threads read, the step boundary's flags in a generation of one, the stop bound, and the rule
that the parts never import one another (only the executor and the forming of a generation,
which compose them, do)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from elasticctl.job.options import RecoveryMode
from elasticctl.train.worker.boundary import Agreed
from elasticctl.train.phase import Phase
from elasticctl.train.worker.liveness import Liveness, LivenessBoard
from elasticctl.train.worker.step_boundary import StepBoundary
from elasticctl.train.worker.watchdog import STOP_BOUND, no_step_warning_after, stop_bound

WORKER = Path(__file__).resolve().parents[2] / "elasticctl" / "train" / "worker"
COMPOSERS = {"executor", "forming"}   # they compose the parts; every other module is a part
# what the parts are handed or decide by, not parts themselves: values and the pure machine
VALUES = {"place", "liveness", "lifecycle", "boundary"}


def test_the_liveness_counts_a_step_only_within_a_generation():
    board = LivenessBoard()
    board.boundary(at=board.now.last_boundary + 50.0)  # forming: a wait, not a step
    assert board.now.longest_step == 0.0
    board.phase(Phase.TRAINING)
    start = board.now.last_boundary
    board.boundary(at=start + 2.0)
    board.boundary(at=start + 2.5)
    assert board.now == Liveness(Phase.TRAINING, start + 2.5, 2.0)


def test_the_liveness_is_replaced_whole_never_changed_in_place():
    board = LivenessBoard()
    seen = board.now
    board.phase(Phase.TRAINING)
    board.boundary()
    assert seen == Liveness(Phase.FORMING, seen.last_boundary, 0.0)  # a reader's copy stays as it was
    with pytest.raises(dataclasses.FrozenInstanceError):
        board.now.phase = Phase.FINISHED


@pytest.mark.parametrize("mode", list(RecoveryMode))
@pytest.mark.parametrize(("pending", "stop"), [(False, False), (True, False), (False, True), (True, True)])
def test_alone_the_flags_are_agreed_at_once_and_the_stop_is_read_once(mode, pending, stop):
    reads = []
    boundary = StepBoundary(mode, stop_requested=lambda: stop,
                            after_stop_flag_read=lambda: reads.append(boundary.leaving_sent))
    assert boundary.send(pending, world_size=1, control_group=None) == Agreed(int(pending), int(stop), 1)
    assert boundary.leaving_sent is stop and reads == [stop]
    assert boundary.in_flight() is None


def test_a_stop_after_the_read_is_sent_at_the_next_boundary():
    told = []
    boundary = StepBoundary(RecoveryMode.HOT, stop_requested=lambda: bool(told),
                            after_stop_flag_read=lambda: told.append(True))
    assert boundary.send(False, world_size=1, control_group=None) == Agreed(0, 0, 1)  # read before the stop
    assert boundary.stop_requested and not boundary.leaving_sent
    assert boundary.send(False, world_size=1, control_group=None) == Agreed(0, 1, 1)


@pytest.mark.parametrize(("longest", "bound"), [(0.0, STOP_BOUND), (STOP_BOUND / 2, STOP_BOUND), (30.0, 60.0)])
def test_a_stop_gets_twice_the_longest_step_and_at_least_the_bound(longest, bound):
    assert stop_bound(longest) == bound


@pytest.mark.parametrize(("ttl", "after"), [(None, 120.0), (5.0, 120.0), (90.0, 180.0)])
def test_the_no_step_warning_waits_twice_the_longer_of_the_ttl_and_a_minute(ttl, after):
    assert no_step_warning_after(ttl) == after


def _worker_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("elasticctl.train.worker."):
            found.add(node.module.rsplit(".", 1)[1])
    return found


def test_the_parts_never_import_one_another():
    parts = {path.stem: _worker_imports(path) for path in WORKER.glob("*.py") if path.stem != "__init__"}
    assert COMPOSERS <= set(parts) and {"generation_manager", "step_boundary", "checkpoint_duty"} <= set(parts)
    crossing = {part: sorted(imported - VALUES) for part, imported in parts.items()
                if part not in COMPOSERS and imported - VALUES}
    assert crossing == {}


def test_one_roster_per_generation_is_gathered_once_and_shared(process_group, monkeypatch, caplog):
    from types import SimpleNamespace

    from elasticctl.train.groups import roster as roster_module

    gathers = []
    real = roster_module.gather_node_names
    monkeypatch.setattr(roster_module, "gather_node_names",
                        lambda *args: gathers.append(args) or real(*args))  # counts the real all-gathers
    roster = roster_module.Roster("a", "a.0")
    first, second = SimpleNamespace(number=1, world_size=1), SimpleNamespace(number=2, world_size=1)
    assert [roster.nodes(first, None, "x"), roster.nodes(first, None, "y")] == [["a"], ["a"]]
    assert len(gathers) == 1  # the second watch to ask reads the first one's
    assert roster.nodes(second, None, "x") == ["a"] and len(gathers) == 2  # a new generation gathers anew
    roster.forget()
    assert roster.nodes(second, None, "x") == ["a"] and len(gathers) == 3


def test_a_roster_a_peer_spoiled_names_no_node_and_each_watch_says_what_it_costs(process_group, caplog):
    from types import SimpleNamespace

    from elasticctl.train.groups.roster import Roster

    roster = Roster("a/b", "a.0")  # bytes that are no node name, as a peer's could be
    generation = SimpleNamespace(number=4, world_size=1)
    assert roster.nodes(generation, None, "the check names no node") == []
    assert roster.nodes(generation, None, "stragglers are off") == []
    warnings = [r.getMessage() for r in caplog.records if "generation 4" in r.getMessage()]
    assert len(warnings) == 2 and "the check names no node" in warnings[0] and "stragglers are off" in warnings[1]


def test_the_supervisor_hands_every_verdict_to_the_reporter_even_when_the_check_stops_the_job():
    from elasticctl.job.records import EventKind
    from elasticctl.train.watches.replica_check import ReplicasDisagree
    from elasticctl.train.worker.watch_supervisor import Watches

    recorded, asked = [], []
    watches = Watches(None, worker="a.0", node="a", record=lambda kind, **fields: recorded.append((kind, fields)),
                      request_leave=asked.append, roster=lambda *args: ["a"], control_group=lambda: None,
                      replica_set=lambda: 0, sharded=False, non_finite=False)

    def concludes_then_stops(group, step, model):
        watches.replicas.verdicts.record(EventKind.REPLICA_DIVERGED, node="b", step=step)
        watches.replicas.verdicts.evict("b")
        watches.replicas.verdicts.record(EventKind.REPLICA_DIVERGED, node="", step=step)
        raise ReplicasDisagree("no majority")

    watches.replicas.at_boundary = concludes_then_stops
    with pytest.raises(ReplicasDisagree):
        watches.at_boundary(None, 7, None)
    assert recorded == [(EventKind.REPLICA_DIVERGED, {"node": "b", "step": 7}),
                        (EventKind.REPLICA_DIVERGED, {"node": "", "step": 7})]
    assert asked == ["b"] and watches.replicas.verdicts.take() == []


def test_the_inbox_hands_each_event_to_its_own_thread_in_order_and_drains_before_it_closes():
    import os
    import signal
    import threading

    from elasticctl.train.worker.inbox import Inbox, StopRequested

    handled = []
    inbox = Inbox("a.0", lambda event: handled.append((event, threading.current_thread().name)))
    first, second = StopRequested(at=1.0), StopRequested(at=2.0)
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: inbox.put(second))  # a handler only puts
    try:
        inbox.put(first)
        os.kill(os.getpid(), signal.SIGUSR1)  # its handler runs before this call returns
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert inbox.stop_requested  # by the put itself, before the inbox's thread runs
    inbox.start()
    inbox.close()  # what was put before is handled first
    assert handled == [(first, "elasticctl-inbox"), (second, "elasticctl-inbox")]


def test_an_event_that_fails_to_be_handled_does_not_end_the_inbox(caplog):
    from elasticctl.train.worker.inbox import Inbox, StopRequested

    handled = []

    def handle(event):
        if not handled:
            handled.append("failed")
            raise RuntimeError("boom")
        handled.append(event.at)

    inbox = Inbox("a.0", handle)
    inbox.start()
    inbox.put(StopRequested(at=1.0))
    inbox.put(StopRequested(at=2.0))
    inbox.close()
    assert handled == ["failed", 2.0] and "handling" in caplog.text
