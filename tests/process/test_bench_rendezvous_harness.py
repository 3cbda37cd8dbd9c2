"""Smoke test of the rendezvous scale harness: 4 agents over 2 processes on every backend
(etcd3, etcd3-dynamic = the previous main's torch handler on etcd, c10d), and the report's
scale table from results of both formats (before and after the scale series).

No timing is asserted; only that each round formed correctly (world size 4, ranks 0..3),
that etcd's counters were read, and that no child process outlived its round.

Layer tests/process: real processes (elasticctl, torchrun, workers, tools). The other tests of this
subject: tests/unit/test_bench_rendezvous.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest
from support.helpers import REPO

from bench.rendezvous import BACKENDS


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_rendezvous_harness_forms_a_correct_round_on_every_backend(tmp_path):
    rows_path = tmp_path / "rows.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench.rendezvous", "--agents", "4", "--processes", "2",
         "--backends", *BACKENDS, "--timeout", "40", "--json", str(rows_path)],
        check=False, cwd=REPO, capture_output=True, text=True, timeout=110,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {row["backend"]: row for row in json.loads(rows_path.read_text())}
    assert set(rows) == {"etcd3", "etcd3-dynamic", "c10d"}
    for backend, row in rows.items():
        assert row["completed"] and row["correct"], f"{backend}: {row['errors']}"
        assert (row["agents"], row["processes"], row["agents_done"]) == (4, 2, 4), backend
        assert row["leftover"] == [] and row["processes_killed"] == 0, backend
        assert row["cpu_agents_s"] >= 0
    for backend in ("etcd3", "etcd3-dynamic"):  # both keep the round in etcd
        assert rows[backend]["writes"] > 0 and rows[backend]["proposals"] > 0, backend
    assert "proposals" not in rows["c10d"]  # c10d does not touch etcd
    # One JSON line per round on stdout, then the table.
    assert sum(line.startswith("{") for line in result.stdout.splitlines()) == 3
    for row in rows.values():  # no orphan once the harness is gone
        for pid in row["pids"]:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
