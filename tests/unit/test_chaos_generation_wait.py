"""A short chaos soak (bench/chaos.py): three random events on a 4-node hot job, all its checks.

Layer tests/unit: no etcd, no processes. The other tests of this subject:
tests/process/test_chaos.py.
"""

from __future__ import annotations

from bench import chaos


def line(generation, node, world, t):
    return {"generation": generation, "node": node, "world_size": world, "time": t}


def test_the_soak_waits_for_a_generation_of_exactly_the_expected_nodes():
    lines = [line(4, "n1", 3, 1.0), line(4, "n2", 3, 1.1), line(4, "n3", 3, 1.2),   # before the event
             line(5, "n1", 2, 2.0),                                                   # n2 not there yet
             line(6, "n1", 2, 3.0), line(6, "n2", 2, 3.1), line(6, "n2", 2, 3.5)]
    assert chaos.first_together(lines, {"n1", "n2"}, after_generation=4) == 3.0
    assert chaos.first_together(lines, {"n1", "n2", "n3"}, after_generation=4) is None  # not a newer generation
    assert chaos.first_together(lines, {"n1", "n2", "n3"}, after_generation=-1) == 1.0  # a freeze: any generation
    assert chaos.first_together(lines, {"n1", "n3"}, after_generation=4) is None
