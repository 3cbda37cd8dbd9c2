"""Smoke test of the rendezvous scale harness: 4 agents over 2 processes on every backend
(etcd3, etcd3-dynamic = the previous main's torch handler on etcd, c10d), and the report's
scale table from results of both formats (before and after the scale series).

No timing is asserted; only that each round formed correctly (world size 4, ranks 0..3),
that etcd's counters were read, and that no child process outlived its round.

Layer tests/unit: no etcd, no processes. The other tests of this subject:
tests/process/test_bench_rendezvous_harness.py.
"""

from __future__ import annotations

import pytest

from bench import report
from bench.rendezvous import BACKENDS, parse_max_agents, planned


def test_max_agents_limits_a_backend_to_the_sizes_it_completes():
    limits = parse_max_agents(["c10d=128", "etcd3-dynamic=64"])
    assert limits == {"c10d": 128, "etcd3-dynamic": 64}
    assert planned(64, BACKENDS, limits) == ["etcd3", "etcd3-dynamic", "c10d"]
    assert planned(128, BACKENDS, limits) == ["etcd3", "c10d"]
    assert planned(1000, BACKENDS, limits) == ["etcd3"]
    with pytest.raises(ValueError, match="BACKEND=N"):
        parse_max_agents(["c10d"])


def _round(backend: str, agents: int, seconds: float | None, **extra) -> dict:
    return {"backend": backend, "agents": agents, "completed": seconds is not None,
            "correct": True if seconds is not None else None, "seconds": seconds,
            "setup_s": 3.0, "agents_done": agents if seconds is not None else agents // 4, **extra}


def _results(entries: list[dict], **settings) -> dict:
    return {"mode": "full", "scenarios": {"rendezvous": entries},
            "settings": {"rendezvous_repeats": 3, **settings}}


def test_scale_table_has_ratios_to_the_previous_main_and_c10d_and_failures_as_bounds():
    limits = {"etcd3-dynamic": 64, "c10d": 128}
    entries = [
        {"agents": 64, "timeout": 120.0, "etcd3": [0.5], "etcd3-dynamic": [10.0], "c10d": [5.0],
         "rounds": [_round("etcd3", 64, 0.5, writes_per_agent=2.0, proposals_per_agent=3.0),
                    _round("etcd3-dynamic", 64, 10.0, writes_per_agent=1.5, proposals_per_agent=23.0),
                    _round("c10d", 64, 5.0)]},
        {"agents": 128, "timeout": 120.0, "etcd3": [0.6], "c10d": [None],
         "rounds": [_round("etcd3", 128, 0.6, writes_per_agent=2.0), _round("c10d", 128, None)]},
        {"agents": 2, "timeout": 120.0, "etcd3": [0.03], "etcd3-dynamic": [1.1], "c10d": [1.1],
         "rounds": [_round("etcd3", 2, 0.03, writes_per_agent=3.5)]},
        {"agents": 1000, "timeout": 120.0, "etcd3": [4.0],
         "rounds": [_round("etcd3", 1000, 4.0, writes_per_agent=2.0)]},
    ]
    results = _results(entries, rendezvous_max_agents=limits)
    rows = {row[0]: row for row in report.rendezvous_rows(results)}
    assert list(rows) == ["64", "128", "2", "1,000"]
    assert rows["64"][1:4] == ("0.50 (0.50–0.50, n=1)", "2.0", "3.0 / 23.0")
    assert rows["64"][-2:] == ("0.05", "0.10")
    assert rows["128"][4] == "not run" and rows["128"][-2] == "—"
    assert rows["128"][5] == "none within 120 s (1/1); 32/128 returned"
    assert rows["128"][-1] == "< 0.005"  # c10d made no round: an upper bound, two significant digits
    assert rows["1,000"][4:] == ("not run", "not run", "—", "—")
    targets = report.rendezvous_targets(results)
    assert "1,000 agents in ≤ 10 s: 4.00 s (met)" in targets
    assert "256 agents in ≤ 3 s: not measured in this run" in targets
    assert "2.0 × N at 1,000 agents (met); above it only where" in targets
    assert targets.endswith("weigh most: 3.5 × N at 2 agents.")
    section = "\n".join(report.rendezvous_section(results))
    assert "| 1,000 | 4.00 (4.00–4.00, n=1) | 2.0 |" in section
    assert "previous main up to 64 agents; c10d up to 128 agents" in section


def test_scale_table_reads_results_from_before_the_scale_series():
    entries = [{"agents": 8, "etcd3": [1.2, 1.3, None], "c10d": [1.0, 1.1, 1.2]}]  # no rounds, no timeout
    (row,) = report.rendezvous_rows(_results(entries))
    assert row[0] == "8" and row[2] == "—" and row[4] == "not run"
    assert row[1] == "1.25 (1.20–1.30, n=2); 1 failed"
    assert row[-1] == "1.14"
    assert "3 repeats per size." in "\n".join(report.rendezvous_section(_results(entries)))


def test_scale_section_reports_light_rounds_and_hot_re_formations_against_their_targets():
    """One round of simulated agents, and a hot re-formation with both policies."""
    light = [{"backend": "etcd3-light", "agents": 10000, "watchers": "process", "completed": True, "correct": True,
              "seconds": 3.46, "writes_per_agent": 1.0, "events": 12, "events_per_agent": 0.0, "cpu_etcd_s": 4.2}]
    hot = [{"workers": 1000, "policy": "followers", "completed": True, "correct": True, "seconds": 0.5,
            "sealed_s": 0.42, "events_received": 4114, "writes_per_agent": 1.0, "cpu_etcd_s": 0.2},
           {"workers": 1000, "policy": "every-member", "completed": True, "correct": True, "seconds": 9.0,
            "sealed_s": 8.0, "events_received": 1_004_000, "writes_per_agent": 1.0, "cpu_etcd_s": 3.0}]
    results = {"mode": "full", "scenarios": {"rendezvous_scale": {"light": light, "hot": hot}}, "settings": {}}
    rows = report.scale_rows(results)
    assert rows[0] == ("one round, watch per process", "10,000", "3.46", "1.00", "12 (0.00)", "4.20")
    assert rows[1][2:5] == ("0.50 (sealed 0.42)", "1.00", "4,114 (4.11)")
    targets = report.scale_targets(results)
    assert "10,000 agents in ≤ 10 s: 3.46 s (met)" in targets
    assert "≤ 2.2 etcd writes per agent: 1.00 (met), etcd's CPU 4.20 s" in targets
    assert "1,000 in ≤ 1 s: 0.50 s (met), ≤ 5 × N watch events: 4.1 × N (met)" in targets
    assert targets.endswith("every member following every declaration: 1004.0 × N.")
    assert "| hot re-formation, every-member | 1,000 |" in "\n".join(report.scale_section(results))
    empty = {"scenarios": {"rendezvous_scale": {}}}
    assert "not measured in this run" in report.scale_targets(empty)


def test_real_handler_rounds_are_reported_per_size_against_the_target():
    """Rounds of real handlers: per size the complete rounds' median (min-max), etcd's counters
    per agent, failed agents and the load; the target at 1,000 wants every round complete."""
    def row(agents, seconds, repeat, completed=True, proposals=3.0, failed=0, load=1.0):
        return {"backend": "etcd3", "agents": agents, "processes": 8, "completed": completed, "correct": completed,
                "seconds": seconds, "proposals_per_agent": proposals, "writes_per_agent": 2.0,
                "txn_requests_per_agent": 1.5, "lease_expiries": 2 if failed else 0,
                "agents_failed": failed, "load_1min": load, "repeat": repeat}

    rows = [row(256, 0.9, 1), row(1000, 11.0, 1, proposals=5.0), row(256, 0.8, 2, load=2.5),
            row(1000, 13.0, 2, proposals=5.5), row(1000, None, 3, completed=False, failed=1, proposals=10.0)]
    results = {"mode": "full", "scenarios": {"rendezvous_real": rows}, "settings": {}}
    assert report.real_handler_rows(results) == [
        ("256", "8", "2 of 2", "0.85 (0.80–0.90)", "3.00", "2.00", "1.50", "0", "0", "1.0–2.5"),
        ("1,000", "8", "2 of 3", "12.00 (11.00–13.00)", "5.50", "2.00", "1.50", "2", "1", "1.0–1.0")]
    target = report.real_handler_targets(results)
    assert target.endswith("12.00 s, 2 of 3 complete (missed).")
    met = {"scenarios": {"rendezvous_real": [row(1000, 11.0, 1), row(1000, 11.5, 2)]}}
    assert report.real_handler_targets(met).endswith("11.25 s, 2 of 2 complete (met).")
    assert "not measured in this run" in report.real_handler_targets({"scenarios": {}})
    section = "\n".join(report.real_handler_section(results))
    assert "| 1,000 | 8 | 2 of 3 | 12.00 (11.00–13.00) | 5.50 |" in section
