"""Hot mode's process group across membership changes: reconfigured in place, or built anew.

    python -m bench.run --quick --only reconfigure

A hot-mode worker keeps one process group for its life and reconfigures it in place for a
change every member agreed on at a step boundary (a join, a leave); after a failure it builds
a new one, which is what closes the connections another survivor may wait on
(the worker's machine, elasticctl/train/worker/lifecycle.py). ``ELASTICCTL_REBUILD_GROUPS=1`` on every node
builds a new group for every generation: the baseline here, run in the same invocation.

Per repeat and variant (their order alternating per repeat), one job of 2 nodes x 1 worker,
``up --recovery hot``, trainers/mlp.py with the event scenarios' training (~15 steps/s):

1. a and b train at world 2;
2. node c starts: ``join`` is the running workers' pause (rank 0's step-time gap across 2 -> 3);
3. c's process tree gets SIGTERM and c leaves at a boundary: ``leave`` is rank 0's gap across 3 -> 2;
4. b is SIGKILLed: ``kill`` is rank 0's gap across 2 -> 1 (a failure: both variants rebuild).

Also per event the survivor a's ``recovery_timeline`` (where the seconds went; ``group`` says
whether its group was reconfigured or built) and whether the replicas stayed identical.
"""

from __future__ import annotations

import signal
import statistics
import time
from pathlib import Path

from bench import accounting
from bench.cluster import Cluster, wait_for
from bench.scenarios import EVENT_TRAINING, Caps
from elasticctl.etcd.client import EtcdClient

VARIANTS = ("reconfigured", "rebuilt")
EVENTS = ("join", "leave", "kill")
REBUILD_ENV = {"ELASTICCTL_REBUILD_GROUPS": "1"}


def _gap(steps: list[dict], event: float, before: int, after: int) -> float | None:
    """Rank 0's pause across a change: its first step at world ``after`` following ``event`` minus
    its last step at world ``before`` ahead of that (the running workers' lost time)."""
    rank0 = [r for r in steps if r["rank"] == 0]
    first = min((r["time"] for r in rank0 if r["world_size"] == after and r["time"] > event), default=None)
    if first is None:
        return None
    last = max((r["time"] for r in rank0 if r["world_size"] == before and r["time"] < first), default=None)
    return None if last is None else round(first - last, 4)


def _timeline(cluster: Cluster, node: str, event: float) -> dict | None:
    """``node``'s recovery timeline of the first recovery noticed after ``event``, and which way its
    group came (``group``: reconfigured or rebuilt)."""
    timelines = [r for r in cluster.record.read() if r.get("event") == "recovery_timeline"
                 and r.get("node") == node and r.get("noticed", 0) > event]
    if not timelines:
        return None
    timeline = min(timelines, key=lambda r: r["noticed"])
    group = "reconfigured" if "group_reconfigured" in timeline else "rebuilt" if "group_built" in timeline else None
    return {"group": group, **{k: v for k, v in timeline.items()
                               if k in ("torn_down", "sealed", "group_built", "group_reconfigured",
                                        "state_synced", "first_step")}}


def one_job(variant: str, workdir: Path, etcd: EtcdClient, caps: Caps) -> dict:
    """The three events of one job (see the module docstring); a cap that runs out is a result."""
    cluster = Cluster("elasticctl-hot", workdir, [*EVENT_TRAINING, "--record-params"], etcd)
    if variant == "rebuilt":
        cluster.env = dict(REBUILD_ENV)
    result: dict = {"variant": variant, "events": {}}
    try:
        started = time.time()
        for name in ("a", "b"):
            cluster.start(name, timeout=caps.start)
        if cluster.wait_world(2, {"a", "b"}, started, caps.start) is None:
            result["error"] = f"no world of 2 within {caps.start:g} s"
            return result
        plan = ((("join", 2, 3), lambda: cluster.start("c"), {"a", "b", "c"}),
                (("leave", 3, 2), lambda: cluster.nodes["c"].signal_tree(signal.SIGTERM), {"a", "b"}),
                (("kill", 2, 1), lambda: cluster.nodes["b"].signal_tree(signal.SIGKILL), {"a"}))
        for (event, before, after), act, nodes in plan:
            settled = time.time()
            # a few steps at the world the event starts from
            wait_for(lambda: len([r for r in cluster.record.steps(settled, before) if r["rank"] == 0]) >= 20,
                     caps.recover, interval=0.01)
            at = time.time()
            act()
            if cluster.wait_world(after, nodes, at, caps.recover) is None:
                result["events"][event] = {"pause_s": None, "outcome": f"no world of {after} within {caps.recover:g} s"}
                return result
            result["events"][event] = {"pause_s": _gap(cluster.record.steps(), at, before, after),
                                       "timeline": wait_for(lambda: _timeline(cluster, "a", at), 30)}
        steps = cluster.record.steps()
        try:
            accounting.check_replicas(steps)
            result["replicas_identical"] = True
        except accounting.AccountingError as exc:
            result["replicas_identical"] = False
            result["error"] = str(exc)
        return result
    finally:
        cluster.close()


def run(repeats: int, root: Path, etcd: EtcdClient, caps: Caps, report=print) -> dict:
    """``repeats`` jobs of each variant, alternating which goes first."""
    samples: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
    for repeat in range(repeats):
        order = VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            sample = one_job(variant, root / f"reconfigure-{variant}-{repeat}", etcd, caps)
            samples[variant].append(sample)
            report(f"reconfigure {variant} #{repeat + 1}: " + ", ".join(
                f"{event} {info.get('pause_s')} s ({(info.get('timeline') or {}).get('group')})"
                for event, info in sample["events"].items()))
    return {"repeats": repeats, "variants": samples}


SLOW_PAUSE_S = 0.2  # a pause above this is counted apart: on 2 cores they fall in two groups


def _medians(samples: list[dict], event: str, phase: str) -> float | None:
    values = [(s["events"].get(event) or {}).get("timeline", {}) or {} for s in samples]
    found = [v[phase] for v in values if isinstance(v.get(phase), (int, float))]
    return round(statistics.median(found), 3) if found else None


def _slow(samples: list[dict], event: str) -> str:
    pauses = [(s["events"].get(event) or {}).get("pause_s") for s in samples if event in s["events"]]
    return f"{sum(1 for p in pauses if p is not None and p > SLOW_PAUSE_S)}/{len(pauses)}"


def section(results: dict, cell, ratio) -> list[str]:
    """BENCHMARKS.md's table of this bench (``cell``/``ratio``: bench/report.py's formatting); empty
    for results without it."""
    entry = results["scenarios"].get("reconfigure")
    if not entry:
        return []
    variants = entry["variants"]
    labels = {"join": "a node joins: running workers' pause", "leave": "a node leaves (SIGTERM): pause",
              "kill": "a node is SIGKILLed: pause (a failure rebuilds in both)"}
    rows = []
    for event in EVENTS:
        pauses = {v: [(s["events"].get(event) or {}).get("pause_s") for s in variants[v]] for v in VARIANTS}
        groups = {v: sorted({((s["events"].get(event) or {}).get("timeline") or {}).get("group") or "?"
                             for s in variants[v] if event in s["events"]}) for v in VARIANTS}
        rows.append(f"| {labels[event]} | {cell(pauses['reconfigured'], None, digits=3)} "
                    f"({', '.join(groups['reconfigured'])}) | {cell(pauses['rebuilt'], None, digits=3)} "
                    f"({', '.join(groups['rebuilt'])}) | {ratio(pauses['reconfigured'], pauses['rebuilt'], None)} |")
    identical = all(s.get("replicas_identical") for v in VARIANTS for s in variants[v])
    group_seconds = {v: {e: _medians(variants[v], e, "group_reconfigured" if v == "reconfigured" and e != "kill"
                                     else "group_built") for e in EVENTS} for v in VARIANTS}
    return [
        "### Hot mode's process group across membership changes: reconfigured in place or built anew",
        "",
        (f"`bench/reconfigure.py`: 2 nodes × 1 worker in hot mode, then node c joins, leaves (SIGTERM) and "
         f"node b is SIGKILLed; {entry['repeats']} jobs per variant, interleaved. *Reconfigured*: the "
         "default (one process group per worker, reconfigured in place for an agreed change; a failure "
         "rebuilds it); *rebuilt*: `ELASTICCTL_REBUILD_GROUPS=1`, a new group every generation. Pause: rank "
         "0's gap in step times across the change (s); in brackets how the survivor's group came."),
        "",
        "| event | reconfigured | rebuilt | ratio |",
        "|---|---|---|---|",
        *rows,
        "",
        ("Median seconds from the change seen to the group ready (the survivor's timeline): "
         + "; ".join(f"{event}: {group_seconds['reconfigured'][event]} reconfigured vs "
                     f"{group_seconds['rebuilt'][event]} rebuilt" for event in EVENTS)
         + f". Pauses over {SLOW_PAUSE_S:g} s (before the members waited for rank 0's store to listen, a "
           "member that reached it first slept TCPStore's own 0.3-0.7 s backoff, in about half of the changes): "
         + "; ".join(f"{event} {_slow(variants['reconfigured'], event)} reconfigured, "
                     f"{_slow(variants['rebuilt'], event)} rebuilt" for event in EVENTS)
         + f". Replicas identical at every step: {'yes' if identical else 'NO'}."),
        "",
    ]
