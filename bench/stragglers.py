"""Benchmark scenario: a straggler in elasticctl hot mode, 3 nodes x 1 worker.

Two jobs of the same trainer (bench/scenarios.py's event training, ~15 steps/s), node c slowed
by ``trainers/mlp.py --slow-node c=SLOW@FROM:`` from global step FROM on:

* **named**, without eviction: steps from FROM to the ``straggler`` event that names c (against
  the window W; the workers compare step times every K steps), rank 0's steps/s before FROM
  (healthy) and after it (slowed: c sets everyone's pace);
* **evicted**, with ``--evict-stragglers R``: the ``straggler`` event that asks c to leave, and
  rank 0's steps/s at world 2 once a and b go on without it, against the same job's healthy rate.

Times come from the trainer's record (rank 0's steps), events from the job's history in etcd;
waits are on them, capped (a cap that runs out is a result, not an error). The report's section
(:func:`section`, :func:`text_lines`) lives here so that bench/report.py only includes it.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.cluster import Cluster, wait_for
from bench.scenarios import EVENT_TRAINING, FIRST_NODES, Caps, _start_world3
from elasticctl.etcd.client import EtcdClient
from elasticctl.job.events import EventLog
from elasticctl.job.keys import JobKeys
from elasticctl.job.records import EventKind

SYSTEM = "elasticctl-hot"
SLOWED = "c"
SLOW_FROM = 80       # the global step from which c is slowed (healthy steps before it)
SLOW_S = 0.2         # seconds c sleeps per step on top of everyone's --step-sleep 0.05
WINDOW, INTERVAL = 20, 5  # --straggler-window W, --straggler-interval K
EVICT = 3.0          # --evict-stragglers R
RATE_STEPS = 30      # steps each rate is measured over
TARGET_RATIO = 0.9   # with eviction on, steps/s back to >= 0.9 x the healthy rate


def _rank0_rate(steps: list[dict], first: int, last: int) -> float | None:
    """Rank 0's steps/s from global step ``first`` to ``last`` (None: not both recorded)."""
    times = {r["step"]: r["time"] for r in steps if r["rank"] == 0 and first <= r["step"] <= last}
    if first not in times or last not in times or times[last] <= times[first]:
        return None
    return (last - first) / (times[last] - times[first])


def _straggler_events(cluster: Cluster, evicted: bool) -> list:
    return [e for e in EventLog(cluster.etcd, JobKeys(cluster.job)).read()
            if e.kind is EventKind.STRAGGLER and e.node == SLOWED
            and ("evicted" in (e.reason or "")) is evicted]


def _job(workdir: Path, etcd: EtcdClient, evict: float | None) -> Cluster:
    trainer = [*EVENT_TRAINING, "--slow-node", f"{SLOWED}={SLOW_S}@{SLOW_FROM}:1000000000"]
    options = ["--straggler-window", str(WINDOW), "--straggler-interval", str(INTERVAL),
               *(["--evict-stragglers", f"{evict:g}"] if evict else [])]
    return Cluster(SYSTEM, workdir, trainer, etcd, up_args=tuple(options))


def _healthy(cluster: Cluster) -> float | None:
    """Rank 0's steps/s at world 3 over the RATE_STEPS steps just before the slow-down."""
    return _rank0_rate(cluster.record.steps(world=3), SLOW_FROM - RATE_STEPS - 5, SLOW_FROM - 5)


def _reached(cluster: Cluster, step: int, world: int, cap: float) -> bool:
    return bool(wait_for(lambda: any(r["rank"] == 0 and r["step"] >= step for r in cluster.record.steps(world=world)),
                         cap, interval=0.05))


def _slowed_job(workdir: Path, etcd: EtcdClient, evict: float | None, caps: Caps, measure) -> dict:
    """A job of 3 whose node c slows down from SLOW_FROM: once at world 3, wait for c's straggler
    event (evicted or not, as ``evict`` asks), then ``measure(cluster, result so far, events)``."""
    cluster = _job(workdir, etcd, evict)
    try:
        cold_start = _start_world3(cluster, caps)
        if cold_start is None:
            return {"error": f"no world of 3 within {caps.start:g} s"}
        event = wait_for(lambda: _straggler_events(cluster, evicted=evict is not None), caps.recover, interval=0.1)
        return measure(cluster, {"cold_start_s": cold_start, "healthy_steps_per_s": _healthy(cluster)}, event)
    finally:
        cluster.close()


def named(workdir: Path, etcd: EtcdClient, caps: Caps) -> dict:
    """No eviction: when c is named, and what it costs everyone's pace."""
    def measure(cluster: Cluster, result: dict, event: list) -> dict:
        slowed_from, slowed_to = SLOW_FROM + INTERVAL, SLOW_FROM + INTERVAL + RATE_STEPS
        _reached(cluster, slowed_to, 3, caps.recover)
        result["slowed_steps_per_s"] = _rank0_rate(cluster.record.steps(world=3), slowed_from, slowed_to)
        if not event:
            return {**result, "outcome": f"not named within {caps.recover:g} s"}
        return {**result, "outcome": "named", "named_at_step": event[0].step, "ratio": event[0].ratio,
                "steps_to_named": None if event[0].step is None else event[0].step - SLOW_FROM}

    return _slowed_job(workdir, etcd, None, caps, measure)


def evicted(workdir: Path, etcd: EtcdClient, caps: Caps) -> dict:
    """--evict-stragglers R: c asked to leave, a and b on at world 2 in their own processes."""
    def measure(cluster: Cluster, result: dict, event: list) -> dict:
        if not event:
            return {**result, "outcome": f"not evicted within {caps.recover:g} s"}
        result.update(evicted_at_step=event[0].step, ratio=event[0].ratio,
                      steps_to_evicted=None if event[0].step is None else event[0].step - SLOW_FROM)
        survivors = set(FIRST_NODES) - {SLOWED}
        resumed_at = cluster.wait_world(2, survivors, event[0].time, caps.recover)
        if resumed_at is None:
            return {**result, "outcome": f"no world of 2 within {caps.recover:g} s"}
        result["world2_after_s"] = resumed_at - event[0].time
        first = min(r["step"] for r in cluster.record.steps(resumed_at - 0.001, 2) if r["rank"] == 0)
        # skip the first steps at world 2: DDP's bucket rebuild and the new group's warm-up
        start, end = first + 10, first + 10 + RATE_STEPS
        _reached(cluster, end, 2, caps.recover)
        rate = _rank0_rate(cluster.record.steps(world=2), start, end)
        healthy = result["healthy_steps_per_s"]
        return {**result, "outcome": "evicted", "after_eviction_steps_per_s": rate,
                "ratio_to_healthy": None if rate is None or not healthy else rate / healthy}

    return _slowed_job(workdir, etcd, EVICT, caps, measure)


def run(root: Path, etcd: EtcdClient, caps: Caps) -> dict:
    """Both jobs once (bench/run.py's `straggler` scenario)."""
    started = time.monotonic()
    result = {"settings": {"system": SYSTEM, "slowed_node": SLOWED, "slow_from_step": SLOW_FROM, "slow_s": SLOW_S,
                           "window": WINDOW, "interval": INTERVAL, "evict": EVICT, "rate_steps": RATE_STEPS},
              "named": named(root / "straggler-named", etcd, caps),
              "evicted": evicted(root / "straggler-evicted", etcd, caps)}
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


# -- the report -------------------------------------------------------------------------------


def _num(value, digits: int = 1, unit: str = "") -> str:
    return "—" if value is None else f"{value:.{digits}f}{unit}"


def rows(results: dict) -> list[tuple[str, str]]:
    entry = results["scenarios"].get("straggler")
    if not entry:
        return []
    named_run, evicted_run = entry.get("named", {}), entry.get("evicted", {})
    s = entry["settings"]
    steps = named_run.get("steps_to_named")
    return [
        (f"steps from the slow-down (step {s['slow_from_step']}) to the `straggler` event naming node c "
         f"(W = {s['window']}, K = {s['interval']})",
         named_run.get("outcome", "—") if steps is None else f"{steps} (ratio {_num(named_run.get('ratio'), 2)})"),
        ("healthy steps/s at world 3 (rank 0, before the slow-down)",
         f"{_num(named_run.get('healthy_steps_per_s'))} / {_num(evicted_run.get('healthy_steps_per_s'))} "
         "(job without / with eviction)"),
        (f"slowed steps/s, node c +{s['slow_s']:g} s per step, no eviction",
         _num(named_run.get("slowed_steps_per_s"))),
        (f"steps/s at world 2 after eviction (`--evict-stragglers {s['evict']:g}`), ratio to healthy",
         evicted_run.get("outcome", "—") if evicted_run.get("after_eviction_steps_per_s") is None
         else f"{_num(evicted_run['after_eviction_steps_per_s'])} ({_num(evicted_run.get('ratio_to_healthy'), 2)}×); "
              f"evicted at step {evicted_run.get('evicted_at_step')}, world 2 trains "
              f"{_num(evicted_run.get('world2_after_s'), 2, ' s')} later"),
    ]


def targets(results: dict) -> str:
    entry = results["scenarios"].get("straggler") or {}
    s = entry.get("settings", {"window": WINDOW, "interval": INTERVAL})
    steps = (entry.get("named") or {}).get("steps_to_named")
    ratio = (entry.get("evicted") or {}).get("ratio_to_healthy")
    bound = s["window"] + s["interval"]  # named after W slow steps, at the next exchange
    named_part = (f"named within W steps (W = {s['window']}, exchanged every K = {s['interval']}: ≤ {bound}): "
                  + ("not measured" if steps is None else f"{steps} ({'met' if steps <= bound else 'missed'})"))
    ratio_part = (f"with eviction on, steps/s ≥ {TARGET_RATIO:g} × healthy: "
                  + ("not measured" if ratio is None else f"{ratio:.2f} × ({'met' if ratio >= TARGET_RATIO else 'missed'})"))
    return f"Targets, straggler: {named_part}; {ratio_part}."


def section(results: dict) -> list[str]:
    if not results["scenarios"].get("straggler"):
        return []
    return [
        "## Straggler: named, and evicted",
        "",
        ("`bench/stragglers.py`: elasticctl hot mode, 3 nodes × 1 worker, the event scenarios' trainer; "
         "node c sleeps an extra fixed time per step from a known global step on (`trainers/mlp.py "
         "--slow-node`). One job without eviction (when c is named, what it costs), one with "
         "`--evict-stragglers` (c asked to leave, a and b on at world 2 in their own processes). "
         "Steps/s: rank 0's, over 30 steps."),
        "",
        "| measurement | value |",
        "|---|---|",
        *(f"| {what} | {value} |" for what, value in rows(results)),
        "",
        targets(results),
        "",
    ]


def text_lines(results: dict) -> list[str]:
    if not results["scenarios"].get("straggler"):
        return []
    return [*(f"straggler, {what}: {value}" for what, value in rows(results)), targets(results)]
