"""A short chaos soak (bench/chaos.py): three random events on a 4-node hot job, all its checks."""

from __future__ import annotations

import pytest

from bench import chaos

SEED = 3  # its three events, drawn by the soak's RNG, are printed in the test's output


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


@pytest.mark.slow
def test_a_short_chaos_soak_passes(tmp_path):
    try:
        # ttl 5: the run's keys would expire several times over if only writes renewed them
        summary = chaos.soak(chaos.Options(events=3, seed=SEED, node_ttl=3, checkpoint_every=5, ttl=5), tmp_path)
    except chaos.ChaosFailure as exc:
        pytest.fail(f"chaos soak, seed {SEED}: {exc} (logs in {tmp_path})")
    print(chaos.summarize(summary))
    assert [e["number"] for e in summary["events"]] == [1, 2, 3]
    assert all(e["recovered_s"] is not None for e in summary["events"])
    assert summary["duration_s"] > 2 * 5, "the soak did not cross several ttl periods"
