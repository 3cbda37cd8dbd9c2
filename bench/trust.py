"""Benchmark: what trusting the hardware less costs, and how fast it acts.

* **Admission checks** (``elasticctl up``/``join`` before a node registers): each check's seconds,
  from :func:`elasticctl.doctor.run_checks` as ``join`` runs it (quick, against a live job's spec,
  etcd and checkpoint directory), median of ``repeats`` runs, and their total.
* **The checks' own cost**, in process, median of 20 timings each: the replica check's parameter
  checksum (:func:`parameters_digest`) and the non-finite check's passes (a min/max per bucket
  before the all-reduce, and over the gradients applied), for the trainer's model and for a
  25M-parameter one; with the steady rate below, the share of a step each costs.
* **End to end: steady steps/s with the replica check every 100 steps and with it off**
  (``--replica-check 0``), hot and restart mode, ``repeats`` interleaved jobs each (rotated order),
  medians; 3 nodes x 1 worker, bench/scenarios.py's steady trainer.
* **A flipped bit, evicted, with a spare**: hot mode, 3 nodes and a spare, ``--replica-check 5
  --evict-diverged 1 --spares 1``, rank 1 flips one bit after step 40 (``trainers/mlp.py
  --flip-bit``): steps from the flip to the event naming its node, and seconds from that event to
  the first step of the world back at 3 with the spare in it.

A zero-false-alarm soak is bench/chaos.py's (every soak fails on a replica_diverged or non_finite
event; ``--replica-check 10`` checks every 10 steps).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from bench.cluster import Cluster, wait_for
from bench.scenarios import EVENT_TRAINING, FIRST_NODES, Caps, _start_world3, steady
from elasticctl.etcd.client import EtcdClient
from elasticctl.job.events import EventLog
from elasticctl.job.keys import JobKeys
from elasticctl.job.records import EventKind
from elasticctl.job.registry import Registry
from elasticctl.train.watches.non_finite import finite_flag, gradients_finite
from elasticctl.train.watches.replica_check import parameters_digest

FLIP_STEP, CHECK = 40, 5
ADMISSION_TARGET_S = 3.0
COST_TARGET = 0.01      # the replica check every 100 steps: <= 1 % of steady steps/s
BACK_TARGET_S = 1.0     # with eviction and a spare: the world back at full size within 1 s


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# -- admission ----------------------------------------------------------------------------------

def admission(root: Path, etcd: EtcdClient, repeats: int) -> dict:
    """Each admission check's seconds as `join` runs them against a live job (node a trains)."""
    from elasticctl import doctor

    checkpoints = root / "admission-checkpoints"
    cluster = Cluster("elasticctl-hot", root / "admission", EVENT_TRAINING, etcd,
                      up_args=("--checkpoint-dir", str(checkpoints)))
    try:
        cluster.start("a", timeout=120)
        if not cluster.wait_world(1, {"a"}, 0.0, 120):
            return {"error": "node a did not train within 120 s"}
        registry = Registry(etcd, cluster.job)
        spec = registry.read_spec()
        runs = []
        for _ in range(repeats):
            began = time.monotonic()
            report = doctor.run_checks(settings=etcd.settings, client=etcd, etcd_error=None, registry=registry,
                                       checkpoint_dir=spec.checkpoint_dir, local_addr="127.0.0.1", quick=True,
                                       spec=spec)
            runs.append({"total_s": time.monotonic() - began, "seconds": dict(report.seconds),
                         "failed": [c.name for c in report.failed]})
        names = list(runs[0]["seconds"])
        return {"repeats": repeats, "total_s": _median([r["total_s"] for r in runs]),
                "per_check_s": {name: _median([r["seconds"].get(name) for r in runs]) for name in names},
                "failed": sorted({name for r in runs for name in r["failed"]})}
    finally:
        cluster.close()


# -- the checks' own cost, in process -------------------------------------------------------------

def _timed(fn, times: int = 20) -> float:
    samples = []
    for _ in range(times):
        began = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples)


def check_costs() -> dict:
    """Seconds per replica checksum and per step's non-finite passes, on this CPU."""
    models = {"trainer (mlp, hidden 64)": nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)),
              "25M parameters": nn.Sequential(*(nn.Linear(2500, 2500) for _ in range(4)))}
    out = {}
    for name, model in models.items():
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        buckets = flat.split(25 * 1024 * 1024 // 4)  # DDP's default 25 MiB buckets
        out[name] = {
            "parameters": sum(p.numel() for p in model.parameters()),
            "replica_checksum_s": _timed(lambda: parameters_digest(model)),
            "non_finite_per_step_s": _timed(lambda: ([finite_flag(b) for b in buckets],
                                                     gradients_finite(model.parameters()))),
        }
    return out


# -- end to end: steady steps/s with and without the replica check ----------------------------------

def replica_cost(root: Path, etcd: EtcdClient, caps: Caps, repeats: int) -> dict:
    configs = [(system, check) for system in ("elasticctl", "elasticctl-hot") for check in (100, 0)]
    samples: dict[str, list] = {f"{system} check {check}": [] for system, check in configs}
    for repeat in range(repeats):
        order = configs[repeat % len(configs):] + configs[:repeat % len(configs)]
        for system, check in order:
            key = f"{system} check {check}"
            result = steady(system, root / f"steady-{system}-{check}-{repeat}", etcd, caps,
                            up_args=("--replica-check", str(check)))
            samples[key].append(result.get("steps_per_s"))
    medians = {key: _median(values) for key, values in samples.items()}
    ratios = {}
    for system in ("elasticctl", "elasticctl-hot"):
        on, off = medians[f"{system} check 100"], medians[f"{system} check 0"]
        ratios[system] = None if not on or not off else on / off
    return {"repeats": repeats, "samples": samples, "medians": medians, "ratio_on_to_off": ratios}


# -- a flipped bit, evicted, a spare in its place ------------------------------------------------

def evict_with_spare(root: Path, etcd: EtcdClient, caps: Caps, repeats: int) -> list[dict]:
    runs = []
    for repeat in range(repeats):
        cluster = Cluster("elasticctl-hot", root / f"evict-{repeat}", [*EVENT_TRAINING, "--flip-bit", f"{FLIP_STEP}:1"],
                          etcd, nnodes="2:3", up_args=("--replica-check", str(CHECK), "--evict-diverged", "1",
                                                       "--spares", "1"))
        try:
            if _start_world3(cluster, caps) is None:
                runs.append({"error": "no world of 3"})
                continue
            cluster.start("d", timeout=caps.start)  # the spare: waits warm beside the full world
            flips = wait_for(lambda: [r for r in cluster.record.read() if r.get("event") == "bit_flipped"],
                             caps.recover, interval=0.05)
            if not flips:
                runs.append({"error": "the bit did not flip"})
                continue
            victim = flips[0]["node"]
            keys = JobKeys(cluster.job)
            evicted = wait_for(lambda: [e for e in EventLog(etcd, keys).read()
                                        if e.kind is EventKind.REPLICA_DIVERGED and "evicted" in (e.reason or "")],
                               caps.recover, interval=0.05)
            if not evicted:
                runs.append({"error": "not evicted", "victim": victim})
                continue
            event = evicted[0]
            full = (set(FIRST_NODES) - {victim}) | {"d"}
            back_at = cluster.wait_world(3, full, event.time, caps.recover)
            runs.append({"victim": victim, "evicted_node": event.node, "flip_step": FLIP_STEP,
                         "named_at_step": event.step, "steps_to_named": event.step - FLIP_STEP,
                         "back_at_full_world_s": None if back_at is None else back_at - event.time})
        finally:
            cluster.close()
    return runs


def run(root: Path, etcd: EtcdClient, caps: Caps, repeats: int) -> dict:
    started = time.monotonic()
    result = {"check_costs": check_costs(), "admission": admission(root, etcd, repeats),
              "evict_with_spare": evict_with_spare(root, etcd, caps, max(3, repeats // 2)),
              "replica_cost": replica_cost(root, etcd, caps, repeats)}
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


# -- the report ---------------------------------------------------------------------------------

def _fmt(value, digits: int = 3, unit: str = "") -> str:
    return "—" if value is None else f"{value:.{digits}f}{unit}"


def section(results: dict) -> list[str]:
    entry = results["scenarios"].get("trust")
    if not entry:
        return []
    lines = ["## Trusting the hardware less: admission checks, replica check, non-finite check", "",
             "`bench/trust.py` (cells: medians).", ""]
    adm = entry.get("admission") or {}
    if adm.get("per_check_s"):
        total = adm["total_s"]
        lines += [f"**Admission checks** as `join` runs them against a live job ({adm['repeats']} runs): "
                  f"{_fmt(total, 2, ' s')} in all (target ≤ {ADMISSION_TARGET_S:g} s: "
                  f"{'met' if total <= ADMISSION_TARGET_S else 'missed'}).", "",
                  "| check | seconds |", "|---|---|",
                  *(f"| {name} | {_fmt(s, 3)} |" for name, s in adm["per_check_s"].items()), ""]
    costs = entry.get("check_costs") or {}
    cost = entry.get("replica_cost") or {}
    medians = cost.get("medians", {})
    if costs:
        lines += ["**The checks' own cost**, in process on this CPU (median of 20): the replica checksum "
                  "runs every K steps, the non-finite passes every step.", "",
                  "| model | parameters | replica checksum (ms) | share of a step at K = 100 | non-finite passes per "
                  "step (ms) |", "|---|---|---|---|---|"]
        rate = medians.get("elasticctl-hot check 0")
        for name, c in costs.items():
            share = "—" if not rate or "trainer" not in name else f"{c['replica_checksum_s'] * rate / 100:.2%}"
            lines.append(f"| {name} | {c['parameters']:,} | {c['replica_checksum_s'] * 1e3:.3f} | {share} | "
                         f"{c['non_finite_per_step_s'] * 1e3:.3f} |")
        lines.append("")
    trainer = next((c for name, c in costs.items() if "trainer" in name), None)
    rate = medians.get("elasticctl-hot check 0")
    if trainer and rate:
        share = trainer["replica_checksum_s"] * rate / 100
        lines += [f"Target, the replica check every 100 steps ≤ {COST_TARGET:.0%} of steady steps/s: its checksum "
                  f"takes {share:.2%} of the trainer's steps at {rate:.0f} steps/s, measured in process "
                  f"({'met' if share <= COST_TARGET else 'missed'}; the all-gather of two integers per worker "
                  "beside it is one of the boundary's small collectives). The end-to-end medians below cannot "
                  "resolve 1 % when their spread is wider (see the run's load above).", ""]
    if medians:
        ratios = cost["ratio_on_to_off"]
        lines += [f"**Steady steps/s with the replica check every 100 steps and off** ({cost['repeats']} "
                  "interleaved jobs each, 3 nodes × 1 worker):", "",
                  "| mode | check every 100 | check off | ratio |", "|---|---|---|---|"]
        for system, mode in (("elasticctl", "restart"), ("elasticctl-hot", "hot")):
            samples = cost["samples"]
            spread = lambda k: (f"{_fmt(medians[k], 1)} ({_fmt(min(v for v in samples[k] if v), 1)}–"  # noqa: E731
                                f"{_fmt(max(v for v in samples[k] if v), 1)})" if any(samples[k]) else "—")
            lines.append(f"| {mode} | {spread(f'{system} check 100')} | {spread(f'{system} check 0')} | "
                         f"{_fmt(ratios[system], 3)} |")
        lines.append("")
    runs = [r for r in entry.get("evict_with_spare") or [] if "error" not in r]
    if entry.get("evict_with_spare"):
        back = _median([r["back_at_full_world_s"] for r in runs])
        steps = [r["steps_to_named"] for r in runs]
        lines += [f"**A flipped bit, evicted, a spare in its place** (hot, `--replica-check {CHECK} --evict-diverged 1 "
                  f"--spares 1`, {len(entry['evict_with_spare'])} runs, {len(runs)} measured): named "
                  f"{', '.join(map(str, steps)) or '—'} steps after the flip (≤ {CHECK}: "
                  f"{'met' if steps and max(steps) <= CHECK else 'missed'}); the world back at 3 with the spare "
                  f"{_fmt(back, 2, ' s')} after the eviction event (target ≤ {BACK_TARGET_S:g} s: "
                  f"{'met' if back is not None and back <= BACK_TARGET_S else 'missed'}).", ""]
    return lines


def main() -> None:
    """``python -m bench.trust [REPEATS [PART ...]]``: this benchmark alone (PART: check_costs,
    admission, evict_with_spare, replica_cost; default all), its JSON to stdout."""
    import json
    import sys

    from elasticctl.embedded_etcd import EmbeddedEtcd

    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    parts = sys.argv[2:] or ["check_costs", "admission", "evict_with_spare", "replica_cost"]
    root = Path(tempfile.mkdtemp(prefix="bench-trust-"))
    caps = Caps(steady_window=8.0)
    runs = {"check_costs": lambda etcd: check_costs(), "admission": lambda etcd: admission(root, etcd, repeats),
            "evict_with_spare": lambda etcd: evict_with_spare(root, etcd, caps, repeats),
            "replica_cost": lambda etcd: replica_cost(root, etcd, caps, repeats)}
    with EmbeddedEtcd(data_dir=str(root / "etcd"), client_port=0, peer_port=0) as server, \
            EtcdClient(server.client_settings()) as etcd:
        result = {part: runs[part](etcd) for part in parts}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
