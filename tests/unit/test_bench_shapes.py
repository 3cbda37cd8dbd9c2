"""The benchmark of a crash at several shapes (bench/shapes.py): the shape argument, the timed-out
generations read from the nodes' logs, the summary, the target's verdict and BENCHMARKS.md's table,
on made-up results; bench.run selects the section.

Layer tests/unit: no etcd, no processes.
"""

from __future__ import annotations

import pytest

from bench import report, run, shapes


@pytest.mark.parametrize("text, expected", [("3x1", (3, 1)), ("8x1", (8, 1)), ("4x2", (4, 2)), ("12x8", (12, 8))])
def test_a_shape_is_nodes_x_workers(text, expected):
    assert shapes.parse_shape(text) == expected


@pytest.mark.parametrize("text", ["2x1", "3x0", "3x9", "3", "x1", "3 x 1", "0x1", "3x1\n"])
def test_a_bad_shape_is_named_in_one_sentence(text):
    with pytest.raises(ValueError) as raised:
        shapes.parse_shape(text)
    assert f"'{text}'" in str(raised.value) and str(raised.value).count(".") == 1


LOG_TIMED_OUT = ("[c.0] generation 4 ends at step 30: RuntimeError: [unbound_buffer.cc:78] Timed out waiting 2000ms "
                 "for recv operation to complete")
LOG_CLOSED = "[b.0] generation 4 ends at step 30: RuntimeError: [pair.cc:561] Connection closed by peer"


@pytest.mark.parametrize("logs, since, expected", [
    ({"b": LOG_CLOSED, "c": LOG_TIMED_OUT}, {}, [f"c: {LOG_TIMED_OUT[:160]}"]),
    ({"c": LOG_TIMED_OUT}, {"c": 1}, []),  # an earlier repeat's line is not this one's
    ({"c": "starting\n" + LOG_TIMED_OUT}, {"c": 1}, [f"c: {LOG_TIMED_OUT[:160]}"]),
    ({"b": LOG_CLOSED}, {}, []),
    # a timeout not in a generation's end (e.g. a store's) is not the cost measured here
    ({"b": "TimeoutError: Timed out waiting 2000ms for the store"}, {}, []),
])
def test_a_generation_ended_by_a_collective_s_timeout_is_read_from_the_logs(logs, since, expected):
    assert shapes.timed_out_lines(logs, since) == expected


@pytest.mark.parametrize("seconds, expected", [
    ([0.2, 0.1, 0.3], {"median_s": 0.2, "min_s": 0.1, "max_s": 0.3, "n": 3, "missed": 0}),
    ([0.2, None], {"median_s": 0.2, "min_s": 0.2, "max_s": 0.2, "n": 2, "missed": 1}),
    ([None], {"median_s": None, "min_s": None, "max_s": None, "n": 1, "missed": 1}),
])
def test_the_summary_of_a_shape(seconds, expected):
    assert shapes.summarize(seconds) == expected


def _hot(*seconds, timed_out=()):
    runs = [{"seconds": s, "victim": "b", "timed_out": ["c: ..."] if i in timed_out else []}
            for i, s in enumerate(seconds)]
    return {"runs": runs, **shapes.summarize(list(seconds))}


def _results(entry: dict) -> dict:
    return {"scenarios": {"kill_shapes": entry}, "settings": {"node_ttl_s": 2}}


@pytest.mark.parametrize("entry, expected", [
    ({"3x1": {"elasticctl-hot": _hot(0.1, 0.2)}, "5x1": {"elasticctl-hot": _hot(0.3, 0.4)}},
     "met (2 shapes)"),
    ({"3x1": {"elasticctl-hot": _hot(0.1, 0.2)}, "5x1": {"elasticctl-hot": _hot(0.3, 2.1)}},
     "missed (2 shapes; over the target: 5x1 (2.10 s))"),
    ({"5x1": {"elasticctl-hot": _hot(0.3, None)}}, "missed (1 shapes; over the target: 5x1 (0.30 s))"),
    ({"3x2": {"elasticctl-hot": _hot(0.3, 0.4, timed_out=(1,))}},
     "missed (1 shapes; a generation ended by a collective's timeout at 3x2)"),
    ({"4x2": {"elasticctl-hot": {"error": "the job did not reach world 8 within 120 s", "runs": []}}},
     "missed (1 shapes; over the target: 4x2 (no value))"),
    ({"5x1": {"torchrun": _hot(20.0)}}, "not measured"),
])
def test_the_target_holds_at_every_shape_and_every_run(entry, expected):
    assert shapes.verdict(entry).endswith(expected)


def test_the_table_has_a_row_per_shape_with_the_systems_compared_where_they_ran():
    entry = {"3x1": {"elasticctl-hot": {**_hot(0.1, 0.2, 0.15), "freezes": [2.1]}, "elasticctl": _hot(9.0),
                     "torchrun": _hot(17.0)},
             "3x2": {"elasticctl-hot": _hot(0.3, 0.6, timed_out=(1,))}}
    text = "\n".join(shapes.section(_results(entry), report._cell))
    assert "| 3 × 1 | 0.150 (0.100–0.200, n=3) | 9.000 (9.000–9.000, n=1) | 17.000 (17.000–17.000, n=1) | 0.200 " \
           "| 0 of 3 | 2.100 (2.100–2.100, n=1) |" in text
    assert "| 3 × 2 | 0.450 (0.300–0.600, n=2) | — | — | 0.600 | 1 of 2 | — |" in text
    assert "Targets: hot mode SIGKILL → first step ≤ 0.5 s at every shape, every run: missed" in text
    assert "a freeze → first step ≤ node TTL + 0.3 s (2.3 s) at every shape: met (1 shapes)" in text
    assert shapes.section({"scenarios": {}}, report._cell) == []


def test_bench_run_has_the_section_and_its_repeats():
    assert "kill_shapes" in run.ALL
    assert run.PLANS["quick"].kill_shape_repeats == 5


@pytest.mark.parametrize("freezes, expected", [
    ({"3x1": [2.1], "5x1": [2.2]}, "met (2 shapes)"),
    ({"3x1": [2.1], "5x1": [2.4]}, "missed (2 shapes; over: 5x1 (2.40 s))"),
    ({"4x2": [None]}, "missed (1 shapes; over: 4x2 (no value))"),
    ({}, "not measured"),
])
def test_a_freeze_costs_the_node_ttl_and_little_more_at_every_shape(freezes, expected):
    entry = {shape: {"elasticctl-hot": {**_hot(0.1), "freezes": values}} for shape, values in freezes.items()}
    assert shapes.freeze_verdict(entry, 2).endswith(expected)
