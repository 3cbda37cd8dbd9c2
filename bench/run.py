"""elasticctl (restart mode and hot recovery) next to plain torchrun, every scenario, one command.

    python -m bench.run --quick    # about 30 min on 2 cores: 1 repeat per event scenario and system, 5 of steady state
    python -m bench.run --full     # about 60 min: 3 repeats, rendezvous up to 1,000 agents, a 4.5 MB checkpoint too
    python -m bench.run --quick --only goodput   # the goodput table alone

(The sharded-model sections add about 15 minutes to --quick: state transfer up to 2 GB
~3 min, HSDP and FSDP2 ~2-7 min, the HSDP chaos soak of 20 events ~5 min, twice as long if its
joins fail. The goodput section adds about 16 minutes to --quick and 32 to --full: four jobs of 60 s or 180 s
under faults at each of 3 and 5 nodes, each after its cold start and healthy phase.)

3 nodes x 1 worker on 127.0.0.1, CPU, gloo, trainers/mlp.py. Three systems run every
job scenario in the same invocation, their order rotated per repeat: elasticctl
(restart mode: a membership change restarts every worker from the newest checkpoint),
elasticctl-hot (`up --recovery hot`: survivors re-form in process, a joiner gets the
state from them; the same trainer and node TTL) and plain torchrun. Writes bench/results/<date>-<mode>.json
(every raw sample and the machine), bench/results/recovery.png and BENCHMARKS.md.

``goodput`` (bench/goodput.py, run first, the first table of BENCHMARKS.md): one training node
SIGKILLed every 30 s (``--quick``: 20 s) and back 10 s later over 180 s (``--quick``: 60 s),
applied to plain torchrun, restart mode, hot mode and hot mode with one spare in turn, at 3 and
then at 5 training nodes x 1 worker (``Plan.goodput_shapes``); goodput = samples whose last
execution falls in the window ÷ (that system's healthy samples/s at that shape x the window).

The sharded-model sections, each selectable with ``--only``: ``state_transfer`` (64 MB,
512 MB, 2 GB; bench/state_transfer.py), ``hsdp`` and ``fsdp`` (bench/hsdp_recovery.py: 3 nodes x 2 workers of
trainers/lm.py --shard hsdp; FSDP2 without copies in hot and restart mode), ``hsdp_freeze`` (the
same HSDP job, node b's tree SIGSTOPped, the first step at world 4 against the node TTL + 1 s, then
SIGCONT and back at world 6; about 2 minutes in --quick), ``fsdp_peer_copies``
(FSDP2 with peer copies every 10 steps, no checkpoint) and
``chaos_hsdp`` (bench/chaos.py --trainer lm-hsdp, 20 events).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench import checkpoint as checkpoint_bench
from bench import frameworks as frameworks_bench
from bench import goodput, plot, report, scenarios
from bench import reconfigure as reconfigure_bench
from bench import shapes as shapes_bench
from bench import stragglers as straggler_bench
from bench import trust as trust_bench
from bench.cluster import NODE_TTL, SYSTEMS
from bench.scenarios import Caps
from elasticctl.etcd.client import EtcdClient
from elasticctl.embedded_etcd import EmbeddedEtcd, etcd_version, find_etcd_binary

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PNG = RESULTS / "recovery.png"


@dataclasses.dataclass(frozen=True)
class Plan:
    repeats: dict[str, int]  # per scenario: quick repeats the cheap ones more
    caps: Caps
    rendezvous_agents: tuple[int, ...]  # the scale series: etcd3 runs at every size
    rendezvous_max_agents: dict[str, int]  # the others up to the largest size they complete
    rendezvous_repeats: int  # at sizes below RENDEZVOUS_ONCE_FROM; one repeat from there on
    checkpoint_hidden: tuple[int, ...]
    checkpoint_steps: int
    checkpoint_repeats: int
    state_transfer_mb: tuple[int, ...] = (64, 512, 2048)  # bench/state_transfer.py: 2 holders -> 1 joiner
    state_transfer_repeats: int = 2  # below STATE_TRANSFER_ONCE_FROM_MB; once from there on
    light_agents: tuple[int, ...] = (1000, 10000)  # bench/rendezvous.py etcd3-light: one round each
    hot_workers: tuple[int, ...] = (1000,)  # bench/rendezvous.py --hot: both policies each
    # bench/rendezvous.py etcd3: one round of real torchrun handlers per size and repeat, sizes
    # interleaved, over a fixed count of processes (threads of one interpreter each beyond it)
    real_handler_agents: tuple[int, ...] = (256, 1000)
    real_handler_repeats: int = 5
    real_handler_processes: int = 8
    hsdp_rounds: int = 1  # bench/hsdp_recovery.py: SIGKILL a node of 3 x 2 HSDP workers, then a node joins
    hsdp_freezes: int = 1  # the same job SIGSTOPs a node, then SIGCONTs it: a fresh job each
    fsdp_repeats: int = 1  # FSDP2 without copies, hot and restart mode each
    chaos_events: int = 20  # bench/chaos.py --trainer lm-hsdp
    # bench/goodput.py: a node SIGKILLed every K s and back 10 s later, over a window, 4 systems in turn
    goodput_schedule: goodput.Schedule = goodput.Schedule()
    goodput_repeats: int = 1
    # training nodes x 1 worker of the goodput jobs: a cost that grows with the shape hides at one
    goodput_shapes: tuple[int, ...] = (3, 5)
    reconfigure_repeats: int = 3  # bench/reconfigure.py: a join, a leave and a kill per job and variant
    kill_shape_repeats: int = 5  # bench/shapes.py: kills per job, one job per shape and system
    frameworks_repeats: int = 3  # bench/frameworks.py: jobs through a kill per framework script


PLANS = {
    "quick": Plan(repeats={"lifecycle": 1, "crash_host": 1, "spare": 1, "steady": 5}, caps=Caps(recover=60, freeze=60, steady_window=10),
                  rendezvous_agents=(2, 8, 64, 256), rendezvous_max_agents={"etcd3-dynamic": 8, "c10d": 64},
                  rendezvous_repeats=2,
                  checkpoint_hidden=(64,), checkpoint_steps=100, checkpoint_repeats=2,
                  state_transfer_mb=(64, 512, 2048), state_transfer_repeats=2, hsdp_rounds=1, hsdp_freezes=1,
                  fsdp_repeats=1,
                  chaos_events=20, goodput_schedule=goodput.Schedule(window_s=60, kill_every_s=20, healthy_s=10)),
    "full": Plan(repeats={"lifecycle": 3, "crash_host": 3, "spare": 3, "steady": 5}, caps=Caps(recover=90, freeze=120, steady_window=20),
                 rendezvous_agents=(8, 64, 128, 256, 1000),
                 rendezvous_max_agents={"etcd3-dynamic": 64, "c10d": 128}, rendezvous_repeats=3,
                 checkpoint_hidden=(64, 65536), checkpoint_steps=200, checkpoint_repeats=3,
                 state_transfer_mb=(64, 512, 2048), state_transfer_repeats=3, hsdp_rounds=3, hsdp_freezes=3,
                 fsdp_repeats=2,
                 chaos_events=20, goodput_schedule=goodput.Schedule(window_s=180, kill_every_s=30, healthy_s=20),
                 reconfigure_repeats=5),
}
JOB_SCENARIOS = {"lifecycle": scenarios.lifecycle, "crash_host": scenarios.crash_host, "spare": scenarios.spare,
                 "steady": scenarios.steady}
# The sharded scenarios (bench/hsdp_recovery.py) and the HSDP chaos soak (bench/chaos.py).
SHARDED_SCENARIOS = ("hsdp", "hsdp_freeze", "fsdp", "fsdp_peer_copies")
ALL = ("goodput", *JOB_SCENARIOS, "kill_shapes", "frameworks", "reconfigure", "checkpoint", "state_transfer", *SHARDED_SCENARIOS, "chaos_hsdp", "rendezvous",
       "rendezvous_scale", "rendezvous_real", "straggler", "trust")
NO_JOIN_KINDS = ("kill", "leave", "short-freeze")  # the chaos mix while the HSDP join fails
STATE_TRANSFER_ONCE_FROM_MB = 2048  # a 2 GB state runs one repeat: ~35 s and 3 x 4 GB of memory each
RENDEZVOUS_TIMEOUT = 120.0  # seconds a rendezvous round may take
RENDEZVOUS_ONCE_FROM = 256  # agents from which a size runs once (setup alone takes tens of seconds)
RENDEZVOUS_BACKENDS = ("etcd3", "etcd3-dynamic", "c10d")


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    import torch

    return {"cpu_model": model, "cpu_count": os.cpu_count(),
            "ram_gb": round(psutil.virtual_memory().total / 2**30, 1), "os": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "etcd": etcd_version(find_etcd_binary())}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def summary(sample: dict) -> str:
    def short(value):
        return f"{value:.2f}" if isinstance(value, float) else value

    flat = {k: short(v) for k, v in sample.items() if not isinstance(v, (dict, list))}
    nested = {k: {kk: short(vv) for kk, vv in v.items()} for k, v in sample.items()
              if isinstance(v, dict) and k != "events"}
    return json.dumps({**flat, **nested})


def run_jobs(names: list[str], plan: Plan, root: Path, etcd: EtcdClient) -> dict:
    results: dict = {name: {system: [] for system in SYSTEMS} for name in names}
    for repeat in range(max((plan.repeats[name] for name in names), default=0)):
        order = SYSTEMS[repeat % len(SYSTEMS):] + SYSTEMS[:repeat % len(SYSTEMS)]  # no system always first
        for name in [n for n in names if repeat < plan.repeats[n]]:
            for system in order:
                workdir = root / f"{name}-{system}-{repeat}"
                sample = JOB_SCENARIOS[name](system, workdir, etcd, plan.caps)
                sample["load_1min_after"] = os.getloadavg()[0]  # explains an outlier on a shared machine
                results[name][system].append(sample)
                log(f"{name} {system} #{repeat + 1}: {summary(sample)}")
    return results


def run_rendezvous(plan: Plan) -> list[dict]:
    """One entry per size: seconds per backend and repeat (None: no correct round), every row.

    Backends beyond their plan.rendezvous_max_agents are not run at that size (no key in the
    entry). Each etcd round gets a fresh etcd (measure_round with None), so that no lease of an
    earlier round expires into its write counts.
    """
    from bench.rendezvous import describe, measure_round, planned  # imports torch: only when needed

    rows = []
    for agents in plan.rendezvous_agents:
        backends = planned(agents, RENDEZVOUS_BACKENDS, plan.rendezvous_max_agents)
        row: dict = {"agents": agents, **{backend: [] for backend in backends},
                     "timeout": RENDEZVOUS_TIMEOUT, "rounds": []}
        repeats = 1 if agents >= RENDEZVOUS_ONCE_FROM else plan.rendezvous_repeats
        for _ in range(repeats):
            for backend in backends:
                try:
                    result = measure_round(backend, None, agents, timeout=RENDEZVOUS_TIMEOUT)
                except Exception as exc:  # noqa: BLE001 - one broken round must not cost the run
                    row[backend].append(None)
                    row.setdefault("errors", []).append(f"{backend}: {type(exc).__name__}: {exc}")
                    continue
                row["rounds"].append(result)
                good = result["completed"] and result["correct"]
                row[backend].append(result["seconds"] if good else None)
                if not good:
                    row.setdefault("errors", []).append(
                        f"{backend}: {describe(result)} {'; '.join(result['errors'][:2])}")
        rows.append(row)
        log(f"rendezvous {agents} agents: " + ", ".join(f"{b} {row[b]}" for b in backends))
    return rows


def run_rendezvous_scale(plan: Plan) -> dict:
    """Simulated agents at scale: light agents in one round (a watch per agent up to 1,000,
    one per process above: see bench/rdzv_light.py), and hot re-formations with both declaration policies.
    Each measurement starts its own etcd."""
    from bench.rendezvous import EVERY_MEMBER, FOLLOWERS, LIGHT, describe, describe_hot, measure_hot, measure_round

    light, hot = [], []
    for agents in plan.light_agents:
        row = measure_round(LIGHT, None, agents, timeout=RENDEZVOUS_TIMEOUT,
                            watchers="agent" if agents <= 1000 else "process")
        light.append(row)
        log(f"rendezvous light {agents} agents: {describe(row)}, {row.get('writes_per_agent')} writes/agent")
    for workers in plan.hot_workers:
        for policy in (FOLLOWERS, EVERY_MEMBER):
            row = measure_hot(None, workers, policy, timeout=60.0)
            hot.append(row)
            log(f"rendezvous hot {workers} workers, {policy}: {describe_hot(row)}")
    return {"light": light, "hot": hot}


def run_rendezvous_real(plan: Plan) -> list[dict]:
    """Rounds of real torchrun handlers (the etcd3 backend) at each of plan.real_handler_agents,
    over plan.real_handler_processes processes, plan.real_handler_repeats times, the sizes
    interleaved; each round on a fresh etcd. Every row, a failed round's too."""
    from bench.rendezvous import ETCD3, describe, measure_round

    rows = []
    for repeat in range(1, plan.real_handler_repeats + 1):
        for agents in plan.real_handler_agents:
            try:
                row = measure_round(ETCD3, None, agents, processes=plan.real_handler_processes,
                                    timeout=RENDEZVOUS_TIMEOUT)
            except Exception as exc:  # noqa: BLE001 - one broken round must not cost the run
                row = {"backend": ETCD3, "agents": agents, "processes": plan.real_handler_processes,
                       "completed": False, "correct": False, "errors": [f"{type(exc).__name__}: {exc}"]}
            rows.append({**row, "repeat": repeat})
            log(f"rendezvous real handlers {agents} agents, repeat {repeat}: {describe(row)}")
    return rows


def run_checkpoint(plan: Plan, errors: list[str]) -> list[dict]:
    rows = []
    for hidden in plan.checkpoint_hidden:
        for attempt in (1, 2):  # one retry: a failed trainer run must not cost the whole benchmark
            try:
                rows.append(checkpoint_bench.bench(
                    f"mlp --hidden {hidden}", "mlp.py",
                    ["--steps", str(plan.checkpoint_steps), "--hidden", str(hidden), "--log-every", "0"],
                    checkpoint_bench.mlp_step_time, plan.caps.checkpoint_every, plan.checkpoint_repeats, nproc=2))
                log(f"checkpoint: {json.dumps(rows[-1])}")
                break
            except subprocess.CalledProcessError as exc:
                tail = (exc.stderr or b"").decode(errors="replace").strip().splitlines()[-5:]
                errors.append(f"checkpoint mlp --hidden {hidden}, attempt {attempt}: {' | '.join(tail)}")
                log(errors[-1])
    return rows


def run_state_transfer(plan: Plan, root: Path, errors: list[str]) -> list[dict]:
    """Hot recovery's state transfer against the old whole-blob path and the raw broadcast, per size,
    each size in a process of its own (its workers, and their memory, end with it)."""
    rows = []
    for size in plan.state_transfer_mb:
        output = root / f"state-transfer-{size}.json"
        command = [sys.executable, "-m", "bench.state_transfer", "--sizes-mb", str(size), "--procs", "3",
                   "--repeats", str(plan.state_transfer_repeats), "--once-from-mb", str(STATE_TRANSFER_ONCE_FROM_MB),
                   "--output", str(output)]
        try:
            subprocess.run(command, check=True, capture_output=True, timeout=1800, cwd=REPO)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            tail = (exc.stderr or b"").decode(errors="replace").strip().splitlines()[-3:]
            errors.append(f"state transfer {size} MB: {type(exc).__name__}: {' | '.join(tail)}")
            log(errors[-1])
            continue
        result = json.loads(output.read_text())
        rows += [{**summary, "samples": run["samples"]} for summary, run in zip(result["summaries"], result["runs"])]
        log(f"state transfer {size} MB: {json.dumps(result['summaries'])}")
    return rows


def run_sharded(names: list[str], plan: Plan, root: Path, etcd: EtcdClient) -> dict:
    """The sharded scenarios (bench/hsdp_recovery.py), each under its own name:
    ``hsdp``: rounds of {kill, join} on 3 nodes x 2 workers (``hsdp_rebuilt``: the same with every
    group rebuilt each generation, interleaved); ``hsdp_freeze``: jobs of the same
    shape, each {freeze, thaw, samples} of one node SIGSTOPped, then SIGCONTed; ``fsdp``: FSDP2 without copies,
    hot and restart mode interleaved; ``fsdp_peer_copies``: FSDP2 with peer copies every 10
    steps, a node SIGKILLed between two copy rounds (fsdp_round's keys and the copies' own)."""
    from bench import hsdp_recovery

    cap = plan.caps.recover
    out: dict = {}
    if "hsdp" in names:
        # One job per round, the mesh kept (the default) and every group rebuilt each generation
        # interleaved, each first in turn. Workdirs under root: the job names hold the run's
        # directory name (the leftover check).
        out["hsdp"], out["hsdp_rebuilt"] = [], []
        for repeat in range(plan.hsdp_rounds):
            for rebuild in ((False, True) if repeat % 2 == 0 else (True, False)):
                out["hsdp_rebuilt" if rebuild else "hsdp"] += hsdp_recovery.hsdp_rounds(
                    root / f"round-{repeat}", etcd, 1, cap, report=log, rebuild=rebuild)
    if "hsdp_freeze" in names:  # workdirs root/hsdp-freeze-N: the job names hold the run's directory name too
        out["hsdp_freeze"] = hsdp_recovery.hsdp_freezes(root, etcd, plan.hsdp_freezes, cap, report=log)
    if "fsdp" in names:
        out["fsdp"] = {system: [] for system in ("elasticctl-hot", "elasticctl")}
        for repeat in range(plan.fsdp_repeats):
            order = list(out["fsdp"]) if repeat % 2 == 0 else list(out["fsdp"])[::-1]
            for system in order:
                sample = hsdp_recovery.fsdp_round(system, root / f"fsdp-{system}-{repeat}", etcd, cap)
                out["fsdp"][system].append(sample)
                log(f"fsdp {system} #{repeat + 1}: {summary(sample)}")
    if "fsdp_peer_copies" in names:
        out["fsdp_peer_copies"] = {"samples": [
            hsdp_recovery.fsdp_peer_copy_round(root / f"fsdp-peer-{repeat}", etcd, cap)
            for repeat in range(plan.fsdp_repeats)]}
        log(f"fsdp_peer_copies: {json.dumps(out['fsdp_peer_copies'], default=str)[:300]}")
    return out


def chaos_soak(events: int, workdir: Path, kinds: tuple[str, ...] | None = None) -> dict:
    """One bench/chaos.py soak of trainers/lm.py --shard hsdp (3 nodes x 2 workers, hot mode) in a
    process of its own (it starts its own etcd): its summary with ``outcome`` "passed" or
    "failed: reason" (then the events before the failure)."""
    output = workdir.with_suffix(".json")
    command = [sys.executable, "-m", "bench.chaos", "--trainer", "lm-hsdp", "--events", str(events), "--seed", "1",
               "--workdir", str(workdir), "--summary", str(output), *(("--kinds", *kinds) if kinds else ())]
    started = time.monotonic()
    try:
        result = subprocess.run(command, check=False, capture_output=True, text=True, cwd=REPO,
                                timeout=120 * max(events, 1) + 300)
    except subprocess.TimeoutExpired:
        return {"outcome": "failed: the soak did not end within its time limit", "events_planned": events}
    verdict = next((line for line in result.stdout.splitlines() if line.startswith("chaos:")),
                   f"chaos: no verdict printed (status {result.returncode}: {result.stderr.strip()[-200:]})")
    found = json.loads(output.read_text()) if output.exists() else {}
    found.update({"outcome": "passed" if result.returncode == 0 else "failed: " + verdict.split("FAILED: ", 1)[-1],
                  "events_planned": events, "wall_s": round(time.monotonic() - started, 1)})
    log(f"chaos hsdp ({', '.join(found.get('kinds') or kinds or ())}): {verdict}")
    return found


def run_chaos_hsdp(plan: Plan, root: Path, quick: bool) -> dict:
    """The HSDP chaos soak with every kind of event; while a join fails (HSDP joins
    can still fail), again with the kinds that need no join, the first soak kept under ``with_joins``."""
    from bench.chaos import join_failed

    # the run's directory name in the job's: bench.run's leftover check finds its processes
    soak = chaos_soak(plan.chaos_events, root / f"{root.name}-chaos")
    if soak["outcome"] != "passed" and join_failed(soak):
        first = soak
        soak = chaos_soak(plan.chaos_events, root / f"{root.name}-chaos-nojoin", NO_JOIN_KINDS)
        soak["with_joins"] = first
    soak["quick"] = quick
    return soak


def leftover_processes(token: str) -> list[str]:
    """Processes of this run still alive: children of this process, or any command line naming the run."""
    me = psutil.Process()
    found = {p.pid: p for p in me.children(recursive=True)}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.pid != me.pid and token in " ".join(proc.info["cmdline"] or []):
            found[proc.pid] = proc
    described = []
    for proc in found.values():
        try:
            described.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    return described


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--quick", action="store_const", dest="mode", const="quick")
    mode.add_argument("--full", action="store_const", dest="mode", const="full")
    parser.add_argument("--only", nargs="+", choices=ALL, default=list(ALL), help="run these scenarios only")
    parser.add_argument("--repeats", type=int, default=None, help="override the plan's repeats")
    parser.add_argument("--goodput-schedule", choices=sorted(PLANS), default=None,
                        help="the goodput section's schedule of that plan (default: the mode's own); e.g. --quick "
                             "--goodput-schedule full: 180 s, a kill every 30 s, beside quick repeats elsewhere")
    parser.add_argument("--no-report", action="store_true",
                        help="write the JSON but leave BENCHMARKS.md and the PNG alone (smoke runs)")
    parser.add_argument("--output", type=Path, default=RESULTS, help="directory for the results JSON")
    parser.add_argument("--keep-workdir", action="store_true", help="keep the nodes' logs and records")
    args = parser.parse_args()
    plan = PLANS[args.mode]
    if args.goodput_schedule:
        plan = dataclasses.replace(plan, goodput_schedule=PLANS[args.goodput_schedule].goodput_schedule)
    if args.repeats:
        plan = dataclasses.replace(plan, repeats=dict.fromkeys(plan.repeats, args.repeats),
                                   checkpoint_repeats=args.repeats,
                                   rendezvous_repeats=args.repeats, state_transfer_repeats=args.repeats,
                                   hsdp_rounds=args.repeats, hsdp_freezes=args.repeats, fsdp_repeats=args.repeats,
                                   goodput_repeats=args.repeats, reconfigure_repeats=args.repeats,
                                   kill_shape_repeats=args.repeats, frameworks_repeats=args.repeats)

    started, now = time.monotonic(), datetime.datetime.now()
    root = Path(tempfile.mkdtemp(prefix=f"ecbench-{now:%H%M%S}-"))
    command = " ".join(["python -m bench.run", *sys.argv[1:]])
    results: dict = {"date": now.isoformat(timespec="seconds"), "mode": args.mode, "command": command,
                     "repeats": plan.repeats, "machine": machine(), "load": {"before": os.getloadavg()},
                     "settings": {**dataclasses.asdict(plan), "checkpoint_every": plan.caps.checkpoint_every,
                                  "node_ttl_s": NODE_TTL, "systems": list(SYSTEMS),
                                  "event_training": scenarios.EVENT_TRAINING,
                                  "steady_training": scenarios.STEADY_TRAINING},
                     "scenarios": {}, "errors": []}
    log(f"{command}: repeats per scenario and system {plan.repeats}, checkpoint {plan.checkpoint_repeats}, "
        f"rendezvous {plan.rendezvous_repeats}"
        + (" (fewer than 3 where needed to stay within 10 minutes)" if min(plan.repeats.values()) < 3 else "")
        + f"; load {results['load']['before'][0]:.2f}; workdir {root}")
    try:
        with EmbeddedEtcd(data_dir=str(root / "etcd"), client_port=0, peer_port=0) as etcd, \
                EtcdClient(etcd.client_settings()) as client:
            if "goodput" in args.only:  # first: the row BENCHMARKS.md opens with
                results["scenarios"]["goodput"] = goodput.run(plan.goodput_schedule, plan.goodput_repeats, root, client,
                                                              plan.caps, report=log, nodes=plan.goodput_shapes)
            jobs = [name for name in JOB_SCENARIOS if name in args.only]
            results["scenarios"].update(run_jobs(jobs, plan, root, client))
            if "kill_shapes" in args.only:  # a crash at 3 x 1 up to 8 x 1 and 4 x 2 (bench/shapes.py)
                results["scenarios"]["kill_shapes"] = shapes_bench.run(plan.kill_shape_repeats, root, client,
                                                                       plan.caps.recover, report=log)
            if "frameworks" in args.only:  # a framework's own script through a kill (bench/frameworks.py)
                results["scenarios"]["frameworks"] = frameworks_bench.run(plan.frameworks_repeats, root, etcd,
                                                                          report=log)
            if "reconfigure" in args.only:  # hot mode's group in place vs anew (bench/reconfigure.py)
                results["scenarios"]["reconfigure"] = reconfigure_bench.run(plan.reconfigure_repeats, root, client,
                                                                            plan.caps, report=log)
            if "straggler" in args.only:  # hot mode only: two jobs, once (bench/stragglers.py)
                results["scenarios"]["straggler"] = straggler_bench.run(root, client, plan.caps)
                log(f"straggler: {summary(results['scenarios']['straggler'])}")
            if "trust" in args.only:  # admission, replica and non-finite checks (bench/trust.py)
                results["scenarios"]["trust"] = trust_bench.run(root, client, plan.caps, max(5, plan.repeats["steady"]))
                log(f"trust: {summary(results['scenarios']['trust'])}")
            if "checkpoint" in args.only:
                results["scenarios"]["checkpoint"] = run_checkpoint(plan, results["errors"])
            if "state_transfer" in args.only:
                results["scenarios"]["state_transfer"] = run_state_transfer(plan, root, results["errors"])
            sharded = [name for name in SHARDED_SCENARIOS if name in args.only]
            if sharded:
                results["scenarios"].update(run_sharded(sharded, plan, root, client))
            if "chaos_hsdp" in args.only:
                results["scenarios"]["chaos_hsdp"] = run_chaos_hsdp(plan, root, args.mode == "quick")
            # Last: the heaviest on the machine (up to 1,000 agents); each round starts its own etcd.
            if "rendezvous" in args.only:
                results["scenarios"]["rendezvous"] = run_rendezvous(plan)
            if "rendezvous_scale" in args.only:
                results["scenarios"]["rendezvous_scale"] = run_rendezvous_scale(plan)
            if "rendezvous_real" in args.only:
                results["scenarios"]["rendezvous_real"] = run_rendezvous_real(plan)
    except BaseException:  # keep the raw samples gathered so far
        args.output.mkdir(parents=True, exist_ok=True)
        partial = args.output / f"{now:%Y-%m-%d-%H%M}-{args.mode}-partial.json"
        partial.write_text(json.dumps(results, indent=1, default=str))
        log(f"interrupted; samples so far in {partial}")
        raise
    finally:
        results["leftover_processes"] = leftover_processes(root.name)
        if results["leftover_processes"]:
            log(f"killed leftover processes: {results['leftover_processes']}")
        if not args.keep_workdir:
            shutil.rmtree(root, ignore_errors=True)

    results["load"]["after"] = os.getloadavg()
    results["duration_s"] = round(time.monotonic() - started, 1)
    args.output.mkdir(parents=True, exist_ok=True)
    out = args.output.resolve() / f"{now:%Y-%m-%d-%H%M}-{args.mode}.json"
    results["json"] = str(out.relative_to(REPO)) if out.is_relative_to(REPO) else str(out)
    out.write_text(json.dumps(results, indent=1))  # the samples first: nothing after may lose them
    if not args.no_report:
        png = plot.plot(results, PNG)
        results["png"] = str(png.relative_to(REPO)) if png else None
        out.write_text(json.dumps(results, indent=1))
    if not args.no_report:
        (REPO / "BENCHMARKS.md").write_text(report.markdown(results, results.get("png")))
    print(report.text_table(results))
    log(f"done in {results['duration_s'] / 60:.1f} min; load {results['load']['after'][0]:.2f}; wrote {out}")


if __name__ == "__main__":
    main()
