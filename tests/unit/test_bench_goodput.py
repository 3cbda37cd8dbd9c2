"""The goodput benchmark's arithmetic (bench/goodput.py) and its report rows, on synthetic records.

Layer tests/unit: no etcd, no processes. The jobs themselves run in `python -m bench.run --only goodput`.
"""

from __future__ import annotations

import pytest

from bench import goodput, report
from bench.goodput import KILL, START, Action


def _line(t: float, step: int, world: int = 3, node: str = "a", pid: int = 1, rank: int = 0,
          per_rank: int = 2, epoch: int = 0, consumed: int | None = None) -> dict:
    """A step line as trainers/mlp.py writes it (``per_rank`` sample indices)."""
    return {"time": t, "step": step, "world_size": world, "node": node, "pid": pid, "rank": rank, "epoch": epoch,
            "indices": list(range(per_rank)),
            "consumed": (step + 1) * per_rank * world if consumed is None else consumed}


@pytest.mark.parametrize(("window", "every", "back", "expected"), [
    (60, 20, 10, [(0, KILL, 0), (10, START, 0), (20, KILL, 1), (30, START, 1), (40, KILL, 2), (50, START, 2)]),
    (180, 30, 10, [(k * 30 + d, kind, k) for k in range(6) for d, kind in ((0, KILL), (10, START))]),
    # the last kill's return would fall after the window: no return
    (45, 20, 10, [(0, KILL, 0), (10, START, 0), (20, KILL, 1), (30, START, 1), (40, KILL, 2)]),
    (20, 20, 10, [(0, KILL, 0), (10, START, 0)]),
    (10, 20, 10, [(0, KILL, 0)]),
])
def test_kill_schedule(window, every, back, expected):
    assert goodput.kill_schedule(window, every, back) == [Action(*a) for a in expected]


@pytest.mark.parametrize(("window", "every", "back"), [(60, 20, 20), (60, 20, 0), (60, 0, 10), (0, 20, 10)])
def test_kill_schedule_refuses_a_node_away_past_the_next_kill_or_empty_times(window, every, back):
    with pytest.raises(ValueError):
        goodput.kill_schedule(window, every, back)


@pytest.mark.parametrize(("start_order", "training", "victim"), [
    ({"a": 0, "b": 1, "c": 2}, {"a", "b", "c"}, "b"),         # the first kill
    ({"a": 0, "b": 3, "c": 2}, {"a", "b", "c"}, "c"),         # b came back: c is next
    ({"a": 0, "b": 3, "c": 4}, {"a", "b", "c"}, "b"),         # and they alternate
    ({"a": 0, "b": 1, "c": 2, "d": 3}, {"a", "b", "c"}, "b"),  # d waits as the spare
    ({"a": 0, "b": 4, "c": 2, "d": 3}, {"a", "c", "d"}, "c"),  # b back as the spare, d promoted
    ({"a": 0, "b": 4, "c": 5, "d": 3}, {"a", "b", "d"}, "d"),  # each kill takes another node
    ({"a": 0, "b": 1, "c": 2}, {"a"}, "b"),                   # between worlds: the same rule over all
    ({"a": 0, "b": 1, "c": 2}, set(), "b"),
    ({"a": 0, "b": 1, "c": 2, "d": 3}, {"a", "c", "d"}, "c"),  # b not seen training: not chosen
])
def test_choose_victim(start_order, training, victim):
    assert goodput.choose_victim(start_order, "a", training) == victim


def test_choose_victim_never_kills_the_first_node():
    with pytest.raises(ValueError):
        goodput.choose_victim({"a": 0}, "a", {"a"})


def test_last_execution_is_the_newest_line_whatever_the_restart_counts():
    # Restart mode: step 5 trained at 10.0 (node a's restart count 3), re-done at 12.0 by a new node
    # (its count 0) after a restart from the checkpoint: the re-done line is the last execution.
    first = {**_line(10.0, 5), "generation": 3}
    redone = {**_line(12.0, 5, world=2, node="b", pid=7), "generation": 0}
    latest = goodput.last_executions([first, redone, _line(11.0, 4)])
    assert latest[5] is not first and latest[5]["time"] == 12.0
    assert latest[4]["time"] == 11.0


@pytest.mark.parametrize(("lines", "start", "end", "expected"), [
    # one line per rank: a step counts once, its world's samples (2 per rank x 3)
    ([_line(1.0, 0, rank=0), _line(1.0, 0, rank=1), _line(1.0, 0, rank=2)], 0.0, 2.0, 6),
    ([_line(1.0, 0), _line(2.0, 1)], 0.0, 2.0, 6),         # the end is outside
    ([_line(1.0, 0), _line(2.0, 1)], 1.0, 3.0, 12),        # the start is inside
    # step 1 trained at 1.5 at world 3, last executed at 5.0 at world 2 (after the window)
    ([_line(1.0, 0), _line(1.5, 1), _line(5.0, 1, world=2)], 0.0, 4.0, 6),
    # ... and inside a later window, at world 2's samples
    ([_line(1.0, 0), _line(1.5, 1), _line(5.0, 1, world=2)], 4.0, 6.0, 4),
    ([], 0.0, 10.0, 0),
])
def test_samples_last_executed(lines, start, end, expected):
    assert goodput.samples_last_executed(lines, start, end) == expected


def test_samples_trained_counts_each_step_once_even_if_it_is_redone_later():
    lines = [_line(1.0, 0), _line(1.0, 0, rank=1), _line(1.5, 1), _line(5.0, 1, world=2)]
    assert goodput.samples_trained(lines, 0.0, 2.0) == 12
    assert goodput.samples_last_executed(lines, 0.0, 2.0) == 6


@pytest.mark.parametrize(("samples", "rate", "window", "expected"), [
    (9000, 100.0, 100.0, 0.9),
    (10000, 100.0, 100.0, 1.0),
    (0, 100.0, 60.0, 0.0),
    (10500, 100.0, 100.0, 1.05),  # a loaded healthy phase can put it above 1: reported as it is
    (100, None, 60.0, None),
    (100, 0.0, 60.0, None),
])
def test_goodput(samples, rate, window, expected):
    value = goodput.goodput(samples, rate, window)
    assert value == (pytest.approx(expected) if expected is not None else None)


def _world3(t: float, step: int, pids: dict[str, int]) -> list[dict]:
    return [_line(t, step, node=node, pid=pid, rank=rank) for rank, (node, pid) in enumerate(pids.items())]


@pytest.mark.parametrize(("case", "lines", "expected"), [
    # hot mode: b killed at 10.0, a and c at world 2 in their own processes, b back at world 3 at 20.5
    ("hot", _world3(9.9, 99, {"a": 1, "b": 2, "c": 3}) + [_line(11.0, 100, world=2, node="a")]
     + _world3(20.5, 150, {"a": 1, "b": 9, "c": 3}), 10.5),
    # a step in flight at world 3 written after the signal is no new world
    ("in flight", _world3(9.9, 99, {"a": 1, "b": 2, "c": 3}) + _world3(10.05, 100, {"a": 1, "c": 3})
     + _world3(20.5, 150, {"a": 1, "b": 9, "c": 3}), 10.5),
    # hot mode with a spare: d (never trained) promoted at 10.2
    ("spare", _world3(9.9, 99, {"a": 1, "b": 2, "c": 3}) + _world3(10.2, 100, {"a": 1, "c": 3, "d": 4}), 0.2),
    # restart mode: every worker new, at world 2 first, then at world 3
    ("restart", _world3(9.9, 99, {"a": 1, "b": 2, "c": 3}) + [_line(14.0, 80, world=2, node="a", pid=11)]
     + _world3(24.0, 90, {"a": 21, "b": 22, "c": 23}), 14.0),
    # never back before the next kill (until=30.0)
    ("not back", _world3(9.9, 99, {"a": 1, "b": 2, "c": 3}) + [_line(11.0, 100, world=2)]
     + _world3(31.0, 150, {"a": 1, "b": 9, "c": 3}), None),
    # workers at world 3 before `since` (the previous kill) are no longer the old world
    ("since", _world3(1.0, 10, {"a": 1, "b": 2, "c": 3}) + _world3(11.0, 20, {"a": 1, "b": 2, "c": 3}), 1.0),
])
def test_back_to_full_world(case, lines, expected):
    since = 5.0 if case == "since" else 0.0
    value = goodput.back_to_full_world(lines, killed_at=10.0, until=30.0, since=since)
    assert value == (pytest.approx(expected) if expected is not None else None), case


def test_sample_check_passes_a_restart_that_redoes_steps_and_names_a_lost_one():
    # 4 samples per epoch-step at world 2 (2 per rank): steps 0..3 cover positions 0..16 of 16.
    def line(t, step, consumed, world=2):
        return {**_line(t, step, world=world, consumed=consumed), "generation": 0}

    trained = [line(1.0, 0, 4), line(1.1, 1, 8), line(1.2, 2, 12)]
    redone = [line(5.0, 2, 12), line(5.1, 3, 16)]  # a restart from the checkpoint at step 2
    assert goodput.sample_check(trained + redone, dataset_size=16) is None
    gap = [line(1.0, 0, 4), line(1.1, 1, 8), line(5.0, 2, 16)]  # step 2 starts at 12, step 1 ended at 8
    assert "step 1 ends at position 8" in goodput.sample_check(gap, dataset_size=16)
    assert goodput.sample_check([], dataset_size=16) == "no step was recorded"


@pytest.mark.parametrize(("repeat", "order"), [(0, ["w", "x", "y", "z"]), (1, ["x", "y", "z", "w"]),
                                               (3, ["z", "w", "x", "y"]), (4, ["w", "x", "y", "z"])])
def test_rotated(repeat, order):
    assert goodput.rotated(["w", "x", "y", "z"], repeat) == order


# -- the report ----------------------------------------------------------------------------------


def _sample(system: str, value: float, backs: list[float | None], lost: bool = False) -> dict:
    return {"system": system, "goodput": value, "healthy_samples_per_s": 1400.0, "samples_in_window": 70000,
            "kill_count": len(backs), "kills": [{"full_world_after_s": b} for b in backs],
            "samples_lost": lost, "sample_check": "step 3 ..." if lost else "no sample lost or trained twice",
            "load_1min_before": 1.5, "load_1min_after": 2.5}


def _results(samples: dict) -> dict:
    return {"scenarios": {"goodput": {"schedule": {"window_s": 60.0, "kill_every_s": 20.0, "back_after_s": 10.0,
                                                   "healthy_s": 10.0, "warmup_s": 2.0},
                                      "repeats": 1, "torchrun_max_restarts": 1000, "systems": samples}}}


def test_goodput_rows_one_per_system_in_the_schedules_order():
    results = _results({"elasticctl-hot-spare": [_sample("elasticctl-hot-spare", 0.97, [0.2, 0.3, 0.25])],
                        "torchrun": [_sample("torchrun", 0.41, [25.0, None, 24.0], lost=True)],
                        "elasticctl": [], "elasticctl-hot": [{"system": "elasticctl-hot", "error": "boom"}]})
    rows = report.goodput_rows(results)
    # the results' older layout (one shape, its systems at the top) reads as 3 nodes x 1 worker
    assert {row[0] for row in rows} == {"3 nodes × 1 worker"}
    rows = [row[1:] for row in rows]
    assert [row[0] for row in rows] == ["plain torchrun", "elasticctl restart", "elasticctl hot",
                                       "elasticctl hot + 1 spare"]
    torchrun, restart, hot, spare = rows
    assert torchrun[1].startswith("0.41") and "1 of 3 not back before the next kill" in torchrun[5]
    assert torchrun[5].startswith("24.50") and torchrun[6].startswith("yes")
    assert restart[1] == "not measured"
    assert hot[1].startswith("failed: boom")
    assert spare[1].startswith("0.97") and spare[5].startswith("0.25") and spare[6] == "no"
    assert spare[7] == "1.50 → 2.50"


def test_goodput_section_comes_first_in_benchmarks_md():
    results = _results({"elasticctl-hot": [_sample("elasticctl-hot", 0.9, [10.3])]})
    results.update({"command": "python -m bench.run --quick --only goodput", "date": "2026-01-01T00:00:00",
                    "duration_s": 60.0, "mode": "quick", "repeats": {}, "json": "bench/results/x.json",
                    "load": {"before": [1.0], "after": [2.0]}, "errors": [],
                    "machine": {"cpu_model": "cpu", "cpu_count": 2, "ram_gb": 4, "os": "linux", "python": "3.11",
                                "torch": "2", "etcd": "3.5"},
                    "settings": {"checkpoint_every": 20, "checkpoint_repeats": 1, "rendezvous_repeats": 1,
                                 "event_training": ["--steps", "1"], "node_ttl_s": 2}})
    text = report.markdown(results, None)
    assert text.index("| goodput |") < text.index("| measurement | elasticctl restart")
    assert "Goodput" in report.text_table(results).splitlines()[0]
    assert report.goodput_section({"scenarios": {}}) == []


@pytest.mark.parametrize(("back", "cold", "every", "world", "expected"), [
    (10.0, 5.0, 30.0, 3, 1 - 15 / 90),   # the full schedule with a 5 s torch start
    (10.0, 0.0, 30.0, 3, 1 - 10 / 90),   # an instant start: only the time away is lost
    (10.0, 80.0, 30.0, 3, 0.0),          # never back in time: nothing below zero
    (10.0, 5.0, 30.0, 1, None),          # a world of one has no survivor to keep training
    (10.0, 5.0, 0.0, 3, None),
    (-1.0, 5.0, 30.0, 3, None),
])
def test_goodput_bound_without_spare(back, cold, every, world, expected):
    bound = goodput.goodput_bound_without_spare(back, cold, every, world)
    assert bound == (None if expected is None else pytest.approx(expected))


def test_the_floor_paragraph_names_the_cold_start_and_the_bound():
    results = _results({"elasticctl-hot": [{**_sample("elasticctl-hot", 0.78, [18.5, 18.9]),
                                             "kills": [{"full_world_after_s": 18.5, "start_to_full_world_s": 8.5},
                                                       {"full_world_after_s": 18.9, "start_to_full_world_s": None},
                                                       {"full_world_after_s": 19.1, "start_to_full_world_s": 9.1}]}]})
    results["scenarios"]["goodput"]["torch_cold_start_s"] = 5.0
    paragraph = " ".join(report.goodput_section(results))
    assert "took 8.8 s (median) from its start" in paragraph
    assert "took 5.0 s here" in paragraph
    assert "1 − (10 + 5.0) / (3 × 20) = 0.75" in paragraph
    del results["scenarios"]["goodput"]["torch_cold_start_s"]  # a run from before the floor was measured
    assert "What bounds goodput" not in " ".join(report.goodput_section(results))


def test_a_kills_start_to_full_world_is_counted_from_the_nodes_new_start():
    schedule = goodput.Schedule(window_s=30.0, kill_every_s=30.0, back_after_s=10.0, healthy_s=1.0)
    line = {"node": "b", "pid": 2, "world_size": 3, "step": 40, "epoch": 0, "indices": [0], "position": 0,
            "batch": 1, "time": 118.5}
    kills = [{"node": "b", "at": 100.0, "back_at": 110.0, "training": ["b", "c"]}]
    outcome = goodput._outcome([line], schedule, 99.0, 100.0, kills)
    assert outcome["kills"][0]["full_world_after_s"] == pytest.approx(18.5)
    assert outcome["kills"][0]["start_to_full_world_s"] == pytest.approx(8.5)


# -- more than one job shape -------------------------------------------------------------------------


@pytest.mark.parametrize(("nodes", "spares", "training", "spare_names"), [
    (3, 0, ["a", "b", "c"], []),
    (3, 1, ["a", "b", "c"], ["d"]),                   # the spare: the node after the training nodes
    (5, 0, ["a", "b", "c", "d", "e"], []),
    (5, 1, ["a", "b", "c", "d", "e"], ["f"]),
    (25, 1, [chr(ord("a") + i) for i in range(25)], ["z"]),
])
def test_node_names(nodes, spares, training, spare_names):
    assert goodput.node_names(nodes, spares) == (training, spare_names)


@pytest.mark.parametrize(("nodes", "spares"), [(2, 0), (1, 1), (0, 0), (26, 1), (27, 0)])
def test_node_names_refuses_a_shape_it_cannot_run(nodes, spares):
    with pytest.raises(ValueError):
        goodput.node_names(nodes, spares)


@pytest.mark.parametrize(("nodes", "key"), [(3, "3x1"), (5, "5x1"), (12, "12x1")])
def test_shape_key(nodes, key):
    assert goodput.shape_key(nodes) == key


@pytest.mark.parametrize(("shapes", "systems", "repeats", "jobs"), [
    ((3,), ["torchrun", "elasticctl"], 1, [(3, 0, "torchrun"), (3, 0, "elasticctl")]),
    # one shape after the other, each shape's repeats rotated as before
    ((3, 5), ["torchrun", "elasticctl"], 2,
     [(3, 0, "torchrun"), (3, 0, "elasticctl"), (3, 1, "elasticctl"), (3, 1, "torchrun"),
      (5, 0, "torchrun"), (5, 0, "elasticctl"), (5, 1, "elasticctl"), (5, 1, "torchrun")]),
    ((5, 3), ["elasticctl-hot-spare"], 1, [(5, 0, "elasticctl-hot-spare"), (3, 0, "elasticctl-hot-spare")]),
    ((3, 5), ["torchrun"], 0, []),
    ((26,), ["torchrun"], 1, [(26, 0, "torchrun")]),   # a to z, no spare
])
def test_plan_jobs(shapes, systems, repeats, jobs):
    assert goodput.plan_jobs(shapes, systems, repeats) == jobs


@pytest.mark.parametrize(("shapes", "systems"), [
    ((3, 3), ["torchrun"]),                          # a shape twice
    ((2,), ["torchrun"]),                            # too few nodes
    ((27,), ["torchrun"]),                           # more than the letters
    ((3, 26), ["torchrun", "elasticctl-hot-spare"]),  # 26 leave no letter for the spare
])
def test_plan_jobs_refuses_before_any_job(shapes, systems):
    with pytest.raises(ValueError):
        goodput.plan_jobs(shapes, systems, 1)


def _kill_in_turn(start_order: dict[str, int], training: set[str], spare: str | None, kills: int) -> list[str]:
    """The victims of ``kills`` kills as _apply_schedule picks them, each node back before the next
    kill: without a spare it trains again; with one it waits as the spare, which took its place."""
    start_order, training, victims = dict(start_order), set(training), []
    for _ in range(kills):
        victim = goodput.choose_victim(start_order, "a", training)
        victims.append(victim)
        start_order[victim] = max(start_order.values()) + 1
        if spare is not None:
            training = training - {victim} | {spare}
            spare = victim
    return victims


@pytest.mark.parametrize(("nodes", "spare", "victims"), [
    (3, None, ["b", "c", "b", "c", "b", "c"]),
    (3, "d", ["b", "c", "d", "b", "c", "d"]),
    (5, None, ["b", "c", "d", "e", "b", "c"]),                 # every node but a in turn
    (5, "f", ["b", "c", "d", "e", "f", "b", "c"]),             # the spare's turn comes once it trains
])
def test_choose_victim_takes_every_other_node_in_turn_at_each_shape(nodes, spare, victims):
    training, _ = goodput.node_names(nodes)
    order = {name: rank for rank, name in enumerate(training + ([spare] if spare else []))}
    assert _kill_in_turn(order, set(training), spare, len(victims)) == victims


@pytest.mark.parametrize(("start_order", "training", "victim"), [
    ({"a": 0, "b": 1, "c": 2, "d": 3, "e": 4, "f": 5}, {"a", "b", "c", "d", "e"}, "b"),  # f waits as the spare
    ({"a": 0, "b": 1, "c": 2, "d": 3, "e": 4, "f": 5}, set(), "b"),   # between worlds: never the spare
    ({"a": 0, "b": 6, "c": 2, "d": 3, "e": 4, "f": 5}, {"a", "c", "d", "e", "f"}, "c"),
    ({"a": 0, "b": 5, "c": 6, "d": 7, "e": 8}, {"a", "b", "c", "d", "e"}, "b"),
])
def test_choose_victim_at_5_nodes(start_order, training, victim):
    assert goodput.choose_victim(start_order, "a", training) == victim


def _world(t: float, step: int, pids: dict[str, int]) -> list[dict]:
    return [_line(t, step, world=len(pids), node=node, pid=pid, rank=rank)
            for rank, (node, pid) in enumerate(pids.items())]


FIVE = {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5}


@pytest.mark.parametrize(("case", "lines", "full_world", "expected"), [
    # hot mode at 5: b killed at 10.0, 4 survivors, b back at world 5 at 21.0
    ("hot", _world(9.9, 99, FIVE) + _world(10.2, 100, {"a": 1, "c": 3, "d": 4, "e": 5})
     + _world(21.0, 150, {**FIVE, "b": 9}), 5, 11.0),
    # a new world of 3 is not the full world of 5
    ("smaller", _world(9.9, 99, FIVE) + _world(12.0, 100, {"a": 1, "c": 3, "d": 4}), 5, None),
    # ... where at 3 nodes it would be
    ("at 3", _world(9.9, 99, {"a": 1, "b": 2, "c": 3}) + _world(12.0, 100, {"a": 1, "c": 3, "d": 4}), 3, 2.0),
    # with the spare f promoted at 10.3
    ("spare", _world(9.9, 99, FIVE) + _world(10.3, 100, {"a": 1, "c": 3, "d": 4, "e": 5, "f": 6}), 5, 0.3),
])
def test_back_to_full_world_at_a_shape(case, lines, full_world, expected):
    value = goodput.back_to_full_world(lines, killed_at=10.0, until=30.0, since=0.0, full_world=full_world)
    assert value == (pytest.approx(expected) if expected is not None else None), case


def test_outcome_counts_the_full_world_of_its_shape():
    schedule = goodput.Schedule(window_s=30.0, kill_every_s=30.0, back_after_s=10.0, healthy_s=1.0)
    kills = [{"node": "c", "at": 100.0, "back_at": 110.0, "training": ["a", "b", "c", "d", "e"]}]
    lines = _world(99.5, 10, FIVE) + _world(100.5, 11, {"a": 1, "b": 2, "d": 4, "e": 5}) \
        + _world(112.0, 40, {**FIVE, "c": 8})
    at_5 = goodput._outcome(lines, schedule, 99.0, 100.0, kills, full_world=5)
    assert at_5["kills"][0]["full_world_after_s"] == pytest.approx(12.0)
    assert at_5["kills"][0]["start_to_full_world_s"] == pytest.approx(2.0)
    assert at_5["healthy_world_sizes"] == [5]
    # read at the default shape's 3 the world of 4 and 5 never make a world of 3
    assert goodput._outcome(lines, schedule, 99.0, 100.0, kills)["not_full_again"] == 1


def test_the_empty_entry_keys_each_shape_and_its_systems():
    entry = goodput.empty_entry(goodput.Schedule(window_s=60.0), 2, (3, 5), ("torchrun", "elasticctl-hot"))
    assert entry["schedule"]["window_s"] == 60.0 and entry["repeats"] == 2 and "systems" not in entry
    assert entry["shapes"] == {"3x1": {"nodes": 3, "per_node": 1, "systems": {"torchrun": [], "elasticctl-hot": []}},
                               "5x1": {"nodes": 5, "per_node": 1, "systems": {"torchrun": [], "elasticctl-hot": []}}}


def _shaped(per_shape: dict[int, dict], cold_start: float | None = 5.0) -> dict:
    """Results in the per-shape layout (bench/goodput.py's empty_entry), the shapes in the given order."""
    results = _results({})
    entry = results["scenarios"]["goodput"]
    del entry["systems"]
    entry["shapes"] = {goodput.shape_key(nodes): {"nodes": nodes, "per_node": 1, "systems": systems}
                       for nodes, systems in per_shape.items()}
    if cold_start is not None:
        entry["torch_cold_start_s"] = cold_start
    return results


@pytest.mark.parametrize(("entry", "nodes"), [
    (None, []),
    ({}, []),
    ({"schedule": {}}, []),                                                # neither layout: nothing to show
    ({"systems": {"torchrun": []}}, [3]),                                  # the older layout: 3 nodes
    ({"shapes": {"5x1": {"nodes": 5, "systems": {}}, "3x1": {"nodes": 3, "systems": {}}}}, [3, 5]),
    ({"shapes": {"12x1": {"nodes": 12, "systems": {}}, "5x1": {"nodes": 5, "systems": {}}}}, [5, 12]),
    ({"shapes": {}}, []),
])
def test_goodput_shapes_reads_both_layouts_fewest_nodes_first(entry, nodes):
    assert [n for n, _ in report.goodput_shapes(entry)] == nodes


def test_goodput_rows_a_group_per_shape():
    results = _shaped({5: {"elasticctl-hot": [_sample("elasticctl-hot", 0.80, [11.0])]},
                       3: {"elasticctl-hot": [_sample("elasticctl-hot", 0.85, [10.5])],
                           "torchrun": [{"system": "torchrun", "error": "boom"}]}})
    rows = report.goodput_rows(results)
    assert [row[:2] for row in rows] == [
        ("3 nodes × 1 worker", "plain torchrun"), ("3 nodes × 1 worker", "elasticctl restart"),
        ("3 nodes × 1 worker", "elasticctl hot"), ("3 nodes × 1 worker", "elasticctl hot + 1 spare"),
        ("5 nodes × 1 worker", "plain torchrun"), ("5 nodes × 1 worker", "elasticctl restart"),
        ("5 nodes × 1 worker", "elasticctl hot"), ("5 nodes × 1 worker", "elasticctl hot + 1 spare")]
    assert rows[0][2].startswith("failed: boom") and rows[4][2] == "not measured"
    assert rows[2][2].startswith("0.85") and rows[6][2].startswith("0.80") and rows[6][6].startswith("11.00")


def test_goodput_section_says_each_shape_and_its_bound():
    results = _shaped({3: {"elasticctl-hot": [{**_sample("elasticctl-hot", 0.85, [18.5]),
                                               "kills": [{"full_world_after_s": 18.5, "start_to_full_world_s": 8.5}]}]},
                       5: {"elasticctl-hot": [{**_sample("elasticctl-hot", 0.80, [19.5]),
                                               "kills": [{"full_world_after_s": 19.5, "start_to_full_world_s": 9.5}]}]}})
    lines = report.goodput_section(results)
    header = next(line for line in lines if line.startswith("| shape |"))
    table = [line for line in lines if line.startswith("| ") and line != header]
    assert len(table) == 8 and all(line.count(" | ") == header.count(" | ") for line in table)
    assert table[0].startswith("| 3 nodes × 1 worker |") and table[4].startswith("| 5 nodes × 1 worker |")
    text = " ".join(lines)
    assert "Job shapes: 3 nodes × 1 worker and 5 nodes × 1 worker" in text
    assert "one shape after the other" in text
    assert "took 8.5 s (median) from its start to its first step at the full world at 3 nodes × 1 worker, " \
           "9.5 s at 5 nodes × 1 worker" in text
    assert "1 − (10 + 5.0) / (3 × 20) = 0.75 at 3 nodes × 1 worker" in text
    assert "1 − (10 + 5.0) / (5 × 20) = 0.85 at 5 nodes × 1 worker (if a world of 4 trains its 4/5" in text
    assert "What bounds goodput" not in " ".join(report.goodput_section(_shaped({3: {}}, cold_start=None)))


def test_the_text_table_names_each_rows_shape():
    results = _shaped({3: {"elasticctl-hot": [_sample("elasticctl-hot", 0.85, [10.5])]},
                       5: {"elasticctl-hot": [_sample("elasticctl-hot", 0.80, [11.0])]}})
    results["settings"] = {"checkpoint_every": 20}
    goodput_lines = [line for line in report.text_table(results).splitlines() if line.startswith("Goodput")]
    assert "Goodput, elasticctl hot, 3 nodes × 1 worker: goodput 0.85" in "\n".join(goodput_lines)
    assert "Goodput, elasticctl hot, 5 nodes × 1 worker: goodput 0.80" in "\n".join(goodput_lines)
