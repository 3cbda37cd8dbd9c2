"""The one rule every wait for a world uses, in the tests and the benchmarks
(bench.harness.trained_together), table-tested on step lines as the trainers write them."""

from __future__ import annotations

import pytest

from bench.harness import step_lines, trained_together


def line(node, world, generation=1, pid=None, time=10.0, **more):
    return {"node": node, "world_size": world, "generation": generation, "pid": pid or hash(node) % 1000,
            "time": time, "step": 1, **more}


A1, A2, B1, B2, C1 = (line("a", 2, pid=1), line("a", 2, pid=2), line("b", 2, pid=3), line("b", 2, pid=4),
                      line("c", 2, pid=5))


@pytest.mark.parametrize("records, world, nodes, options, reached", [
    # every node of the set trained at the world: the lines come back
    ([A1, B1], 2, {"a", "b"}, {}, [A1, B1]),
    ([A1], 2, {"a", "b"}, {}, None),
    # other worlds, events and lines before `since` do not count
    ([A1, line("b", 3)], 2, {"a", "b"}, {}, None),
    ([A1, {"event": "start", "node": "b", "time": 11.0}], 2, {"a", "b"}, {}, None),
    ([A1, line("b", 2, time=5.0)], 2, {"a", "b"}, {"since": 6.0}, None),
    # a superset of nodes trained: the set is reached (not exactly)
    ([A1, B1, C1], 2, {"a", "b"}, {}, [A1, B1, C1]),
    # workers per node: two processes of each node
    ([A1, A2, B1], 2, {"a", "b"}, {"workers_per_node": 2}, None),
    ([A1, A2, B1, B2], 2, {"a", "b"}, {"workers_per_node": 2}, [A1, A2, B1, B2]),
    # a thawed node's line of an old generation is no sign of the new world
    ([line("a", 2, generation=3), line("b", 2, generation=2)], 2, {"a", "b"}, {"after_generation": 2}, None),
    # exactly: only a generation of exactly these nodes counts, and only its lines return
    ([A1, B1, C1], 2, {"a", "b"}, {"exactly": True}, None),
    ([line("a", 2, generation=1), line("b", 2, generation=1), line("a", 2, generation=2),
      line("c", 2, generation=2)], 2, {"a", "b"}, {"exactly": True},
     [line("a", 2, generation=1), line("b", 2, generation=1)]),
    ([A1, A2, B1, B2], 2, {"a", "b"}, {"exactly": True, "workers_per_node": 2}, [A1, A2, B1, B2]),
    ([A1, B1, B2], 2, {"a", "b"}, {"exactly": True, "workers_per_node": 2}, None),
])
def test_trained_together(records, world, nodes, options, reached):
    assert trained_together(records, world, nodes, **options) == reached


def test_step_lines_keep_steps_only():
    assert step_lines([A1, {"event": "done", "time": 11.0}, line("b", 3)], since=0.0, world=2) == [A1]


def test_a_zombie_has_ended_and_a_running_process_has_not():
    """stop_nodes waits until each process ended: a zombie has (an orphan's waits for init to
    collect it, seconds later on some machines), a running one has not until it exits."""
    import subprocess
    import sys

    import psutil

    from bench.harness import ended, wait_ended

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    proc = psutil.Process(child.pid)
    try:
        assert not ended(proc)
        assert wait_ended([proc], timeout=0.1) == [proc]
        child.kill()
        assert wait_ended([proc], timeout=10) == []  # not collected yet: a zombie of this process
        assert proc.status() == psutil.STATUS_ZOMBIE
    finally:
        child.kill()
        child.wait()
    assert ended(proc)
