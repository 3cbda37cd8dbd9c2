"""The benchmark's HSDP freeze (bench/hsdp_recovery.py, bench/report.py, bench/run.py) on made-up
records: the interval from the SIGSTOP to the survivors' first step at world 4, the thaw back to
world 6 (a thawed node's line of its old generation is no sign of it), the sample check, the
target's verdict and the rows of BENCHMARKS.md; the whole freeze against a fake job whose
"signals" append what a real one would record.

Layer tests/unit: no etcd, no processes.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import hsdp_recovery, report, run
from bench.cluster import Record

PER_RANK = 8  # samples per worker and step
PIDS = {"a": (11, 12), "b": (21, 22), "c": (31, 32)}


def step_lines(step: int, generation: int, nodes: tuple[str, ...], start: int, t: float) -> list[dict]:
    """One step of an HSDP job as trainers/lm.py --record-params writes it: a line per worker, 2 workers a node."""
    world = 2 * len(nodes)
    return [{"step": step, "generation": generation, "epoch": 0, "world_size": world, "rank": 2 * index + local,
             "node": node, "pid": pid, "shard": local, "params": f"p{step}-{local}",
             "consumed": start + PER_RANK * world, "indices": list(range(PER_RANK)), "time": t}
            for index, node in enumerate(nodes) for local, pid in enumerate(PIDS[node])]


def trained(first: int, count: int, generation: int, nodes: tuple[str, ...], start: int, t0: float,
            dt: float = 0.1) -> tuple[list[dict], int]:
    """``count`` steps from step ``first`` at position ``start``: the lines and the position after."""
    lines = []
    for i in range(count):
        lines += step_lines(first + i, generation, nodes, start, t0 + i * dt)
        start += PER_RANK * 2 * len(nodes)
    return lines, start


def before_the_freeze(t0: float) -> tuple[list[dict], int]:
    """Steps 0..8 at world 6, then step 9 recorded by a and c only: node b was frozen before its line;
    the position step 9 starts at (where the survivors re-do it)."""
    lines, position = trained(0, 9, 3, ("a", "b", "c"), 0, t0)
    return lines + [r for r in step_lines(9, 3, ("a", "b", "c"), position, t0 + 0.9) if r["node"] != "b"], position


def b_late_line(t: float) -> list[dict]:
    """Node b's line of step 9 in its old generation, written once thawed."""
    return [r for r in step_lines(9, 3, ("a", "b", "c"), 9 * 48, t) if r["node"] == "b"]


# -- the interval from the signal to the first step at the smaller world -----------------------

@pytest.mark.parametrize("lines, event, world, nodes, after_generation, expected", [
    # both workers of a and c at world 4 after the SIGSTOP at 10.0: from the first of them
    (step_lines(9, 4, ("a", "c"), 0, 10.8) + step_lines(10, 4, ("a", "c"), 32, 10.9), 10.0, 4, {"a", "c"}, -1, 0.8),
    # only c's first worker trained at world 4 so far: not yet
    ([r for r in step_lines(9, 4, ("a", "c"), 0, 10.8) if r["pid"] != 32], 10.0, 4, {"a", "c"}, -1, None),
    # world 4 of the cold start, before the signal, does not count
    (step_lines(3, 2, ("a", "c"), 0, 5.0), 10.0, 4, {"a", "c"}, -1, None),
    # the frozen node's line at the old world after the signal is not the smaller world
    (step_lines(9, 3, ("a", "b", "c"), 0, 10.2) + step_lines(9, 4, ("a", "c"), 0, 11.5), 10.0, 4, {"a", "c"}, -1, 1.5),
    # after the SIGCONT at 20.0: the thawed node's line of generation 3 at world 6 is no sign of the new world
    (b_late_line(20.1) + step_lines(14, 5, ("a", "c", "b"), 0, 22.0), 20.0, 6, {"a", "b", "c"}, 4, 2.0),
    # ... which would count without the generation
    (b_late_line(20.1) + step_lines(14, 5, ("a", "c", "b"), 0, 22.0), 20.0, 6, {"a", "b", "c"}, -1, 0.1),
    # the thawed node not back yet: a and c alone at world 6 are not enough
    (step_lines(14, 5, ("a", "c"), 0, 22.0), 20.0, 6, {"a", "b", "c"}, 4, None),
])
def test_seconds_from_the_signal_to_the_first_step_at_the_new_world(lines, event, world, nodes, after_generation,
                                                                     expected):
    seconds = hsdp_recovery.seconds_to_world(lines, event, world, nodes, after_generation)
    assert seconds == (pytest.approx(expected) if expected is not None else None)


@pytest.mark.parametrize("lines, expected", [
    ([], -1),
    (step_lines(0, 2, ("a",), 0, 1.0) + step_lines(1, 4, ("a", "b"), 16, 2.0), 4),
    ([{"step": 0, "world_size": 1, "time": 1.0}], -1),  # a record without --record-params
])
def test_the_newest_generation(lines, expected):
    assert hsdp_recovery.newest_generation(lines) == expected


# -- samples lost or trained twice ---------------------------------------------------------------

def _frozen_record() -> list[dict]:
    """Node b frozen in step 9: a and c re-do it at world 4 and go on."""
    before, position = before_the_freeze(1.0)
    return before + trained(9, 5, 4, ("a", "c"), position, 10.0)[0]


@pytest.mark.parametrize("lines, expected", [
    (_frozen_record(), {"samples_ok": True, "steps_counted": 14, "steps_redone": 1}),
    # a thawed node's late line of its old generation: the later generation's stays in the lineage
    (_frozen_record() + b_late_line(20.0), {"samples_ok": True, "steps_counted": 14, "steps_redone": 1}),
    # world 4 went on past where world 6 ended: 32 samples never trained
    (trained(0, 10, 3, ("a", "b", "c"), 0, 1.0)[0] + trained(10, 3, 4, ("a", "c"), 10 * 48 + 32, 10.0)[0],
     {"samples_ok": False, "samples_check": "epoch 0: step 9 ends at position 480, step 10 starts at 512"}),
    # a step missing from the record
    ([r for r in _frozen_record() if r["step"] != 5],
     {"samples_ok": False, "samples_check": "step numbers missing from the record: [5]"}),
])
def test_sample_accounting(lines, expected):
    assert hsdp_recovery.sample_accounting(lines, dataset_size=2048) == expected


# -- the whole freeze against a fake job ------------------------------------------------------

class FakeJob:
    """Node b's "signals" append to the record what the job would: at the SIGSTOP, a and c re-do
    step 9 at world 4 (and rank 0's timeline); at the SIGCONT, b's line of its old generation,
    then all three at world 6 with b's shards from replicas."""

    def __init__(self, workdir: Path, survivors_reform: bool = True) -> None:
        self.path = workdir / "record.jsonl"
        self.survivors_reform = survivors_reform
        self.now = 1000.0  # the job's own clock: each signal moves it on, whatever the machine's speed
        lines, self.position = before_the_freeze(self.now - 5)
        self._write(lines)
        self.cluster = SimpleNamespace(record=Record(self.path), closed=False, clock=lambda: self.now,
                                       nodes={name: FakeNode(name, self, workdir) for name in ("a", "b", "c")})
        self.cluster.close = lambda: setattr(self.cluster, "closed", True)

    def _write(self, lines: list[dict]) -> None:
        with open(self.path, "a") as file:
            file.write("".join(json.dumps(line) + "\n" for line in lines))

    def react(self, name: str, sig: int) -> None:
        now = self.now
        self.now += 2.0  # what the job records happens within the 2 s before the bench's next "now"
        if sig == signal.SIGSTOP and self.survivors_reform:
            lines, self.position = trained(9, 5, 4, ("a", "c"), self.position, now + 0.2)
            self._write([*lines, {"event": "recovery_timeline", "rank": 0, "world_size": 4, "time": now + 0.2,
                                  "noticed": now + 0.1, "first_step": 0.1}])
        elif sig == signal.SIGCONT:
            stale = b_late_line(now + 0.05)
            restored = [{"event": "state_restored", "pid": pid, "shard": shard, "source": "replica", "seconds": 0.05,
                         "nbytes": 1000, "time": now + 0.4} for shard, pid in enumerate(PIDS[name])]
            lines, self.position = trained(14, 4, 5, ("a", "c", "b"), self.position, now + 0.5)
            self._write([*stale, *restored, *lines, {"event": "recovery_timeline", "rank": 0, "world_size": 6,
                                                     "time": now + 0.5, "noticed": now + 0.3, "first_step": 0.2}])


class FakeNode:
    def __init__(self, name: str, job: FakeJob, workdir: Path) -> None:
        self.name, self.job, self.signals = name, job, []
        self.log_path = workdir / f"{name}.log"
        self.process = SimpleNamespace(poll=lambda: None)

    def signal_tree(self, sig: int) -> None:
        self.signals.append(sig)
        self.job.react(self.name, sig)

    def stop(self) -> None:
        raise AssertionError("a frozen node is not forgotten: the job's close() stops it")


def test_a_freeze_times_world_4_then_the_thaw_back_to_world_6_and_checks_the_samples(tmp_path):
    job = FakeJob(tmp_path)
    result = hsdp_recovery.freeze_node(job.cluster, "b", cap=5)
    assert job.cluster.nodes["b"].signals == [signal.SIGSTOP, signal.SIGCONT]
    assert set(job.cluster.nodes) == {"a", "b", "c"}  # still there, for close() to stop
    freeze, thaw = result["freeze"], result["thaw"]
    assert result["node"] == "b" and result["node_ttl_s"] == hsdp_recovery.NODE_TTL
    assert freeze["outcome"] == "recovered" and 0.2 <= freeze["seconds"] < 1.0
    assert (freeze["redone_steps"], freeze["survivors_restarted"], freeze["replicas_identical"]) == (1, 0, True)
    assert freeze["phases"]["fault_seen"] >= 0.1
    assert thaw["outcome"] == "joined" and 0.5 <= thaw["seconds"] < 1.5  # not b's old line at +0.05 s
    assert (thaw["thawed_restarted"], thaw["transfer_s"], thaw["replicas_identical"]) == (0, 0.05, True)
    assert thaw["sources"] == [(0, "replica"), (1, "replica")] and thaw["pause_s"] > 0
    assert result["samples"] == {"samples_ok": True, "steps_counted": 18, "steps_redone": 1}


def test_a_freeze_the_survivors_never_recover_from_is_capped_and_not_thawed_here(tmp_path):
    job = FakeJob(tmp_path, survivors_reform=False)
    result = hsdp_recovery.freeze_node(job.cluster, "b", cap=0.3)
    assert result["freeze"] == {"seconds": None, "cap_s": 0.3, "outcome": "none within 0.3 s"}
    assert "thaw" not in result and job.cluster.nodes["b"].signals == [signal.SIGSTOP]  # close() thaws it
    assert result["samples"]["samples_ok"]


def test_each_freeze_job_is_closed_and_a_broken_one_is_an_error_not_the_end_of_the_run(tmp_path, monkeypatch):
    jobs, started = [], []

    def start_hsdp(workdir, etcd, cap, lm_args=()):
        started.append((workdir.name, lm_args))
        if len(started) == 2:
            raise hsdp_recovery.ScenarioFailed("the job did not reach world 6 within 5 s")
        workdir.mkdir()
        jobs.append(FakeJob(workdir))
        if len(started) == 3:
            jobs[-1].cluster.record = None  # the measurement breaks on it
        return jobs[-1].cluster

    monkeypatch.setattr(hsdp_recovery, "start_hsdp", start_hsdp)
    lines = []
    results = hsdp_recovery.hsdp_freezes(tmp_path, None, 3, cap=5, report=lines.append)
    assert [name for name, _ in started] == ["hsdp-freeze-1", "hsdp-freeze-2", "hsdp-freeze-3"]
    assert started[0][1] == ("--dataset-size", str(hsdp_recovery.FREEZE_DATASET_SIZE))
    assert results[0]["thaw"]["outcome"] == "joined"
    assert results[1] == {"error": "the job did not reach world 6 within 5 s"}
    assert results[2]["error"].startswith("AttributeError")
    assert all(job.cluster.closed for job in jobs) and len(lines) == 3


# -- bench.run ---------------------------------------------------------------------------------

def test_bench_run_selects_the_freeze_with_only_hsdp_freeze_once_in_quick(tmp_path, monkeypatch):
    assert "hsdp_freeze" in run.SHARDED_SCENARIOS and "hsdp_freeze" in run.ALL
    assert run.PLANS["quick"].hsdp_freezes == 1
    calls = []
    monkeypatch.setattr(hsdp_recovery, "hsdp_freezes",
                        lambda root, etcd, repeats, cap, report: calls.append((root, repeats, cap)) or [{"x": 1}])
    plan = run.PLANS["quick"]
    assert run.run_sharded(["hsdp_freeze"], plan, tmp_path, None) == {"hsdp_freeze": [{"x": 1}]}
    assert calls == [(tmp_path, 1, plan.caps.recover)]


# -- the report --------------------------------------------------------------------------------

@pytest.mark.parametrize("seconds, ttl, expected", [
    (3.8, 3, "3.80 s (met)"),
    (4.0, 3, "4.00 s (met)"),  # the target is inclusive
    (4.2, 3, "4.20 s (missed)"),
    (2.9, 2, "2.90 s (met)"),
    (None, 3, "no value (missed)"),  # the survivors never trained at world 4 within the cap
])
def test_the_freeze_target_is_the_node_ttl_plus_one_second(seconds, ttl, expected):
    assert report.freeze_target_s(ttl) == ttl + 1
    assert report.seconds_verdict(seconds, report.freeze_target_s(ttl)) == expected


def _freeze(seconds=3.6, survivors_restarted=0, thaw=True, samples=None) -> dict:
    run_ = {"node": "b", "node_ttl_s": 3,
            "freeze": {"seconds": seconds, "cap_s": 60, "outcome": "recovered" if seconds else "none within 60 s",
                       "redone_steps": 1, "survivors_restarted": survivors_restarted, "replicas_identical": True,
                       "phases": {"fault_seen": 3.1, "first_step": 3.6}},
            "samples": samples or {"samples_ok": True, "steps_counted": 300, "steps_redone": 1}}
    if thaw is True:
        run_["thaw"] = {"seconds": 6.5, "cap_s": 60, "outcome": "joined", "pause_s": 0.8, "thawed_restarted": 0,
                        "replicas_identical": True, "phases": {"fault_seen": 5.0, "first_step": 6.5}}
    elif thaw:
        run_["thaw"] = thaw
    return run_


@pytest.mark.parametrize("runs, rows, targets", [
    ([_freeze()],
     {"HSDP 3 × 2: SIGSTOP a node's whole tree → first step at world 4 (s)": ("3.60 (3.60–3.60, n=1)",
                                                                              "≤ node TTL + 1 s (4 s)"),
      "HSDP freeze: survivors' worker processes kept (same pids)": ("yes (1 of 1)", "yes"),
      "HSDP freeze: steps re-done after the SIGSTOP": ("at most 1", "≤ 1 (the step in flight)"),
      "HSDP freeze: samples lost or trained twice (the job's lineage)": ("none (1 of 1; 300 steps, 1 re-done in all)",
                                                                         "none"),
      "HSDP freeze: shards' digests identical across replicas before every step": ("yes (2 of 2)", "identical"),
      "HSDP freeze: SIGCONT → the node back, every worker at world 6 (s)": (
          "6.50 (6.50–6.50, n=1); the thawed node's workers kept their processes", "back at world 6, as a newcomer")},
     ["HSDP SIGSTOP → first step ≤ node TTL + 1 s (4 s): 3.60 s (met)",
      "survivors kept their processes: yes (1 of 1) (met)",
      "no sample lost or trained twice: none (1 of 1; 300 steps, 1 re-done in all) (met)",
      "the frozen node back at world 6 after SIGCONT: 1 of 1 (met)"]),
    ([_freeze(seconds=5.2, survivors_restarted=2,
              thaw={"seconds": None, "cap_s": 60, "running_restarted": 1,
                    "outcome": "failed: 1 of the running workers restarted (world 6 after 9.0 s)"},
              samples={"samples_ok": False, "samples_check": "step numbers missing from the record: [5]"})],
     {"HSDP 3 × 2: SIGSTOP a node's whole tree → first step at world 4 (s)": ("5.20 (5.20–5.20, n=1)",
                                                                              "≤ node TTL + 1 s (4 s)"),
      "HSDP freeze: survivors' worker processes kept (same pids)": ("no: 2 restarted at the freeze, 1 at the thaw",
                                                                    "yes"),
      "HSDP freeze: samples lost or trained twice (the job's lineage)": (
          "yes (1 of 1): step numbers missing from the record: [5]", "none"),
      "HSDP freeze: SIGCONT → the node back, every worker at world 6 (s)": (
          "failed (1/1) (failed: 1 of the running workers restarted (world 6 after 9.0 s))",
          "back at world 6, as a newcomer")},
     ["HSDP SIGSTOP → first step ≤ node TTL + 1 s (4 s): 5.20 s (missed)",
      "survivors kept their processes: no: 2 restarted at the freeze, 1 at the thaw (missed)",
      "no sample lost or trained twice: yes (1 of 1): step numbers missing from the record: [5] (missed)",
      "the frozen node back at world 6 after SIGCONT: 0 of 1 (missed)"]),
    ([_freeze(seconds=None, thaw=False), {"error": "the job did not reach world 6 within 60 s"}],
     {"HSDP 3 × 2: SIGSTOP a node's whole tree → first step at world 4 (s)": (
         "none within 60 s (1/1) (none within 60 s; failed: the job did not reach world 6 within 60 s)",
         "≤ node TTL + 1 s (4 s)")},
     ["HSDP SIGSTOP → first step ≤ node TTL + 1 s (4 s): no value (missed)",
      "the frozen node back at world 6 after SIGCONT: 0 of 1 (missed)"]),
    ([{"error": "the job did not reach world 6 within 60 s"}],
     {"HSDP 3 × 2: SIGSTOP a node's whole tree → first step at world 4 (s)": (
         "failed: the job did not reach world 6 within 60 s", "≤ node TTL + 1 s"),
      "HSDP freeze: survivors' worker processes kept (same pids)": ("not measured", "yes"),
      "HSDP freeze: samples lost or trained twice (the job's lineage)": ("not measured", "none")},
     ["HSDP SIGSTOP → first step ≤ node TTL + 1 s: no value (missed)", "survivors kept their processes: not measured",
      "no sample lost or trained twice: not measured"]),
])
def test_the_freeze_rows_and_targets(runs, rows, targets):
    results = {"scenarios": {"hsdp_freeze": runs}}
    got = {label: (value, target) for label, value, target in report.sharded_rows(results)}
    for label, expected in rows.items():
        assert got[label] == expected, label
    line = report.sharded_targets(results)
    for part in targets:
        assert part in line, part
    if runs[0].get("thaw") is None:
        assert "HSDP freeze: SIGCONT → the node back, every worker at world 6 (s)" not in got


def test_the_freeze_is_in_the_sharded_section_with_its_phases_and_not_measured_without_it():
    results = {"scenarios": {"hsdp_freeze": [_freeze()]}}
    section = "\n".join(report.sharded_section(results))
    assert "| HSDP 3 × 2: SIGSTOP a node's whole tree → first step at world 4 (s) | 3.60 (3.60–3.60, n=1) | " \
           "≤ node TTL + 1 s (4 s) |" in section
    assert "HSDP freeze: the same job" in section
    phases = report.hsdp_phase_section(results)
    assert "| phase ended | SIGSTOP a node | the frozen node SIGCONTed |" in phases
    assert "| fault seen | 3.100 | 5.000 |" in phases
    assert "HSDP SIGSTOP → first step ≤ node TTL + 1 s: not measured in this run" in report.sharded_targets(
        {"scenarios": {"hsdp": []}})
