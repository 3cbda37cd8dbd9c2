"""The benchmark harness: its pure parts on synthetic records and results, then a smoke run.

The smoke run asserts no timing (timings belong in bench/); only that every system
produced a sample and nothing was left running.

Layer tests/process: real processes (elasticctl, torchrun, workers, tools). The other tests of this
subject: tests/unit/test_bench.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.helpers import REPO

from bench.cluster import SYSTEMS


@pytest.mark.slow
def test_bench_crash_host_scenario_runs_every_system(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "bench.run", "--quick", "--only", "crash_host", "--repeats", "1",
         "--no-report", "--output", str(tmp_path)],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=360,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (path,) = tmp_path.glob("*.json")
    results = json.loads(path.read_text())
    samples = results["scenarios"]["crash_host"]
    assert set(samples) == set(SYSTEMS) == {"elasticctl", "elasticctl-hot", "torchrun"}
    for system in SYSTEMS:
        assert len(samples[system]) == 1
        assert samples[system][0]["cold_start_s"] is not None, f"{system} never formed a world of 3"
        assert "outcome" in samples[system][0]
    assert "Targets, elasticctl hot mode: " in result.stdout
    assert results["leftover_processes"] == []
    assert results["machine"]["cpu_count"] >= 1
