"""World size and steps/s over time around a crash, a scale-up and a freeze, every system, one PNG.

Reads the ``timeline`` (rank 0's [seconds, step, world size]) and ``events`` of
the first lifecycle run of each system (elasticctl restart mode, elasticctl hot
mode, plain torchrun; older results lack the hot one) in a results JSON.
Run: python -m bench.plot bench/results/X.json bench/results/recovery.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# bench.cluster.SYSTEMS, in its order (not imported: plotting needs no cluster code).
TITLES = {"elasticctl": "elasticctl (restart mode)", "elasticctl-hot": "elasticctl --recovery hot",
          "torchrun": "plain torchrun"}


def steps_per_second(timeline: list[list[float]], end: float) -> tuple[list[float], list[int]]:
    """Rank 0's completed steps in each 1 s bin up to ``end``."""
    bins = int(max(end, timeline[-1][0] if timeline else 0)) + 1
    counts = [0] * bins
    for t, _, _ in timeline:
        counts[int(t)] += 1
    return [b + 0.5 for b in range(bins)], counts


def with_gaps(timeline: list[list[float]]) -> tuple[list[float], list[float]]:
    """World size per step, the line broken wherever rank 0 trained nothing for over a second."""
    times, worlds = [], []
    for (t, _, world), previous in zip(timeline, [None, *timeline]):
        if previous is not None and t - previous[0] > 1.0:
            times.append(previous[0])
            worlds.append(float("nan"))
        times.append(t)
        worlds.append(world)
    return times, worlds


def end_of(run: dict) -> float:
    """Until the bench gave up: a freeze without recovery still spans its whole cap."""
    end = run["timeline"][-1][0]
    freeze = run.get("freeze") or {}
    if freeze.get("seconds") is None and "sigstop b" in run["events"]:
        end = max(end, run["events"]["sigstop b"] + freeze.get("cap_s", 0))
    return end


def plot(results: dict, out: Path) -> Path | None:
    """The recovery figure at ``out``; None (and a line saying why) without matplotlib, the
    ``bench`` extra: the numbers and the report do not need it."""
    try:
        import matplotlib
    except ImportError:
        print("bench: no figure: matplotlib is not installed (pip install -e '.[bench]')", file=sys.stderr)
        return None

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    runs = results["scenarios"].get("lifecycle", {})
    systems = [s for s in TITLES if runs.get(s) and runs[s][0].get("timeline")]
    if not systems:
        return None
    fig, axes = plt.subplots(2, len(systems), figsize=(6.5 * len(systems), 5.5), sharex=True, squeeze=False)
    end = max(end_of(runs[s][0]) for s in systems)
    for column, system in enumerate(systems):
        run = runs[system][0]
        timeline = run["timeline"]
        world_axis, rate_axis = axes[0][column], axes[1][column]
        world_axis.plot(*with_gaps(timeline), color="tab:blue", drawstyle="steps-post", marker=".", markersize=3)
        world_axis.set_ylim(0, 3.5)
        world_axis.set_yticks([0, 1, 2, 3])
        world_axis.set_title(TITLES.get(system, system))
        centres, counts = steps_per_second(timeline, end_of(run))
        rate_axis.plot(centres, counts, color="tab:green")
        for name, t in run["events"].items():
            for axis in (world_axis, rate_axis):
                axis.axvline(t, color="tab:red", linestyle="--", linewidth=1)
            world_axis.annotate(name, (t, 3.3), fontsize=8, color="tab:red", xytext=(3, 0),
                                textcoords="offset points", va="top")
        rate_axis.set_xlabel("seconds since the first node started")
        rate_axis.set_xlim(0, end)
    axes[0][0].set_ylabel("world size (rank 0's steps)")
    axes[1][0].set_ylabel("steps/s (rank 0, 1 s bins)")
    fig.suptitle(f"3 nodes on loopback, mlp trainer, {results['date']}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    results = json.loads(Path(sys.argv[1]).read_text())
    print(plot(results, Path(sys.argv[2])))


if __name__ == "__main__":
    main()
