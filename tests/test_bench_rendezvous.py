"""Smoke test of the rendezvous scale harness: 4 agents over 2 processes, etcd3 and c10d.

No timing is asserted; only that each round formed correctly (world size 4, ranks 0..3),
that etcd's counters were read, and that no child process outlived its round.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_rendezvous_harness_forms_a_correct_round_on_both_backends(tmp_path):
    rows_path = tmp_path / "rows.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench.rendezvous", "--agents", "4", "--processes", "2",
         "--backends", "etcd3", "c10d", "--timeout", "40", "--json", str(rows_path)],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=80,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {row["backend"]: row for row in json.loads(rows_path.read_text())}
    assert set(rows) == {"etcd3", "c10d"}
    for backend, row in rows.items():
        assert row["completed"] and row["correct"], f"{backend}: {row['errors']}"
        assert (row["agents"], row["processes"], row["agents_done"]) == (4, 2, 4), backend
        assert row["leftover"] == [] and row["processes_killed"] == 0, backend
        assert row["cpu_agents_s"] >= 0
    assert rows["etcd3"]["writes"] > 0 and rows["etcd3"]["proposals"] > 0
    assert "proposals" not in rows["c10d"]  # c10d does not touch etcd
    # One JSON line per round on stdout, then the table.
    assert sum(line.startswith("{") for line in result.stdout.splitlines()) == 2
    for pid in rows["etcd3"]["pids"] + rows["c10d"]["pids"]:  # no orphan once the harness is gone
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
