"""Goodput under repeated node loss: a training node SIGKILLed every K s, back T s later, for W s.

    python -m bench.run --quick --only goodput    # W 60 s, a kill every 20 s: ~8 min on 2 cores
    python -m bench.run --full --only goodput     # W 180 s, a kill every 30 s: ~16 min
    python -m bench.goodput --window 45 --kill-every 15 --healthy 8 --systems elasticctl-hot-spare
                                                  # a shortened run of its own: its own etcd, the table
    python -m bench.goodput --nodes 3 5 ...       # the same at 3 and at 5 training nodes (default: 3)

Four systems, one after another in the same run (their order rotated per repeat): plain torchrun
(c10d, ``--max-restarts`` large enough never to run out), elasticctl restart mode, hot mode, and
hot mode with ``--spares 1`` and the node after the training nodes started as the spare. Each job: N
training nodes x 1 worker (N = 3 unless told; bench/run.py runs 3 and 5), ``--nnodes 1:N``,
trainers/mlp.py with the event scenarios' training (bench/scenarios.py, ~15 steps/s), checkpoints
every K steps, ``--record``. A crash cost that depends on the job's shape (hot mode once waited the
node TTL beyond 3 workers) stays hidden at one shape: hence more than one.

Per shape and system, in one job (at 3 nodes: a, b, c, the spare d; at 5: a to e, the spare f):

1. cold start of the training nodes, a first (with the spare: then the spare, until it waits as one);
2. a warm-up, then a healthy phase of H s: the system's own healthy samples/s are the samples
   of the steps trained in it ÷ H (no fault yet, so nothing in it is trained twice);
3. the window of W s (:func:`kill_schedule`): at 0, K, 2K, ... one training node other than a
   (the first: `up`, torchrun's c10d store host) is SIGKILLed with its whole process tree, and
   T s later the same node is started again (``elasticctl join``, torchrun's same line; with
   the spare it becomes the next spare). The victim is the training node that has trained
   longest since its last start (:func:`choose_victim`): the nodes other than a take turns (at 3
   nodes b and c alternate), and with the spare each kill takes the next of them and the spare.
4. goodput = samples whose last execution falls in the window ÷ (healthy samples/s x W). A
   step's last execution is its newest record line (:func:`last_executions`): a step trained
   again after a restart from a checkpoint counts once, where it was trained last.

Also per system: the seconds from each kill to the first step at full world again
(:func:`back_to_full_world`; without the spare this includes the T s the node is away), and
whether the job lost a sample (bench/accounting.py's check on the whole record).

Boundaries: steps trained just before the window and re-done in it (restart mode, torchrun: from
the last checkpoint) count in the window, where their last execution is; steps at the window's
end that a later fault would have thrown away count too. Both are at most one checkpoint
interval (K steps), about one second.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench import accounting
from bench.cluster import Cluster, wait_for
from bench.scenarios import EVENT_TRAINING, FIRST_NODES, Caps, _spare_waiting
from elasticctl.embedded_etcd import EmbeddedEtcd
from elasticctl.etcd.client import EtcdClient

KILL, START = "kill", "start"
FIRST_NODE = FIRST_NODES[0]
# Training nodes of a job unless told: the shape of the other job scenarios (bench/scenarios.py).
DEFAULT_NODES = len(FIRST_NODES)
MIN_NODES = 3  # two nodes would leave a world of one after each kill: no survivors to re-form
DATASET_SIZE = 4096  # samples per epoch (mlp's default, named here for the sample check)
TORCHRUN_MAX_RESTARTS = 1000  # each kill and each return costs torchrun's survivors a restart
TRAINING_LOOKBACK_S = 2.0  # a node with a step line this recent counts as training

# Label -> (bench.cluster system, spare nodes); the order is the report's.
SYSTEMS: dict[str, tuple[str, int]] = {
    "torchrun": ("torchrun", 0),
    "elasticctl": ("elasticctl", 0),
    "elasticctl-hot": ("elasticctl-hot", 0),
    "elasticctl-hot-spare": ("elasticctl-hot", 1),
}


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The fault schedule and the phases around it, in seconds."""

    window_s: float = 180.0
    kill_every_s: float = 30.0
    back_after_s: float = 10.0
    healthy_s: float = 20.0  # the healthy phase before the window, for the system's own rate
    warmup_s: float = 2.0  # after world 3, before the healthy phase: DDP's bucket rebuild, warm caches


@dataclasses.dataclass(frozen=True)
class Action:
    offset_s: float  # seconds after the window's start
    kind: str  # KILL or START
    kill: int  # which kill (0, 1, ...): a START brings back that kill's node


# -- the arithmetic: pure functions ------------------------------------------------------------


def node_names(nodes: int, spares: int = 0) -> tuple[list[str], list[str]]:
    """The training nodes (a, b, ... in start order, a first: the one never killed) and the spares,
    named by the letters after them."""
    if not MIN_NODES <= nodes or nodes + spares > 26:
        raise ValueError(f"{nodes} training nodes and {spares} spare(s): the benchmark runs {MIN_NODES} to "
                         f"{26 - spares} training nodes (one letter each)")
    names = [chr(ord("a") + index) for index in range(nodes + spares)]
    return names[:nodes], names[nodes:]


def shape_key(nodes: int) -> str:
    """The results' key of a job shape: ``"5x1"`` for 5 nodes x 1 worker (bench/shapes.py's names)."""
    return f"{nodes}x1"


def plan_jobs(shapes: tuple[int, ...], systems: list[str], repeats: int) -> list[tuple[int, int, str]]:
    """(training nodes, repeat, system) of every job, in the order they run: one shape after another
    (a shape's jobs side by side in time, where the machine's load is most alike), each shape's
    repeats with the systems' order rotated. ValueError for a shape given twice or one that cannot
    run (:func:`node_names`, with the systems' spares), before any job starts."""
    if len(set(shapes)) != len(shapes):
        raise ValueError(f"a shape is given twice in {list(shapes)}")
    for nodes in shapes:
        node_names(nodes, max((SYSTEMS[system][1] for system in systems), default=0))
    return [(nodes, repeat, system) for nodes in shapes for repeat in range(repeats)
            for system in rotated(systems, repeat)]


def kill_schedule(window_s: float, kill_every_s: float, back_after_s: float) -> list[Action]:
    """A kill at 0, K, 2K, ... before the window ends, each node back T s after its kill (if that
    is still in the window), in time order."""
    if window_s <= 0 or kill_every_s <= 0:
        raise ValueError(f"the window ({window_s:g} s) and the kill interval ({kill_every_s:g} s) must be positive")
    if not 0 < back_after_s < kill_every_s:
        # a node still away at the next kill would leave 1 training node without the spare
        raise ValueError(f"a killed node must be back ({back_after_s:g} s) before the next kill "
                         f"({kill_every_s:g} s)")
    actions = []
    kill = 0
    while kill * kill_every_s < window_s:
        actions.append(Action(kill * kill_every_s, KILL, kill))
        if kill * kill_every_s + back_after_s < window_s:
            actions.append(Action(kill * kill_every_s + back_after_s, START, kill))
        kill += 1
    return actions


def choose_victim(start_order: dict[str, int], first: str, training: set[str]) -> str:
    """The node to kill: of the nodes seen training other than ``first``, the one whose latest
    start is the oldest (``start_order``: higher is later). Without a spare that alternates
    between the two others; with one, the spare is always the node started last, so it is never
    chosen while it waits. When no other node is seen training (the job is between worlds), the
    same rule over every node but ``first``."""
    others = [node for node in start_order if node != first]
    if not others:
        raise ValueError(f"no node to kill but the first ({first})")
    candidates = [node for node in others if node in training] or others
    return min(candidates, key=lambda node: start_order[node])


def _as_one_generation(lines: list[dict]) -> list[dict]:
    """The step lines with one generation for all, so that bench.accounting orders each step's
    executions by time alone: in restart mode and under torchrun a line's generation is its
    node's own restart count, which other nodes' counts do not follow. Here every execution of
    a step ends (SIGKILL, re-formation, restart) before the next one starts, so the newest line
    is the last execution."""
    return [{**r, "generation": 0} for r in lines]


def last_executions(lines: list[dict]) -> dict[int, dict]:
    """Per step number, the line of its last execution (the newest)."""
    return accounting.lineage(_as_one_generation(lines))


def step_samples(line: dict) -> int:
    """The samples one execution of the step trained: every rank trained as many as this one."""
    return len(line["indices"]) * line["world_size"]


def samples_last_executed(lines: list[dict], start: float, end: float) -> int:
    """Samples of the steps whose last execution falls in [start, end)."""
    return sum(step_samples(r) for r in last_executions(lines).values() if start <= r["time"] < end)


def samples_trained(lines: list[dict], start: float, end: float) -> int:
    """Samples of the steps trained in [start, end), each step once, whatever happens to it later
    (the healthy phase's: a step re-done after the first kill was trained healthy once)."""
    trained = {r["step"]: r for r in lines if start <= r["time"] < end}
    return sum(step_samples(r) for r in trained.values())


def goodput(samples_in_window: int, healthy_samples_per_s: float | None, window_s: float) -> float | None:
    """The window's samples as a fraction of what the healthy job trains in as long; None
    without a healthy rate."""
    if not healthy_samples_per_s or window_s <= 0:
        return None
    return samples_in_window / (healthy_samples_per_s * window_s)


def goodput_bound_without_spare(back_after_s: float, cold_start_s: float, kill_every_s: float,
                                full_world: int = DEFAULT_NODES) -> float | None:
    """The most goodput a job without a spare can keep when one worker of ``full_world`` is away
    for the ``back_after_s`` s before its node returns, then for the ``cold_start_s`` s its new
    worker needs before it can train, once every ``kill_every_s`` s (supposing a world one
    smaller trains its share: (W-1)/W of the samples). None if the numbers make no bound."""
    if full_world < 2 or kill_every_s <= 0 or back_after_s < 0 or cold_start_s < 0:
        return None
    return max(0.0, 1 - (back_after_s + cold_start_s) / (full_world * kill_every_s))


# torch's own start in a new worker: the import, then the first optimizer, which imports
# torch._dynamo (torch.optim's add_param_group is wrapped in torch._compile._disable_dynamo).
TORCH_COLD_START = ("import torch; "
                    "torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)")
COLD_START_REPEATS = 3


def torch_cold_start_s(repeats: int = COLD_START_REPEATS) -> float:
    """Median seconds of a fresh Python that imports torch and makes its first optimizer: what any
    new worker process pays before elasticctl or the script does anything (the floor of a
    returning node's cold start, whatever launches it)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", TORCH_COLD_START], check=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def back_to_full_world(lines: list[dict], killed_at: float, until: float, since: float,
                       full_world: int = DEFAULT_NODES) -> float | None:
    """Seconds from ``killed_at`` to the first step at ``full_world`` again, before ``until``
    (the next kill, or the window's end); None if none.

    The first step of a new full world is the first full-world line of a worker (node, pid) that
    did not train at full world between ``since`` (the previous kill) and the kill: a new full
    world has one, the returning node's or the promoted spare's (restart mode and torchrun: every
    worker is new). This leaves out lines of the old world written after the signal (a step in
    flight)."""
    def worker(r: dict) -> tuple[str, int]:
        return r["node"], r["pid"]

    before = {worker(r) for r in lines if r["world_size"] == full_world and since <= r["time"] <= killed_at}
    after = [r["time"] for r in lines if r["world_size"] == full_world and killed_at < r["time"] < until
             and worker(r) not in before]
    return min(after) - killed_at if after else None


def sample_check(lines: list[dict], dataset_size: int = DATASET_SIZE) -> str | None:
    """None if the last executions tile every epoch (no sample lost or trained twice), else why not."""
    try:
        accounting.check_samples(_as_one_generation(lines), dataset_size=dataset_size)
    except accounting.AccountingError as exc:
        return str(exc)
    return None


def rotated(systems: list[str], repeat: int) -> list[str]:
    """The systems' order in ``repeat``: rotated, so that no system always runs first."""
    shift = repeat % len(systems)
    return systems[shift:] + systems[:shift]


def median(values: list[float | None]) -> float | None:
    done = [v for v in values if v is not None]
    return statistics.median(done) if done else None


# -- one job under the schedule ----------------------------------------------------------------


def _sleep_until(wall_time: float) -> None:
    """The schedule runs on the wall clock by design: the faults' times are the measurement's input."""
    time.sleep(max(0.0, wall_time - time.time()))


def _training_nodes(cluster: Cluster) -> set[str]:
    return {r["node"] for r in cluster.record.steps(time.time() - TRAINING_LOOKBACK_S)}


def _start_world(cluster: Cluster, names: list[str], caps: Caps) -> float | None:
    """Start ``names`` (the first first); seconds from the first start to all of them training
    together at a world of their number."""
    started = time.time()
    for name in names:
        cluster.start(name, timeout=caps.start)
    reached = cluster.wait_world(len(names), set(names), started, caps.start)
    return reached - started if reached else None


def measure(system: str, workdir: Path, etcd: EtcdClient, schedule: Schedule, caps: Caps,
            nodes: int = DEFAULT_NODES) -> dict:
    """One job of ``system`` (a key of :data:`SYSTEMS`) at ``nodes`` training nodes x 1 worker
    through the healthy phase and the window."""
    cluster_system, spares = SYSTEMS[system]
    names, spare_names = node_names(nodes, spares)
    trainer = [*EVENT_TRAINING, "--dataset-size", str(DATASET_SIZE), "--checkpoint-dir", str(workdir / "checkpoints"),
               "--checkpoint-every", str(caps.checkpoint_every)]
    # --nnodes 1:N: the spare is the node beyond N, which the job admits only in a lost node's place
    cluster = Cluster(cluster_system, workdir, trainer, etcd, nnodes=f"1:{nodes}",
                      up_args=("--spares", str(spares)) if spares else (), max_restarts=TORCHRUN_MAX_RESTARTS)
    result: dict = {"system": system, "nodes": nodes, "load_1min_before": os.getloadavg()[0]}
    try:
        result["cold_start_s"] = _start_world(cluster, names, caps)
        if result["cold_start_s"] is None:
            result["error"] = f"no world of {nodes} within {caps.start:g} s"
            return result
        for spare in spare_names:
            added = time.time()
            cluster.start(spare)
            if not wait_for(lambda node=spare: _spare_waiting(cluster, node, added), caps.start):
                result["error"] = f"node {spare} did not wait as a spare within {caps.start:g} s"
                return result
        time.sleep(schedule.warmup_s)  # an intended pause before the healthy phase, not a synchronisation
        healthy_start = time.time()
        window_start = healthy_start + schedule.healthy_s
        kills = _apply_schedule(cluster, schedule, window_start)
        _sleep_until(window_start + schedule.window_s)
        result["first_node_exit_code"] = cluster.nodes[FIRST_NODE].process.poll()  # None: still running
    finally:
        cluster.close()
        result["load_1min_after"] = os.getloadavg()[0]
    return {**result, **_outcome(cluster.record.steps(), schedule, healthy_start, window_start, kills, nodes)}


def _apply_schedule(cluster: Cluster, schedule: Schedule, window_start: float) -> list[dict]:
    """The kills and returns of the window (wall-clock times); each kill's node, time and return."""
    start_order = {name: order for order, name in enumerate(cluster.nodes)}  # a, b, ... (, the spare): as started
    kills: list[dict] = []
    for action in kill_schedule(schedule.window_s, schedule.kill_every_s, schedule.back_after_s):
        _sleep_until(window_start + action.offset_s)
        if action.kind == KILL:
            training = _training_nodes(cluster)
            victim = choose_victim(start_order, FIRST_NODE, training)
            node = cluster.nodes[victim]
            killed_at = time.time()
            node.signal_tree(signal.SIGKILL)
            node.process.wait(10)
            kills.append({"node": victim, "at": killed_at, "training": sorted(training)})
        else:
            victim = kills[action.kill]["node"]
            start_order[victim] = max(start_order.values()) + 1
            kills[action.kill]["back_at"] = time.time()
            cluster.start(victim)
    return kills


def _outcome(lines: list[dict], schedule: Schedule, healthy_start: float, window_start: float,
             kills: list[dict], full_world: int = DEFAULT_NODES) -> dict:
    """The measurements from the record: times relative to the window's start."""
    window_end = window_start + schedule.window_s
    healthy_samples = samples_trained(lines, healthy_start, window_start)
    healthy_rate = healthy_samples / schedule.healthy_s
    in_window = samples_last_executed(lines, window_start, window_end)
    described = []
    for number, kill in enumerate(kills):
        since = kills[number - 1]["at"] if number else healthy_start
        until = kills[number + 1]["at"] if number + 1 < len(kills) else window_end
        back = back_to_full_world(lines, kill["at"], until, since, full_world)
        # from the node's new start to the job's first step at full world again (no spare: its cold start)
        returned = back - (kill["back_at"] - kill["at"]) if back is not None and "back_at" in kill else None
        described.append({"node": kill["node"], "at_s": round(kill["at"] - window_start, 3),
                          "back_at_s": round(kill["back_at"] - window_start, 3) if "back_at" in kill else None,
                          "training": kill["training"], "full_world_after_s": back,
                          "start_to_full_world_s": returned})
    lost = sample_check(lines)
    return {"healthy_s": schedule.healthy_s, "healthy_samples": healthy_samples,
            "healthy_samples_per_s": healthy_rate,
            "healthy_world_sizes": sorted({r["world_size"] for r in lines
                                           if healthy_start <= r["time"] < window_start}),
            "window_s": schedule.window_s, "samples_in_window": in_window,
            "goodput": goodput(in_window, healthy_rate, schedule.window_s),
            "kills": described, "kill_count": len(kills),
            "full_world_after_s_median": median([k["full_world_after_s"] for k in described]),
            "start_to_full_world_s_median": median([k["start_to_full_world_s"] for k in described]),
            "not_full_again": sum(k["full_world_after_s"] is None for k in described),
            "samples_lost": lost is not None, "sample_check": lost or "no sample lost or trained twice"}


def empty_entry(schedule: Schedule, repeats: int, shapes: tuple[int, ...], systems: tuple[str, ...]) -> dict:
    """The results' layout before any job: what every shape shares at the top, then per shape
    (:func:`shape_key`) its node count and a list of samples per system."""
    return {"schedule": dataclasses.asdict(schedule), "repeats": repeats,
            "torchrun_max_restarts": TORCHRUN_MAX_RESTARTS,
            "shapes": {shape_key(nodes): {"nodes": nodes, "per_node": 1,
                                          "systems": {system: [] for system in systems}} for nodes in shapes}}


def run(schedule: Schedule, repeats: int, root: Path, etcd: EtcdClient, caps: Caps,
        report: Callable[[str], None] = print, systems: tuple[str, ...] = tuple(SYSTEMS),
        nodes: tuple[int, ...] = (DEFAULT_NODES,)) -> dict:
    """Every system ``repeats`` times at each number of training nodes in ``nodes``, one job after
    another (:func:`plan_jobs`; bench/run.py's `goodput` scenario); ``root``: the run's directory
    (job names hold its name). The layout: :func:`empty_entry`, with torch's cold start."""
    jobs = plan_jobs(tuple(nodes), list(systems), repeats)
    entry = empty_entry(schedule, repeats, tuple(nodes), systems)
    cold_start = torch_cold_start_s()
    entry.update(torch_cold_start_s=cold_start, torch_cold_start_repeats=COLD_START_REPEATS)
    report(f"goodput: torch's own cold start here {cold_start:.2f} s (median of {COLD_START_REPEATS})")
    for shape, repeat, system in jobs:
        key = shape_key(shape)
        try:
            sample = measure(system, root / f"goodput-{key}-{system}-{repeat}", etcd, schedule, caps, shape)
        except Exception as exc:  # noqa: BLE001 - one system's broken job must not cost the others
            sample = {"system": system, "nodes": shape, "error": f"{type(exc).__name__}: {exc}"}
        entry["shapes"][key]["systems"][system].append(sample)
        report(f"goodput {key} {system} #{repeat + 1}: " + ", ".join(
            f"{name} {sample.get(name)}" for name in ("goodput", "healthy_samples_per_s", "samples_in_window",
                                                      "kill_count", "full_world_after_s_median", "samples_lost",
                                                      "error") if name in sample))
    return entry


def main(argv: list[str] | None = None) -> None:
    """A goodput run of its own, with its own etcd and schedule (a shortened one for a smoke run);
    prints the report's table and, with --output, writes the samples."""
    from bench import report  # the report imports nothing of this module: no cycle at import time

    default = Schedule()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=float, default=default.window_s, help="seconds of the fault schedule")
    parser.add_argument("--kill-every", type=float, default=default.kill_every_s, help="seconds between kills")
    parser.add_argument("--back-after", type=float, default=default.back_after_s,
                        help="seconds from a kill to the same node's start")
    parser.add_argument("--healthy", type=float, default=default.healthy_s, help="seconds of the healthy phase")
    parser.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    parser.add_argument("--nodes", type=int, nargs="+", default=[DEFAULT_NODES],
                        help="training nodes x 1 worker of each job; several: one shape after another")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--output", type=Path, default=None, help="write the samples as JSON here")
    args = parser.parse_args(argv)
    schedule = Schedule(window_s=args.window, kill_every_s=args.kill_every, back_after_s=args.back_after,
                        healthy_s=args.healthy)
    try:
        kill_schedule(schedule.window_s, schedule.kill_every_s, schedule.back_after_s)
        plan_jobs(tuple(args.nodes), args.systems, args.repeats)
    except ValueError as exc:
        parser.error(str(exc))
    root = Path(tempfile.mkdtemp(prefix="goodput-"))
    try:
        with EmbeddedEtcd(data_dir=str(root / "etcd"), client_port=0, peer_port=0) as server, \
                EtcdClient(server.client_settings()) as etcd:
            entry = run(schedule, args.repeats, root, etcd, Caps(), systems=tuple(args.systems),
                        nodes=tuple(args.nodes))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.output:
        args.output.write_text(json.dumps(entry, indent=1))
    print("\n".join(report.goodput_section({"scenarios": {"goodput": entry}})))


if __name__ == "__main__":
    main()
