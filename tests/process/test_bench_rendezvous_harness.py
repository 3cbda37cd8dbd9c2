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


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_light_agents_and_a_hot_re_formation_at_small_n(tmp_path):
    """Simulated agents: 16 light agents in 2 processes form one correct round with about one write
    each; 12 hot workers re-form to 11 after one loss, with both declaration-following policies,
    the followers' with fewer watch events."""
    from bench.rendezvous import EVERY_MEMBER, FOLLOWERS, LIGHT, measure_hot, measure_round
    from elasticctl.embedded_etcd import EmbeddedEtcd

    with EmbeddedEtcd(client_port=0, peer_port=0, data_dir=str(tmp_path / "etcd")) as etcd:
        row = measure_round(LIGHT, etcd, 16, processes=2, timeout=40)
        assert row["completed"] and row["correct"], row["errors"]
        assert row["writes_per_agent"] <= 2.2 and row["leftover"] == []
        hot = {policy: measure_hot(etcd, 12, policy, processes=2, timeout=40) for policy in (FOLLOWERS, EVERY_MEMBER)}
    for policy, row in hot.items():
        assert row["completed"] and row["correct"], (policy, row["errors"])
        assert row["workers_done"] == 11 and row["leftover"] == [], policy
        assert row["events_received"] > 0, policy
    assert hot[FOLLOWERS]["events_received"] < hot[EVERY_MEMBER]["events_received"]
    for row in (*hot.values(),):
        for pid in row["pids"]:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
