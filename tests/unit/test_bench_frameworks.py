"""bench/frameworks.py's reading of its rows: medians of the runs that got there, failures counted.

Layer tests/unit. The bench itself runs real jobs (`python -m bench.run --only frameworks`)."""

from __future__ import annotations

from bench import frameworks


def row(system, seconds, cold=20.0, lost=3, error=None):
    return {"system": system, "kill_to_step_s": seconds, "cold_start_s": cold, "steps_lost": lost, "error": error}


def test_the_summary_takes_medians_of_complete_runs_and_counts_the_failed_ones():
    rows = [row("lightning", 9.0), row("bundled", 6.0, lost=5), row("lightning", 11.0, cold=22.0),
            row("bundled", None, error="no step at world 1 within 240 s of the kill"), row("lightning", 10.0, lost=4)]
    assert frameworks.summary_rows(rows) == [
        ("lightning", "3 of 3", "10.00 (9.00–11.00)", "20.00", "3"),
        ("bundled", "1 of 2", "6.00 (6.00–6.00)", "20.00", "5"),
    ]


def test_a_system_with_no_complete_run_shows_dashes_and_results_without_the_bench_show_nothing():
    assert frameworks.summary_rows([row("lightning", None, error="x")]) == [("lightning", "0 of 1", "—", "—", "—")]
    assert frameworks.section({"scenarios": {}}) == [] and frameworks.text_lines({"scenarios": {}}) == []


def test_the_section_is_a_table_with_a_row_per_system():
    lines = frameworks.section({"scenarios": {"frameworks": [row("lightning", 9.0), row("bundled", 6.0)]}})
    table = [line for line in lines if line.startswith("| ")]
    assert len(table) == 3 and table[1].startswith("| lightning | 1 of 1 | 9.00")


def test_the_hot_systems_run_under_recovery_hot_and_the_others_restart(tmp_path):
    for system in frameworks.SYSTEMS:
        script, env = frameworks.script_of(system, tmp_path / "record.jsonl")
        assert (script[:2] == ["--recovery", "hot"]) == system.endswith("-hot"), system
        path = script[2] if system.endswith("-hot") else script[0]
        assert (frameworks.REPO / path).is_file(), path  # an example the guide shows, or the bundled trainer
    assert set(frameworks.available()) <= set(frameworks.SYSTEMS) and "bundled" in frameworks.available()
