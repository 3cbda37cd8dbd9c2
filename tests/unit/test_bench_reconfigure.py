"""bench/reconfigure.py's arithmetic and table, on made-up records (the bench itself runs real jobs)."""

from __future__ import annotations

from bench import report
from bench.reconfigure import _gap, section


def _step(t: float, world: int, rank: int = 0) -> dict:
    return {"time": t, "world_size": world, "rank": rank}


def test_the_pause_is_rank_0s_gap_across_the_change():
    steps = [_step(1.0, 2), _step(1.1, 2), _step(1.15, 2, rank=1), _step(1.6, 3), _step(1.7, 3), _step(1.65, 3, rank=1)]
    assert _gap(steps, event=1.05, before=2, after=3) == 0.5
    assert _gap(steps, event=1.05, before=2, after=1) is None  # never reached
    assert _gap([_step(2.0, 3)], event=1.0, before=2, after=3) is None  # nothing before it


def _sample(join: float | None, group: str) -> dict:
    timeline = {"group": group, "group_reconfigured" if group == "reconfigured" else "group_built": 0.01}
    return {"events": {"join": {"pause_s": join, "timeline": timeline},
                       "leave": {"pause_s": 0.04, "timeline": timeline},
                       "kill": {"pause_s": 0.09, "timeline": {"group": "rebuilt", "group_built": 0.05}}},
            "replicas_identical": True}


def test_the_table_compares_the_variants_event_by_event():
    results = {"scenarios": {"reconfigure": {"repeats": 2, "variants": {
        "reconfigured": [_sample(0.05, "reconfigured"), _sample(0.07, "reconfigured")],
        "rebuilt": [_sample(0.10, "rebuilt"), _sample(None, "rebuilt")]}}}}
    text = "\n".join(section(results, report._cell, report._ratio))
    assert "| a node joins: running workers' pause | 0.060 (0.050–0.070, n=2) (reconfigured) | 0.100 (0.100–0.100, n=1); 1 failed (rebuilt) | 0.60 |" in text
    assert "Replicas identical at every step: yes." in text
    assert section({"scenarios": {}}, report._cell, report._ratio) == []
