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


def test_with_two_workers_per_node_the_soak_waits_for_both_workers_of_every_node():
    def worker(generation, node, pid, t):
        return {**line(generation, node, 4, t), "pid": pid}

    lines = [worker(7, "n1", 11, 1.0), worker(7, "n1", 12, 1.0), worker(7, "n2", 21, 1.1),  # n2's second missing
             worker(8, "n1", 11, 2.0), worker(8, "n1", 12, 2.0), worker(8, "n2", 21, 2.1), worker(8, "n2", 22, 2.2)]
    assert chaos.first_together(lines, {"n1", "n2"}, after_generation=6, per_node=2) == 2.0
    assert chaos.first_together(lines, {"n1", "n2"}, after_generation=8, per_node=2) is None


def test_a_soak_mix_without_joins_says_so_when_no_kind_applies(tmp_path):
    soak = chaos.Soak.__new__(chaos.Soak)  # the event choice alone: no cluster
    soak.options = chaos.Options(events=1, seed=0, trainer="lm-hsdp", kinds=("kill",))
    soak.rng, soak.kinds, soak.live, soak.crashed = __import__("random").Random(0), ("kill",), ["n1", "n2"], set()
    soak.min_nodes, soak.max_nodes, soak.per_node = 2, 3, 2
    soak._generation = lambda: 0
    soak._snapshot = lambda: None
    try:
        soak._event(5)
    except chaos.ChaosFailure as exc:
        assert str(exc) == "event 5: none of the kinds ['kill'] applies with 2 nodes live (2 to 3)"
    else:
        raise AssertionError("a kill with the fewest nodes live was applied")
    assert chaos.default_kinds("lm-hsdp") == ("kill", "freeze", "leave", "join", "crash-worker")
    assert chaos.default_kinds("mlp") == ("kill", "freeze", "leave", "join")


def test_a_join_failed_when_its_event_failed_or_restarted_other_nodes_workers():
    assert chaos.join_failed({"failure": "event 3: join n5 -> 3 nodes: the job did not train at world 6"})
    assert not chaos.join_failed({"failure": "event 3: kill n2 -> 2 nodes: the job did not train at world 4"})
    assert not chaos.join_failed({"failure": "replicas diverged at 2 step: [(1, 0)]",
                                  "events": [{"kind": "kill", "others_restarted": 2},
                                             {"kind": "crash-worker", "others_restarted": 0}]})
    assert chaos.join_failed({"failure": "replicas diverged at 2 step: [(1, 0)]",
                              "events": [{"kind": "freeze", "others_restarted": 4}]})
