"""Benchmark scenarios: each runs one job of one system once and returns its raw measurements.

Times come from the trainer's record (``time`` of each completed step, wall
clock), compared with the wall-clock instant the bench sent a signal or started
a node. Waits are on record lines, capped; a cap that runs out is a result
("no recovery within N s"), not an error.
"""

from __future__ import annotations

import dataclasses
import random
import signal
import time
from pathlib import Path

from bench.cluster import Cluster, wait_for
from elasticctl.etcd.client import EtcdClient
from elasticctl.job.keys import JobKeys
from elasticctl.train.recovery.timeline import RECOVERY_PHASES

# --step-sleep keeps event runs near 15 steps/s, so agents and etcd are not starved of
# the 2 cores and the steps/s plot stays readable; steady state runs without it.
EVENT_TRAINING = ["--steps", "10000000", "--step-sleep", "0.05", "--log-every", "0"]
STEADY_TRAINING = ["--steps", "10000000", "--log-every", "0"]
FIRST_NODES = ("a", "b", "c")


@dataclasses.dataclass(frozen=True)
class Caps:
    """How long to wait for each outcome before reporting that it did not happen."""

    start: float = 120.0      # cold start until all 3 nodes train at world 3
    recover: float = 90.0     # crash or scale-up until the new world trains
    freeze: float = 120.0     # SIGSTOP until the survivors train again
    steady_window: float = 15.0  # seconds of world-3 training timed for steps/s
    checkpoint_every: int = 20


def _start_world3(cluster: Cluster, caps: Caps) -> float | None:
    """Start nodes a, b, c (a first); seconds from the first start to all three training at world 3."""
    started = time.time()
    for name in FIRST_NODES:
        cluster.start(name, timeout=caps.start)
    reached = cluster.wait_world(3, set(FIRST_NODES), started, caps.start)
    return reached - started if reached else None


def _train_a_while(cluster: Cluster, world: int, since: float, caps: Caps, seed: str) -> None:
    """Let rank 0 train at least K steps at ``world``, up to a global step at a pseudo-random offset of the
    checkpoint interval: a checkpoint exists, and both systems meet the event at the same point of it."""
    every = caps.checkpoint_every
    offset = random.Random(seed).randrange(every)

    def there() -> bool:
        steps = [r["step"] for r in cluster.record.steps(since, world) if r["rank"] == 0]
        return bool(steps) and steps[-1] >= steps[0] + every and steps[-1] % every == offset

    wait_for(there, caps.recover, interval=0.01)


def _recovery(cluster: Cluster, event: float, world: int, survivors: set[str], cap: float) -> dict:
    """Seconds from ``event`` to the first step at ``world``, and the steps trained again after resuming.

    Re-done counts from the last step recorded before the resumption, not before the event: in
    hot mode the survivors may still finish the step in flight after the signal, and a resumption
    past it must not read as a negative count.
    """
    def job_ended() -> bool:  # e.g. plain torchrun after losing the c10d store host: nothing to wait for
        return all(cluster.nodes[n].process.poll() is not None for n in survivors)

    resumed = cluster.wait_world(world, survivors, event, cap, give_up=job_ended)
    if resumed is None:
        return {"seconds": None, "cap_s": cap, "redone_steps": None,
                "outcome": "job ended" if job_ended() else f"no recovery within {cap:g} s"}
    steps = cluster.record.steps()
    last_before = max(r["step"] for r in steps if r["time"] < resumed)
    first_after = min(r["step"] for r in steps if r["time"] > event and r["world_size"] == world)
    return {"seconds": resumed - event, "cap_s": cap, "outcome": "recovered",
            "last_step_before": last_before, "first_step_after": first_after,
            "redone_steps": last_before + 1 - first_after, **_phases(cluster, event, world)}


def _phases(cluster: Cluster, event: float, world: int) -> dict:
    """Hot mode: where the seconds from ``event`` to the first step went, from rank 0's
    ``recovery_timeline`` (elasticctl/train/recovery/timeline.py): each phase's end, seconds since the event."""
    timelines = [r for r in cluster.record.read() if r.get("event") == "recovery_timeline"
                 and r.get("noticed", 0) >= event and r.get("rank") == 0 and r.get("world_size") == world]
    if not timelines:
        return {}
    first = min(timelines, key=lambda r: r["noticed"])
    since_noticed = {phase: first[phase] for phase in RECOVERY_PHASES if phase in first}
    return {"phases": {"fault_seen": round(first["noticed"] - event, 3),
                       **{phase: round(first["noticed"] - event + s, 3) for phase, s in since_noticed.items()}}}


ADMISSION = ("pause_s", "joiner_after_initialized_s", "joiner_after_process_start_s")


def _admission(cluster: Cluster, added: float) -> dict:
    """What a scale-up cost the running workers and the joiner, once every node trained at world 3.

    ``pause_s``: the gap in rank 0's step times across the change, from its last step at world 2
    to its first at world 3 (for a restart, the whole restart). ``joiner_*``: node d's first step
    at world 3 minus its worker's ``start`` record (``initialized``: its first generation formed;
    ``process_started``). The start line names no node, so it is found by d's rank at world 3:
    the last start of that rank after ``added`` and before d's first step.
    """
    lines = cluster.record.read()
    steps = [r for r in lines if "event" not in r]
    by_time = {"key": lambda r: r["time"], "default": None}  # a line lost to interleaved writes: no value
    first3 = min((r for r in steps if r["rank"] == 0 and r["world_size"] == 3 and r["time"] > added), **by_time)
    joiner = min((r for r in steps if r.get("node") == "d" and r["world_size"] == 3 and r["time"] > added),
                 **by_time)
    before = [r["time"] for r in steps if first3 and r["rank"] == 0 and r["world_size"] == 2
              and r["time"] < first3["time"]]
    starts = [r for r in lines if joiner and r.get("event") == "start" and r["rank"] == joiner["rank"]
              and r["world_size"] == 3 and added < r["time"] <= joiner["time"]]
    start = max(starts, **by_time)
    return {"pause_s": first3["time"] - max(before) if before else None,
            "joiner_after_initialized_s": joiner["time"] - start["initialized"] if start else None,
            "joiner_after_process_start_s": joiner["time"] - start["process_started"] if start else None}


def _timeline(cluster: Cluster, origin: float) -> list[list[float]]:
    """[seconds since origin, step, world size] of every rank-0 step: the plot's raw data."""
    return [[round(r["time"] - origin, 3), r["step"], r["world_size"]]
            for r in cluster.record.steps() if r["rank"] == 0]


def lifecycle(system: str, workdir: Path, etcd: EtcdClient, caps: Caps) -> dict:
    """One job through three events: SIGKILL node c, start node d, SIGSTOP node b.

    Each event starts from a world of 3 (2 for the scale-up), so one cold start
    serves three measurements; the record keeps the whole story for the plot.
    The scale-up also reports the running workers' pause and the joiner's start-up
    (:func:`_admission`): what hot mode changes.
    """
    args = [*EVENT_TRAINING, "--checkpoint-dir", str(workdir / "checkpoints"),
            "--checkpoint-every", str(caps.checkpoint_every)]
    cluster = Cluster(system, workdir, args, etcd)
    seed = workdir.name.replace(system, "")  # the same event points for both systems in one repeat
    origin = time.time()
    result: dict = {"events": {}}
    try:
        result["cold_start_s"] = _start_world3(cluster, caps)
        if result["cold_start_s"] is None:
            result["error"] = f"no world of 3 within {caps.start:g} s"
            return result

        _train_a_while(cluster, 3, origin, caps, f"{seed} crash")
        killed = result["events"]["sigkill c"] = time.time()
        cluster.nodes["c"].signal_tree(signal.SIGKILL)
        result["crash"] = _recovery(cluster, killed, 2, {"a", "b"}, caps.recover)
        if result["crash"]["seconds"] is None:
            return result

        _train_a_while(cluster, 2, killed, caps, f"{seed} scale-up")
        added = result["events"]["start d"] = time.time()
        cluster.start("d")
        grown = cluster.wait_world(3, {"a", "b", "d"}, added, caps.recover)
        result["scale_up"] = {"seconds": grown - added if grown else None, "cap_s": caps.recover,
                              "outcome": "recovered" if grown else f"no world of 3 within {caps.recover:g} s",
                              **(_admission(cluster, added) if grown else dict.fromkeys(ADMISSION))}
        if grown is None:
            return result

        _train_a_while(cluster, 3, added, caps, f"{seed} freeze")
        frozen = result["events"]["sigstop b"] = time.time()
        cluster.nodes["b"].signal_tree(signal.SIGSTOP)
        result["freeze"] = _recovery(cluster, frozen, 2, {"a", "d"}, caps.freeze)
        return result
    finally:
        result["events"] = {name: round(t - origin, 3) for name, t in result["events"].items()}
        result["timeline"] = _timeline(cluster, origin)
        cluster.close()


def crash_host(system: str, workdir: Path, etcd: EtcdClient, caps: Caps) -> dict:
    """SIGKILL node a: it hosts torchrun's c10d store; under elasticctl it is the node that ran `up`."""
    args = [*EVENT_TRAINING, "--checkpoint-dir", str(workdir / "checkpoints"),
            "--checkpoint-every", str(caps.checkpoint_every)]
    cluster = Cluster(system, workdir, args, etcd)
    try:
        cold_start = _start_world3(cluster, caps)
        if cold_start is None:
            return {"cold_start_s": None, "error": f"no world of 3 within {caps.start:g} s"}
        _train_a_while(cluster, 3, time.time() - cold_start, caps, workdir.name.replace(system, ""))
        killed = time.time()
        cluster.nodes["a"].signal_tree(signal.SIGKILL)
        return {"cold_start_s": cold_start, **_recovery(cluster, killed, 2, {"b", "c"}, caps.recover)}
    finally:
        cluster.close()


TORCHRUN_SPARE_WARMUP = 10.0  # seconds: torchrun shows no "waiting as a spare" to wait on


def _spare_waiting(cluster: Cluster, node: str, started: float) -> bool:
    """Whether ``node`` waits beside the full world: its declaration is in the rendezvous (elasticctl
    restart mode: the agent's; hot mode: its worker's, which has imported torch and built its
    model). torchrun shows no such state: its spare is given a fixed warm-up instead."""
    if not cluster.elastic:
        return time.time() - started >= TORCHRUN_SPARE_WARMUP
    keys = JobKeys(cluster.job)
    key = keys.generations().rdzv_node(f"{node}.0") if cluster.system == "elasticctl-hot" else keys.rdzv_node(node)
    return cluster.etcd.get(key) is not None


def spare(system: str, workdir: Path, etcd: EtcdClient, caps: Caps) -> dict:
    """SIGKILL node c while node d waits as a spare beyond --nnodes MAX (1:3) → seconds to the first
    step back at world 3 (a, b and d). Hot mode admits the warm spare at the survivors' own
    re-formation; restart mode and torchrun restart every worker, the spare's included."""
    args = [*EVENT_TRAINING, "--checkpoint-dir", str(workdir / "checkpoints"),
            "--checkpoint-every", str(caps.checkpoint_every)]
    cluster = Cluster(system, workdir, args, etcd, up_args=("--spares", "1") if system != "torchrun" else ())
    try:
        cold_start = _start_world3(cluster, caps)
        if cold_start is None:
            return {"cold_start_s": None, "error": f"no world of 3 within {caps.start:g} s"}
        added = time.time()
        cluster.start("d")
        if not wait_for(lambda: _spare_waiting(cluster, "d", added), caps.start):
            return {"cold_start_s": cold_start, "error": f"node d did not wait as a spare within {caps.start:g} s"}
        _train_a_while(cluster, 3, added, caps, workdir.name.replace(system, ""))
        killed = time.time()
        cluster.nodes["c"].signal_tree(signal.SIGKILL)
        return {"cold_start_s": cold_start, **_recovery(cluster, killed, 3, {"a", "b", "d"}, caps.recover)}
    finally:
        cluster.close()


def steady(system: str, workdir: Path, etcd: EtcdClient, caps: Caps, up_args: tuple[str, ...] = ()) -> dict:
    """Steps/s of rank 0 over ``caps.steady_window`` seconds at world 3, with no events and no checkpoints
    (``up_args``: elasticctl's options, e.g. --replica-check)."""
    cluster = Cluster(system, workdir, STEADY_TRAINING, etcd, up_args=up_args)
    try:
        cold_start = _start_world3(cluster, caps)
        if cold_start is None:
            return {"cold_start_s": None, "steps_per_s": None, "error": f"no world of 3 within {caps.start:g} s"}
        since = cluster.last_time() + 1.0  # skip the first second: DDP bucket rebuild, warm caches

        def window():
            rank0 = [r for r in cluster.record.steps(since) if r["rank"] == 0]
            return rank0 if rank0 and rank0[-1]["time"] - rank0[0]["time"] >= caps.steady_window else None

        rank0 = wait_for(window, caps.steady_window * 4 + 30)
        if rank0 is None:
            return {"cold_start_s": cold_start, "steps_per_s": None, "error": "no steady window"}
        worlds = {r["world_size"] for r in rank0}
        return {"cold_start_s": cold_start, "steps": len(rank0) - 1,
                "seconds": rank0[-1]["time"] - rank0[0]["time"],
                "steps_per_s": (len(rank0) - 1) / (rank0[-1]["time"] - rank0[0]["time"]),
                "world_sizes": sorted(worlds)}
    finally:
        cluster.close()

