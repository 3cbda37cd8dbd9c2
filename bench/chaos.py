"""A chaos soak of hot recovery: random kills, freezes, leaves and joins on a 4-node job.

    python -m bench.chaos --events 10 --seed 1
    python -m bench.chaos --trainer lm-hsdp --events 20      # HSDP, 3 nodes x 2 workers

Starts a job of trainers/mlp.py with ``elasticctl up --recovery hot`` on node n1 and
``join`` on n2..n4 (a bench-owned etcd on 127.0.0.1, checkpoints every K steps), then
applies N events drawn by a seeded RNG, keeping 2 to 4 nodes live:

* kill: SIGKILL a node's whole process tree (a machine that died);
* freeze: SIGSTOP the tree for a while (sometimes past the node TTL), then SIGCONT;
* leave: ``elasticctl leave`` a node (it must exit 0);
* join: start a new node with ``join``;
* crash-worker (with 2 workers per node): SIGKILL one worker of a node; its agent restarts
  the node's workers, which rejoin as newcomers (a join of that node's workers);
* short-freeze: SIGSTOP for less than half the node TTL (nobody is dropped).

``--trainer lm-hsdp`` runs trainers/lm.py ``--shard hsdp`` instead, 3 nodes x 2 workers (2 to 3
live, replicas compared per shard); ``--kinds`` picks the event mix (default: kill, freeze, leave,
join, and crash-worker where a node has 2 workers). Events that add workers (join, crash-worker,
a freeze past the TTL) need a join; ``--kinds kill short-freeze leave`` is a mix without one.

After each event it waits, on the record's lines and up to a cap, until the job trains at
the expected world size with exactly the expected nodes. At the end: ``elasticctl down``,
every node exits 0, then the checks: sample accounting and identical replicas
(bench.accounting), no process the soak started left running, no key of the job left in
etcd but its event history. Prints a summary; exits 1 with a one-line reason when a check
fails.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench import accounting
from bench.cluster import Cluster, Node, wait_for
from bench.harness import trained_together, wait_ended
from elasticctl.etcd.client import EtcdClient
from elasticctl.embedded_etcd import EmbeddedEtcd
from elasticctl.job.keys import JobKeys
from elasticctl.job.events import EventLog
from elasticctl.job.records import EventKind

ELASTICCTL = [sys.executable, "-m", "elasticctl.cli"]
MIN_NODES, MAX_NODES = 2, 4
DATASET_SIZE = 2048  # with batch 16: 32 steps an epoch at world 4, so several epochs complete
LM = str(Path(__file__).resolve().parents[1] / "trainers" / "lm.py")
# What a soak trains: (script, its own flags, workers per node, nodes live at least, at most).
TRAINERS = {"mlp": (None, (), 1, MIN_NODES, MAX_NODES),
            "lm-hsdp": (LM, ("--shard", "hsdp"), 2, 2, 3)}
KINDS = ("kill", "freeze", "leave", "join", "crash-worker", "short-freeze")
NEEDS_JOIN = ("join", "crash-worker", "freeze")  # a freeze past the node TTL drops the node, which rejoins


class ChaosFailure(Exception):
    """A check failed; the message is the one-line reason."""


@dataclasses.dataclass
class Event:
    number: int
    kind: str
    node: str
    nodes_after: list[str]
    at: float                    # when the fault (for a freeze: the thaw) happened
    frozen_s: float | None = None
    recovered_s: float | None = None  # until the first step of the expected generation
    # workers of nodes other than ``node`` that were not training before the event but are in
    # the expected generation: restarted by their agent (not a hot recovery)
    others_restarted: int | None = None

    def describe(self) -> str:
        what = f"{self.kind} {self.node}" + (f" for {self.frozen_s:.1f} s" if self.frozen_s is not None else "")
        return f"event {self.number}: {what} -> {len(self.nodes_after)} nodes"


@dataclasses.dataclass(frozen=True)
class Options:
    events: int
    seed: int
    node_ttl: int = 3
    checkpoint_every: int = 10
    step_sleep: float = 0.05
    cap: float = 120.0  # seconds an event may take to recover
    ttl: int | None = None  # the run's key ttl (--rdzv-conf ttl): short, the soak crosses several
    trainer: str = "mlp"  # a key of TRAINERS
    kinds: tuple[str, ...] | None = None  # the event mix; None: default_kinds(trainer)
    replica_check: int | None = None  # --replica-check K (None: the default, every 100 steps)


def default_kinds(trainer: str) -> tuple[str, ...]:
    return ("kill", "freeze", "leave", "join") + (("crash-worker",) if TRAINERS[trainer][2] > 1 else ())


class Soak:
    def __init__(self, options: Options, workdir: Path, etcd: EtcdClient) -> None:
        self.options, self.workdir, self.etcd = options, workdir, etcd
        self.rng = random.Random(options.seed)
        script, flags, self.per_node, self.min_nodes, self.max_nodes = TRAINERS[options.trainer]
        self.kinds = options.kinds or default_kinds(options.trainer)
        checkpoints = workdir / "checkpoints"
        checkpoints.mkdir(parents=True, exist_ok=True)
        trainer = [*flags, "--steps", "100000000", "--batch-size", "16", "--dataset-size", str(DATASET_SIZE),
                   "--step-sleep", str(options.step_sleep), "--log-every", "0",
                   "--checkpoint-every", str(options.checkpoint_every), "--record-params"]
        self.cluster = Cluster("elasticctl", workdir / "job", trainer, etcd,
                               nnodes=f"{self.min_nodes}:{self.max_nodes}",
                               up_args=("--recovery", "hot", "--node-ttl", str(options.node_ttl),
                                        "--checkpoint-dir", str(checkpoints),
                                        *(("--nproc-per-node", str(self.per_node)) if self.per_node > 1 else ()),
                                        *(("--rdzv-conf", f"ttl={options.ttl}") if options.ttl else ()),
                                        *(("--replica-check", str(options.replica_check))
                                          if options.replica_check is not None else ())),
                               **({"script": script} if script else {}))
        self.live: list[str] = []
        self.started = 0
        self.seen: dict[int, psutil.Process] = {}  # every process of every node, for the leftover check
        self.events: list[Event] = []
        self._workers_before: set[tuple[str, int]] = set()  # (node, pid) that trained before the event
        # Nodes whose worker was crashed once: a node's agent quarantines it after 2 failures of its
        # own within 600 s and gives up after --max-restarts (3): the soak crashes each node once.
        self.crashed: set[str] = set()

    # -- running -------------------------------------------------------------------------

    def run(self) -> dict:
        for _ in range(self.max_nodes):
            self._start_node()
        self._wait_trained(Event(0, "start", f"n1..n{self.max_nodes}", list(self.live), time.time()),
                           after_generation=-1)
        for number in range(1, self.options.events + 1):
            self._event(number)
            self._train_a_while()
        return self._finish()

    def _start_node(self) -> str:
        self.started += 1
        name = f"n{self.started}"
        self.cluster.start(name)
        self.live.append(name)
        self._snapshot()
        return name

    def _event(self, number: int) -> None:
        kinds = ([] if len(self.live) <= self.min_nodes else ["kill", "freeze", "leave"]) + \
                ([] if len(self.live) >= self.max_nodes else ["join"]) + \
                (["crash-worker"] if set(self.live) - self.crashed else []) + ["short-freeze"]
        kinds = [kind for kind in kinds if kind in self.kinds]
        if not kinds:
            raise ChaosFailure(f"event {number}: none of the kinds {list(self.kinds)} applies with "
                               f"{len(self.live)} nodes live ({self.min_nodes} to {self.max_nodes})")
        kind = self.rng.choice(kinds)
        generation = self._generation()
        self._snapshot()
        self._workers_before = {(r["node"], r["pid"]) for r in self.cluster.record.steps()}
        if kind == "join":
            at = time.time()
            name = self._start_node()
            event = Event(number, kind, name, list(self.live), at)
        else:
            name = self.rng.choice(self.live if kind != "crash-worker"
                                   else [n for n in self.live if n not in self.crashed])
            node = self.cluster.nodes[name]
            if kind == "kill":
                at = time.time()
                node.signal_tree(signal.SIGKILL)
                node.process.wait(10)
                self.live.remove(name)
                event = Event(number, kind, name, list(self.live), at)
            elif kind == "crash-worker":
                at = time.time()
                self.crashed.add(name)
                self._crash_worker(name, number)
                event = Event(number, kind, name, list(self.live), at)
            elif kind in ("freeze", "short-freeze"):
                longest = 2.0 * self.options.node_ttl if kind == "freeze" else 0.5 * self.options.node_ttl
                frozen = round(self.rng.uniform(min(0.5, longest / 2), longest), 1)
                node.signal_tree(signal.SIGSTOP)
                time.sleep(frozen)  # the freeze itself: an intended duration, not a synchronisation
                node.signal_tree(signal.SIGCONT)
                event = Event(number, kind, name, list(self.live), time.time(), frozen_s=frozen)
                generation = -1  # a short freeze may end in the same generation
            else:
                at = time.time()
                self._leave(name, number)
                self.live.remove(name)
                event = Event(number, kind, name, list(self.live), at)
        print(event.describe(), flush=True)
        self._wait_trained(event, after_generation=generation)

    def _crash_worker(self, name: str, number: int) -> None:
        """SIGKILL one of ``name``'s workers (the newest step line's pid of that node that still runs)."""
        for r in reversed(self.cluster.record.steps()):
            if r["node"] == name and psutil.pid_exists(r["pid"]):
                try:
                    psutil.Process(r["pid"]).kill()
                    return
                except psutil.NoSuchProcess:
                    continue
        raise ChaosFailure(f"event {number}: no running worker of node {name} in the record")

    def _leave(self, name: str, number: int) -> None:
        node = self.cluster.nodes[name]
        cap = self.options.cap
        result = subprocess.run([*ELASTICCTL, "leave", "--etcd", self.cluster.etcd_endpoint, "--job",
                                 self.cluster.job, "--node", name, "--timeout", str(int(cap))],
                                check=False, capture_output=True, text=True, timeout=cap + 30)
        if result.returncode != 0:
            raise ChaosFailure(f"event {number}: `elasticctl leave --node {name}` failed: "
                               f"{result.stderr.strip().splitlines()[-1:]}")
        _wait_clean_exit(node, f"event {number}: node {name}", "leaving")

    def _wait_trained(self, event: Event, after_generation: int) -> None:
        """Until exactly ``event.nodes_after`` train together, in a generation after ``after_generation``."""
        names = set(event.nodes_after)

        world = len(names) * self.per_node

        def reached():
            return first_together(self.cluster.record.steps(event.at, world), names, after_generation,
                                  self.per_node)

        def give_up():
            return any(self.cluster.nodes[n].process.poll() is not None for n in names)

        first = wait_for(reached, self.options.cap, give_up=give_up)
        if first is None:
            gone = {n: self.cluster.nodes[n].process.poll() for n in names
                    if self.cluster.nodes[n].process.poll() is not None}
            why = f"node(s) exited: {gone}" if gone else f"not within {self.options.cap:g} s"
            raise ChaosFailure(f"{event.describe()}: the job did not train at world {world} "
                               f"with {sorted(names)}: {why}")
        event.recovered_s = round(first - event.at, 2)
        if event.number:
            lines = self.cluster.record.steps(event.at, world)
            formed = next(r["generation"] for r in lines if r["time"] == first)
            event.others_restarted = len({(r["node"], r["pid"]) for r in lines if r["generation"] == formed
                                          and r["node"] != event.node} - self._workers_before)
            self.events.append(event)
            restarted = f", {event.others_restarted} other worker(s) restarted" if event.others_restarted else ""
            print(f"  trained at world {world} with {sorted(names)} after {event.recovered_s:.2f} s{restarted}",
                  flush=True)
        self._snapshot()

    def _train_a_while(self) -> None:
        """A random number of steps (0..2K) before the next event, so events land anywhere in the
        checkpoint interval; waited on the record."""
        steps = self.rng.randint(0, 2 * self.options.checkpoint_every)
        target = self._last_step() + steps
        if not wait_for(lambda: self._last_step() >= target, self.options.cap):
            raise ChaosFailure(f"training stalled: no step {target} within {self.options.cap:g} s")

    # -- the end and the checks ----------------------------------------------------------

    def _finish(self) -> dict:
        self._snapshot()
        result = subprocess.run([*ELASTICCTL, "down", "--etcd", self.cluster.etcd_endpoint, "--job",
                                 self.cluster.job, "--timeout", "60"],
                                check=False, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise ChaosFailure(f"`elasticctl down` failed: {result.stderr.strip().splitlines()[-1:]}")
        for name in self.live:
            _wait_clean_exit(self.cluster.nodes[name], f"node {name}", "`down`")
        alive = wait_ended(self.seen.values(), timeout=10)
        if alive:
            raise ChaosFailure(f"{len(alive)} process(es) left running after `down`: "
                               f"{[(p.pid, ' '.join(p.cmdline()[:4])) for p in alive[:3]]}")
        self._check_etcd()
        false_alarms = self._false_alarms()
        if false_alarms:
            raise ChaosFailure(f"{len(false_alarms)} false alarm(s) in a healthy job: {false_alarms[:3]}")
        steps = self.cluster.record.steps()
        try:
            accounting.check_replicas(steps, across_generations=True)
            counted = accounting.check_samples(steps, dataset_size=DATASET_SIZE)
        except accounting.AccountingError as exc:
            raise ChaosFailure(str(exc)) from None
        pids = collections.defaultdict(set)
        for r in steps:
            pids[r["node"]].add(r["pid"])
        return {
            "seed": self.options.seed, "trainer": self.options.trainer, "kinds": list(self.kinds),
            "workers_per_node": self.per_node,
            "events": [dataclasses.asdict(e) for e in self.events],
            "steps": counted.steps, "redone": counted.redone, "epochs_completed": counted.epochs_completed,
            # a node whose workers did not recover in process restarted them: more than one pid
            "worker_restarts": sum(max(0, len(p) - self.per_node) for p in pids.values()),
            "processes_seen": len(self.seen),
            "replica_check": self.options.replica_check, "false_alarms": 0,
        }

    def _false_alarms(self) -> list[str]:
        """What the job's own checks named in a soak whose devices and data are healthy: every
        ``replica_diverged`` (the replica check, through every kill, freeze and join) and
        ``non_finite`` event is one."""
        return [f"{e.kind.value} {e.node or 'job'} step {e.step}: {e.reason}"
                for e in EventLog(self.etcd, JobKeys(self.cluster.job)).read()
                if e.kind in (EventKind.REPLICA_DIVERGED, EventKind.NON_FINITE)]

    def _check_etcd(self) -> None:
        """Nothing of the job left but its event history (a killed node's keys go with its lease: wait for that)."""
        keys = JobKeys(self.cluster.job)

        def leftover():
            return [kv.key.decode() for kv in self.etcd.get_prefix(keys.everything)
                    if not kv.key.decode().startswith(keys.history)]

        if not wait_for(lambda: not leftover(), 3 * self.options.node_ttl + 10):
            left = leftover()
            raise ChaosFailure(f"{len(left)} key(s) of the job left in etcd after `down`: {left[:5]}")

    # -- the record and the processes ----------------------------------------------------

    def _generation(self) -> int:
        return max((r["generation"] for r in self.cluster.record.steps()), default=-1)

    def _last_step(self) -> int:
        return max((r["step"] for r in self.cluster.record.steps()), default=-1)

    def _snapshot(self) -> None:
        node: Node
        for node in self.cluster.nodes.values():
            for proc in node.tree():
                self.seen.setdefault(proc.pid, proc)


def first_together(lines: list[dict], names: set[str], after_generation: int, per_node: int = 1) -> float | None:
    """Time of the first step of a generation after ``after_generation`` whose lines at world
    ``len(names) * per_node`` come from exactly ``names``, each with ``per_node`` workers (every
    one of them trained in it); None if none."""
    together = trained_together(lines, len(names) * per_node, names, since=float("-inf"),
                                after_generation=after_generation, workers_per_node=per_node, exactly=True)
    return min(r["time"] for r in together) if together else None


def join_failed(summary: dict) -> bool:
    """A soak's summary (passed or failed) shows a join that did not work: the failure names an
    event that needs one, or such an event made other nodes' workers restart."""
    return failed_kind(summary.get("failure", "")) in NEEDS_JOIN or any(
        e["kind"] in NEEDS_JOIN and e.get("others_restarted") for e in summary.get("events", []))


def failed_kind(failure: str) -> str | None:
    """The kind of the event a failure message names ("event 7: join n5 -> 3 nodes: ..."), if any."""
    match = re.match(r"event \d+: (\S+) ", failure)
    return match.group(1) if match and match.group(1) in KINDS else None


def _wait_clean_exit(node, who: str, after: str) -> None:
    """Until ``node`` exits, which it must do within 60 s of ``after`` and with status 0."""
    try:
        code = node.process.wait(60)
    except subprocess.TimeoutExpired:
        raise ChaosFailure(f"{who} did not exit within 60 s of {after}") from None
    if code != 0:
        raise ChaosFailure(f"{who} exited with status {code} after {after} (see {node.log_path})")


def soak(options: Options, workdir: Path) -> dict:
    """Run the soak in ``workdir``; the summary, or ChaosFailure. Nothing is left running either way."""
    with EmbeddedEtcd(data_dir=str(workdir / "etcd"), client_port=0, peer_port=0) as server, \
            EtcdClient(server.client_settings()) as etcd:
        chaos = Soak(options, workdir, etcd)
        began = time.monotonic()
        try:
            summary = chaos.run()
        except ChaosFailure as exc:  # what ran before the failure, for a report
            exc.events = [dataclasses.asdict(e) for e in chaos.events]
            raise
        finally:
            chaos.cluster.close()
        summary["duration_s"] = round(time.monotonic() - began, 1)
        summary["ttl"] = options.ttl
        return summary


def summarize(summary: dict) -> str:
    ttl = summary.get("ttl")
    crossed = (f", ttl {ttl} s: {summary['duration_s'] / ttl:.1f} ttl periods crossed"
               if ttl and summary.get("duration_s") else "")
    lines = [f"chaos: {summary.get('trainer', 'mlp')}, seed {summary['seed']}, {len(summary['events'])} events"
             f"{crossed} of {', '.join(summary.get('kinds', default_kinds('mlp')))}: PASSED"]
    for e in summary["events"]:
        frozen = f" for {e['frozen_s']:.1f} s" if e["frozen_s"] is not None else ""
        lines.append(f"  {e['number']:>3}  {e['kind']:<6} {e['node']:<4}{frozen:<12} -> {len(e['nodes_after'])} nodes, "
                     f"training again after {e['recovered_s']:.2f} s")
    by_kind = collections.defaultdict(list)
    for e in summary["events"]:
        by_kind[e["kind"]].append(e["recovered_s"])
    lines.append("  recovery s: " + ", ".join(f"{k} {min(v):.2f}-{max(v):.2f} (n={len(v)})"
                                               for k, v in sorted(by_kind.items())))
    lines.append(f"  {summary['steps']} steps, {summary['redone']} re-done, {summary['epochs_completed']} epochs "
                 f"complete, {summary['worker_restarts']} worker restarts; samples tile every epoch, replicas "
                 f"identical, none of {summary['processes_seen']} processes left, etcd clean, no false alarm "
                 f"(replica check every {summary.get('replica_check') or 100} steps)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=10, help="random events to apply")
    parser.add_argument("--seed", type=int, default=0, help="seed of the events, their nodes and timings")
    parser.add_argument("--keep-workdir", action="store_true", help="keep the logs, record and checkpoints")
    parser.add_argument("--node-ttl", type=int, default=3, help="seconds: a frozen node is dropped after this")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="K: mlp checkpoints every K steps")
    parser.add_argument("--step-sleep", type=float, default=0.05, help="seconds the trainer sleeps per step")
    parser.add_argument("--cap", type=float, default=120.0, help="seconds an event may take to recover")
    parser.add_argument("--trainer", choices=sorted(TRAINERS), default="mlp",
                        help="mlp: 4 nodes x 1 worker; lm-hsdp: trainers/lm.py --shard hsdp, 3 nodes x 2 workers")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=None,
                        help="the event mix (default: kill freeze leave join, and crash-worker with 2 workers "
                             "per node); without join, crash-worker and freeze, no event needs a join")
    parser.add_argument("--replica-check", type=int, default=None, metavar="K",
                        help="the job's --replica-check K (default: elasticctl's, every 100 steps); any "
                             "replica_diverged or non_finite event fails the soak (a false alarm)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="an empty directory for the logs, record and checkpoints (default: a new temporary one)")
    parser.add_argument("--summary", type=Path, default=None,
                        help="write the summary as JSON here (on a failure: the reason and the events before it)")
    parser.add_argument("--ttl", type=int, default=None,
                        help="seconds the run's keys outlive the job (default 7200): a short one, e.g. 20, "
                             "makes a soak cross several ttl periods (a long-running job in minutes)")
    args = parser.parse_args(argv)
    if args.events < 0:
        parser.error("--events must not be negative.")
    if args.ttl is not None and args.ttl < 2:
        parser.error(f"--ttl ({args.ttl}) must be at least 2 seconds.")
    options = Options(events=args.events, seed=args.seed, node_ttl=args.node_ttl,
                      checkpoint_every=args.checkpoint_every, step_sleep=args.step_sleep, cap=args.cap,
                      ttl=args.ttl, trainer=args.trainer, kinds=tuple(args.kinds) if args.kinds else None,
                      replica_check=args.replica_check)
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="chaos-"))
    try:
        summary = soak(options, workdir)
        if args.keep_workdir:
            (workdir / "summary.json").write_text(json.dumps(summary, indent=1))
    except ChaosFailure as exc:
        print(f"chaos: {args.trainer}, seed {args.seed}: FAILED: {exc}", flush=True)
        if args.summary:
            args.summary.write_text(json.dumps({"seed": args.seed, "trainer": args.trainer,
                                                "kinds": list(options.kinds or default_kinds(args.trainer)),
                                                "failure": str(exc), "events": getattr(exc, "events", [])},
                                               indent=1))
        return 1
    finally:
        if args.keep_workdir:
            print(f"chaos: workdir kept: {workdir}", flush=True)
        elif args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.summary:
        args.summary.write_text(json.dumps(summary, indent=1))
    print(summarize(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
