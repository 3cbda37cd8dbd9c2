"""A short chaos soak (bench/chaos.py): three random events on a 4-node hot job, all its checks.

Layer tests/process: real processes (elasticctl, torchrun, workers, tools). The other tests of this
subject: tests/unit/test_chaos_generation_wait.py.
"""

from __future__ import annotations

import pytest

from bench import chaos


SEED = 3  # its three events, drawn by the soak's RNG, are printed in the test's output


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
