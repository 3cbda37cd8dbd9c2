"""The benchmark harness: its pure parts on synthetic records and results, then a smoke run.

The smoke run asserts no timing (timings belong in bench/); only that every system
produced a sample and nothing was left running.

Layer tests/unit: no etcd, no processes. The other tests of this subject:
tests/process/test_bench_crash_host.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import report, scenarios
from bench.cluster import Cluster, Record


def _step(t: float, step: int, world: int, rank: int, node: str) -> dict:
    return {"time": t, "step": step, "world_size": world, "rank": rank, "node": node}


def _start(t: float, world: int, rank: int, process_started: float) -> dict:
    return {"event": "start", "time": t, "world_size": world, "rank": rank,
            "process_started": process_started, "initialized": t}


def _record(tmp_path: Path, lines: list[dict]) -> SimpleNamespace:
    path = tmp_path / "record.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return SimpleNamespace(record=Record(path), nodes={})


def test_admission_measures_the_pause_and_the_joiners_start_up(tmp_path):
    # Node d starts at 10.0; its process starts at 10.1, is admitted at 11.0 as rank 2 and trains
    # at 11.2. Rank 0 (node a) trains at world 2 until 10.9 and at world 3 from 11.3.
    lines = [_step(9.0 + i / 10, 100 + i, 2, 0, "a") for i in range(20)]  # 9.0 .. 10.9
    lines += [_step(9.0 + i / 10, 100 + i, 2, 1, "b") for i in range(20)]
    lines += [_start(11.0, 3, 2, 10.1), _step(11.2, 120, 3, 2, "d"), _step(11.3, 120, 3, 0, "a")]
    result = scenarios._admission(_record(tmp_path, lines), added=10.0)
    assert result["pause_s"] == pytest.approx(0.4)
    assert result["joiner_after_initialized_s"] == pytest.approx(0.2)
    assert result["joiner_after_process_start_s"] == pytest.approx(1.1)


def test_admission_takes_the_joiners_latest_start_in_a_restart(tmp_path):
    # Restart mode: every worker restarts; a start of rank 2 in a world-3 round that failed comes
    # first, then d's own, at rank 2 again.
    lines = [_step(9.5, 50, 2, 0, "a"), _start(12.0, 3, 2, 11.0), _start(15.0, 3, 2, 14.0),
             _start(15.1, 3, 0, 14.1), _step(15.5, 40, 3, 2, "d"), _step(15.6, 40, 3, 0, "a")]
    result = scenarios._admission(_record(tmp_path, lines), added=10.0)
    assert result["pause_s"] == pytest.approx(15.6 - 9.5)
    assert result["joiner_after_initialized_s"] == pytest.approx(0.5)
    assert result["joiner_after_process_start_s"] == pytest.approx(1.5)


def test_redone_steps_count_from_the_last_step_before_the_resumption(tmp_path):
    # Hot mode: after the SIGKILL at 10.0 the survivors still finish step 11 at world 3, so
    # world 2 starts at step 12: nothing re-done (counting from the event would say -1).
    lines = [_step(9.9, 10, 3, 0, "a"), _step(9.9, 10, 3, 1, "b"), _step(10.1, 11, 3, 0, "a"),
             _step(10.1, 11, 3, 1, "b"), _step(10.8, 12, 2, 0, "a"), _step(10.8, 12, 2, 1, "b")]
    cluster = _record(tmp_path, lines)
    cluster.wait_world = lambda *args, **kwargs: Cluster.wait_world(cluster, *args, **kwargs)
    result = scenarios._recovery(cluster, 10.0, 2, {"a", "b"}, cap=5)
    assert result["seconds"] == pytest.approx(0.8)
    assert result["redone_steps"] == 0


def _results(hot_crash: float, pause: float) -> dict:
    def lifecycle(crash: float, pause_s: float) -> dict:
        return {"cold_start_s": 15.0, "crash": {"seconds": crash, "cap_s": 60, "redone_steps": 1},
                "freeze": {"seconds": 6.0, "cap_s": 60, "redone_steps": 0},
                "scale_up": {"seconds": 3.0, "cap_s": 60, "pause_s": pause_s, "joiner_after_initialized_s": 0.3,
                             "joiner_after_process_start_s": 2.5}}
    return {"settings": {"checkpoint_every": 20, "node_ttl_s": 5},
            "scenarios": {"lifecycle": {"elasticctl": [lifecycle(10.0, 12.0)], "elasticctl-hot": [lifecycle(hot_crash, pause)],
                                        "torchrun": [lifecycle(20.0, 15.0)]},
                          "steady": {"elasticctl": [{"steps_per_s": 100.0}], "elasticctl-hot": [{"steps_per_s": 99.0}],
                                     "torchrun": [{"steps_per_s": 90.0}]}}}


def test_report_puts_hot_mode_between_restart_mode_and_torchrun_with_both_ratios():
    rows = {row[0]: row[1:] for row in report.rows(_results(hot_crash=1.0, pause=0.5))}
    crash = rows["Crash: SIGKILL node c → first step at world 2 (s)"]
    assert crash[:3] == ("10.0 (10.0–10.0, n=1)", "1.0 (1.0–1.0, n=1)", "20.0 (20.0–20.0, n=1)")
    assert crash[3:] == ("0.05", "0.10")  # hot/torchrun, hot/restart
    assert any(label.startswith("Scale-up: running workers' pause") for label in rows)


def test_hot_targets_say_met_or_missed_with_the_measured_value():
    met = report.hot_targets(_results(hot_crash=0.2, pause=0.5))
    assert met.startswith("Targets, elasticctl hot mode: ")
    assert "SIGKILL → world 2 ≤ 0.3 s: 0.20 s (met)" in met
    assert "node TTL 5 s + 0.5) ≤ 5.5 s: 6.00 s (missed)" in met
    assert "at most 1 over 2 failures (met)" in met
    assert "0.990 × (99.0 vs 100.0 steps/s) (met)" in met
    assert "with one spare, SIGKILL → world 3 ≤ 1 s: not measured in this run" in met
    missed = report.hot_targets(_results(hot_crash=2.0, pause=1.5))
    assert "SIGKILL → world 2 ≤ 0.3 s: 2.00 s (missed)" in missed
    assert "pause for a joiner ≤ 1 s: 1.50 s (missed)" in missed


def test_a_scenario_that_never_ran_has_no_ratio_and_a_scale_up_that_never_completed_is_capped():
    results = _results(hot_crash=1.0, pause=0.5)
    torchrun = results["scenarios"]["lifecycle"]["torchrun"][0]
    del torchrun["freeze"]  # the job stopped at the scale-up: the freeze never ran
    torchrun["scale_up"] = {"seconds": None, "cap_s": 60, "pause_s": None, "joiner_after_initialized_s": None,
                            "joiner_after_process_start_s": None}
    rows = {row[0]: row[1:] for row in report.rows(results)}
    assert rows["Freeze: SIGSTOP node b → first step at world 2 (s)"][2:4] == ("not measured", "—")
    pause = next(v for k, v in rows.items() if k.startswith("Scale-up: running workers' pause"))
    assert pause[2:4] == ("none within 60 s (1/1)", "< 0.0083")


def test_report_reads_results_from_before_hot_mode():
    old = _results(hot_crash=1.0, pause=0.5)
    for runs in old["scenarios"].values():
        del runs["elasticctl-hot"]
    for run in old["scenarios"]["lifecycle"]["elasticctl"] + old["scenarios"]["lifecycle"]["torchrun"]:
        for key in ("pause_s", "joiner_after_initialized_s", "joiner_after_process_start_s"):
            del run["scale_up"][key]
    rows = {row[0]: row[1:] for row in report.rows(old)}
    assert rows["Crash: SIGKILL node c → first step at world 2 (s)"][1] == "not measured"
    pause = next(v for k, v in rows.items() if k.startswith("Scale-up: running workers' pause"))
    assert pause[:3] == ("not measured",) * 3


def test_recovery_phases_are_reported_as_medians_of_each_phase_end():
    def run(crash_phases):
        return {"crash": {"seconds": 0.6, "phases": crash_phases}, "freeze": {"seconds": 5.1}}

    results = {"scenarios": {"lifecycle": {report.HOT: [
        run({"fault_seen": 0.05, "torn_down": 0.06, "sealed": 0.55, "first_step": 0.6}),
        run({"fault_seen": 0.07, "torn_down": 0.08, "sealed": 0.59, "first_step": 0.7}),
        run({"fault_seen": 0.06, "torn_down": 0.07, "sealed": 0.57, "first_step": 0.65}),
    ]}}}
    lines = report.recovery_phase_section(results)
    assert "| phase ended | SIGKILL node c (s after the signal) |" in lines  # no freeze column: none recorded
    assert "| fault seen | 0.060 |" in lines and "| generation sealed | 0.570 |" in lines
    assert not [line for line in lines if line.startswith("| group built")]  # a phase no run recorded
    assert report.recovery_phase_section({"scenarios": {"lifecycle": {report.HOT: [{"crash": {}}]}}}) == []


def test_the_hsdp_rounds_phases_are_a_column_per_event_with_a_dash_where_one_skipped_a_phase():
    rounds = [{"kill": {"phases": {"fault_seen": 0.2, "rewrapped": 0.5, "first_step": 0.9}},
               "join": {"phases": {"fault_seen": 8.0, "rewrapped": 8.4, "state_synced": 8.6, "first_step": 9.0}}},
              {"kill": {"phases": {"fault_seen": 0.4, "rewrapped": 0.7, "first_step": 1.1}}, "join": {"seconds": None}}]
    lines = report.hsdp_phase_section({"scenarios": {"hsdp": rounds}})
    assert "| phase ended | SIGKILL a node | a node joins |" in lines
    assert "| fault seen | 0.300 | 8.000 |" in lines and "| model re-wrapped | 0.600 | 8.400 |" in lines
    assert "| state synced | – | 8.600 |" in lines
    assert report.hsdp_phase_section({"scenarios": {"hsdp": [{"error": "no world 6"}]}}) == []


def test_the_straggler_section_reports_its_rows_and_targets():
    from bench import stragglers

    settings = {"system": "elasticctl-hot", "slowed_node": "c", "slow_from_step": 80, "slow_s": 0.2,
                "window": 20, "interval": 5, "evict": 3.0, "rate_steps": 30}
    results = {"scenarios": {"straggler": {
        "settings": settings,
        "named": {"outcome": "named", "steps_to_named": 24, "ratio": 4.1, "healthy_steps_per_s": 15.2,
                  "slowed_steps_per_s": 3.6},
        "evicted": {"outcome": "evicted", "healthy_steps_per_s": 15.0, "after_eviction_steps_per_s": 14.4,
                    "ratio_to_healthy": 0.96, "evicted_at_step": 105, "world2_after_s": 0.4}}}}
    section = "\n".join(stragglers.section(results))
    assert "| steps from the slow-down (step 80) to the `straggler` event naming node c (W = 20, K = 5) | 24 " in section
    assert "| slowed steps/s, node c +0.2 s per step, no eviction | 3.6 |" in section
    assert "14.4 (0.96×)" in section
    assert stragglers.targets(results) == (
        "Targets, straggler: named within W steps (W = 20, exchanged every K = 5: ≤ 25): 24 (met); "
        "with eviction on, steps/s ≥ 0.9 × healthy: 0.96 × (met).")
    missed = {"scenarios": {"straggler": {"settings": settings, "named": {"outcome": "not named within 60 s"},
                                          "evicted": {"ratio_to_healthy": 0.5}}}}
    assert "not measured" in stragglers.targets(missed) and "0.50 × (missed)" in stragglers.targets(missed)
    assert "not named within 60 s" in "\n".join(stragglers.section(missed))
    assert stragglers.section({"scenarios": {}}) == [] and stragglers.text_lines({"scenarios": {}}) == []


def _transfer_entry(state_mb: int, new_mbps: float, raw_mbps: float, sender_delta: int) -> dict:
    method = {"median_s": 1.0, "sender_rss_delta_max": sender_delta, "joiner_rss_delta_max": 0, "repeats": 1}
    return {"state_mb": state_mb, "state_bytes": state_mb * 2**20, "procs": 3, "bucket_bytes": 64 * 2**20,
            "identical": True, "new": {**method, "bytes_per_s": new_mbps * 1e6},
            "raw": {**method, "bytes_per_s": raw_mbps * 1e6, "sender_rss_delta_max": 4096}}


def test_state_transfer_targets_at_512_mb_and_2_gb_and_the_senders_memory():
    results = {"scenarios": {"state_transfer": [_transfer_entry(512, 900, 1000, 2 * 2**20),
                                                _transfer_entry(2048, 600, 1000, 3 * 2**20)]}}
    line = report.state_transfer_targets(results)
    assert line.startswith("Targets, state transfer ≥ 0.7 × the raw gloo broadcast: ")
    assert "at 512 MB: 0.90 × (900 vs 1000 MB/s) (met)" in line
    assert "at 2 GB: 0.60 × (600 vs 1000 MB/s) (missed)" in line
    assert "at most 3.0 MiB over before (at 2048 MB; bucket 64 MiB) (met)" in line
    results["scenarios"]["state_transfer"] = [_transfer_entry(64, 900, 1000, 100 * 2**20)]
    line = report.state_transfer_targets(results)
    assert "at 512 MB: not measured in this run" in line and "at 2 GB: not measured in this run" in line
    assert "(at 64 MB; bucket 64 MiB) (missed)" in line  # a sender that held more than one bucket


def _sharded_results(join: dict) -> dict:
    kill = {"seconds": 1.5, "cap_s": 60, "outcome": "recovered", "redone_steps": 0, "survivors_restarted": 0,
            "replicas_identical": True}
    fsdp = {"elasticctl-hot": [{"seconds": 3.0, "cap_s": 60, "redone_steps": 4, "survivors_restarted": 0,
                                "restored_sources": ["checkpoint"]}],
            "elasticctl": [{"seconds": 9.0, "cap_s": 60, "redone_steps": 4, "survivors_restarted": 2,
                            "restored_sources": []}]}
    return {"scenarios": {"hsdp": [{"kill": kill, "join": join}], "fsdp": fsdp,
                          "fsdp_peer_copies": {"outcome": "not available", "reason": "no function"},
                          "chaos_hsdp": {"outcome": "passed", "events_planned": 2, "quick": True,
                                         "kinds": ["kill", "join"], "steps": 300, "redone": 0, "worker_restarts": 0,
                                         "events": [{"kind": "kill"}, {"kind": "join"}]}}}


def test_sharded_rows_and_targets_name_each_sharded_target():
    joined = {"seconds": 12.0, "cap_s": 60, "outcome": "joined", "pause_s": 0.5, "transfer_s": 0.1,
              "transfer_bytes": 2**20, "sources": [[0, "replica"], [1, "replica"]], "replicas_identical": True}
    results = _sharded_results(joined)
    rows = {label: (value, target) for label, value, target in report.sharded_rows(results)}
    assert rows["HSDP 3 × 2: SIGKILL a node → first step at world 4 (s)"] == ("1.50 (1.50–1.50, n=1)", "≤ 2 s")
    assert rows["HSDP: shards' digests identical across replicas before every step"][0] == "yes (2 of 2)"
    assert rows["FSDP2 with peer copies: SIGKILL a node → first step (s)"][0] == "not available"
    assert "1.00 MiB from shard 0: replica, shard 1: replica" in rows[
        "HSDP: the joiner's shards' transfer (s; bytes, sources)"][0]
    line = report.sharded_targets(results)
    assert line.startswith("Targets, sharded models: HSDP SIGKILL → first step ≤ 2 s: 1.50 s (met)")
    assert "nothing re-done: at most 0 (met)" in line
    assert "pause − transfer at most 0.40 s (missed)" in line
    assert "FSDP2 with peer copies ≤ 3 s and ≤ 10 steps re-done: not available" in line
    assert "3.00 s vs restart mode 9.00 s, 0 survivor process(es) restarted (met)" in line
    assert "chaos soak of the HSDP trainer, 2 events: passed (met)" in line
    section = report.sharded_section(results)
    assert "| measurement | this run | target |" in section and "2 events (a shorter soak than the target's 20 events)" in section[2]


def test_a_failed_join_is_reported_with_its_reason():
    failed = {"seconds": None, "cap_s": 60, "outcome": "failed: no step at world 6 within 60 s (RuntimeError: x)"}
    results = _sharded_results(failed)
    rows = {label: value for label, value, _ in report.sharded_rows(results)}
    assert rows["HSDP: a node joins: the running workers' pause (s)"] == (
        "1 of 1 failed: no step at world 6 within 60 s (RuntimeError: x)")
    assert "HSDP: the joiner's shards' transfer (s; bytes, sources)" not in rows
    assert ("a joining node's pause ≤ its shards' transfer + 0.3 s: no join completed "
            "(failed: no step at world 6 within 60 s (RuntimeError: x)) (missed)") in report.sharded_targets(results)


def test_bench_run_has_the_sharded_sections():
    from bench import run

    assert {"hsdp", "fsdp", "fsdp_peer_copies", "chaos_hsdp", "state_transfer"} <= set(run.ALL)
    assert run.PLANS["quick"].state_transfer_mb == run.PLANS["full"].state_transfer_mb == (64, 512, 2048)


def test_peer_copies_meet_their_target_only_without_a_disk_read_or_a_restart():
    results = _sharded_results({"seconds": None, "cap_s": 60, "outcome": "failed: x"})
    sample = {"seconds": 1.2, "cap_s": 60, "redone_steps": 7, "survivors_restarted": 0,
              "restored_sources": ["peer_copy"], "resumed_from_checkpoint": False}
    results["scenarios"]["fsdp_peer_copies"] = {"samples": [sample]}
    assert "FSDP2 with peer copies ≤ 3 s and ≤ 10 steps re-done: 1.20 s, at most 7 re-done (met)" in (
        report.sharded_targets(results))
    results["scenarios"]["fsdp_peer_copies"] = {"samples": [{**sample, "resumed_from_checkpoint": True}]}
    assert "1.20 s, at most 7 re-done, from disk (missed)" in report.sharded_targets(results)


def test_a_spare_recovery_is_timed_to_the_spares_first_step_not_a_survivors_step_in_flight(tmp_path):
    # Restart mode: node c SIGKILLed at 10.0 while d waits as a spare; a's step in flight (at world 3,
    # with c) lands at 10.0001; the restarted world of a, b and d trains from 15.2.
    lines = [_step(9.9, 58, 3, 0, "a"), _step(9.9, 58, 3, 1, "b"), _step(9.9, 58, 3, 2, "c"),
             _step(10.0001, 59, 3, 0, "a"), _step(15.2, 40, 3, 0, "a"), _step(15.2, 40, 3, 1, "b"),
             _step(15.3, 40, 3, 2, "d")]
    cluster = _record(tmp_path, lines)
    cluster.wait_world = lambda *args, **kwargs: Cluster.wait_world(cluster, *args, **kwargs)
    result = scenarios._recovery(cluster, 10.0, 3, {"a", "b", "d"}, cap=5)
    assert result["seconds"] == pytest.approx(5.3)
    assert result["redone_steps"] == 59 + 1 - 40
