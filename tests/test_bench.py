"""Smoke test of the benchmark harness: one scenario, one repeat, both systems, nothing left running.

No timing is asserted (timings belong in bench/); only that each system produced a sample.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_crash_host_scenario_runs_both_systems(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "bench.run", "--quick", "--only", "crash_host", "--repeats", "1",
         "--no-report", "--output", str(tmp_path)],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (path,) = tmp_path.glob("*.json")
    results = json.loads(path.read_text())
    samples = results["scenarios"]["crash_host"]
    assert len(samples["elasticctl"]) == len(samples["torchrun"]) == 1
    for system in ("elasticctl", "torchrun"):
        assert samples[system][0]["cold_start_s"] is not None, f"{system} never formed a world of 3"
        assert "outcome" in samples[system][0]
    assert results["leftover_processes"] == []
    assert results["machine"]["cpu_count"] >= 1
