"""Smoke test of the rendezvous scale harness: 4 agents over 2 processes on every backend
(etcd3, etcd3-dynamic = the previous main's torch handler on etcd, c10d).

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

from bench.rendezvous import BACKENDS, parse_max_agents, planned

REPO = Path(__file__).resolve().parents[1]


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


def test_max_agents_limits_a_backend_to_the_sizes_it_completes():
    limits = parse_max_agents(["c10d=128", "etcd3-dynamic=64"])
    assert limits == {"c10d": 128, "etcd3-dynamic": 64}
    assert planned(64, BACKENDS, limits) == ["etcd3", "etcd3-dynamic", "c10d"]
    assert planned(128, BACKENDS, limits) == ["etcd3", "c10d"]
    assert planned(1000, BACKENDS, limits) == ["etcd3"]
    with pytest.raises(ValueError, match="BACKEND=N"):
        parse_max_agents(["c10d"])
