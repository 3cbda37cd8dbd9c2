"""Sharded models under hot recovery: HSDP's lost and joining node, FSDP2 without copies.

HSDP (:func:`hsdp_rounds`): a job of 3 nodes x 2 workers (``elasticctl up --recovery hot
--nproc-per-node 2``) trains trainers/lm.py ``--shard hsdp --record-params`` on loopback. Each
round SIGKILLs the third node's whole tree and times the first step at world 4 (and, from rank
0's ``recovery_timeline``, where the seconds went), counts the steps re-done and the survivors'
processes that restarted, and checks the shards' digests identical across replicas before every
step; then starts a new third node (``join``) and times the first step at world 6, the running
workers' pause (rank 0's last step at world 4 to its first at world 6) and the joiner's shards'
transfer (its workers' ``state_restored`` seconds). A join that does not complete is reported as
``failed`` with its reason, and the next round starts a fresh job.

HSDP freeze (:func:`hsdp_freezes`): the same job, a fresh one per repeat; SIGSTOP node b's whole
tree (its elasticctl, torchrun and workers) and time the first step the survivors record at world
4 (its target: the node TTL + 1 s), with the steps re-done and the survivors' processes kept; then
SIGCONT it: it comes back as a newcomer, timed to every worker at world 6 as a join is. Last, the
whole record's lineage: no sample lost or trained twice (a step in flight may be re-done once).

FSDP2 without copies (:func:`fsdp_round`): 3 nodes x 1 worker, ``--shard fsdp`` (no replica),
checkpoints every 10 steps, the nodes started one at a time once the job checkpointed at the
world before (a hot job that grows restores the checkpoint, resharded: before the first one a
trained state has nowhere to come from); SIGKILL node c 5 steps after a checkpoint at world 3,
then time the first step at world 2. In hot mode the survivors stay in process and restore the newest sharded
checkpoint, resharded (``state_restored`` source ``checkpoint``); in restart mode their workers
restart and resume from it: ``bench.run`` runs both in the same invocation.

FSDP2 with peer copies every 10 steps (:func:`fsdp_peer_copy_round`): 3 nodes x 1 worker, no
checkpoint, SIGKILL a node between two copy rounds, the first step at world 2 and the steps re-done.

    python -m bench.hsdp_recovery --rounds 3          # HSDP rounds
    python -m bench.hsdp_recovery --freeze --rounds 1 # HSDP freezes
    python -m bench.hsdp_recovery --fsdp              # FSDP2 without copies, hot and restart mode
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.accounting import AccountingError, check_replicas, check_samples
from bench.cluster import REPO, Cluster, wait_for
from bench.harness import trained_together
from bench.scenarios import _phases, _recovery
from elasticctl.embedded_etcd import EmbeddedEtcd
from elasticctl.etcd.client import EtcdClient
from elasticctl.job.environment import REBUILD_GROUPS

LM = str(REPO / "trainers" / "lm.py")
NODES = ("a", "b", "c")
WORKERS_PER_NODE = 2  # --nproc-per-node of every HSDP job here
NODE_TTL = 3  # 6 lm workers on 2 cores: the bench's 2 s leaves too little margin for a busy step
HSDP_TRAINING = ("--shard", "hsdp", "--steps", "10000000", "--step-sleep", "0.05", "--log-every", "0",
                 "--record-params")
FSDP_CHECKPOINT_EVERY = 10
FSDP_TRAINING = ("--shard", "fsdp", "--steps", "10000000", "--step-sleep", "0.05", "--log-every", "0",
                 "--checkpoint-every", str(FSDP_CHECKPOINT_EVERY))


class ScenarioFailed(Exception):
    """The job did not get where a measurement starts; the message says where."""


def together_at(steps: list[dict], world: int, nodes: set[str], since: float,
                after_generation: int = -1) -> list[dict] | None:
    """The step lines at ``world`` after ``since`` (of generations after ``after_generation``) once
    both workers of every node in ``nodes`` wrote one there, else None.

    ``after_generation`` keeps out a thawed node's lines of the generation it was frozen in: it may
    still write one at the old world after the SIGCONT, which is no sign of the new world."""
    return trained_together(steps, world, nodes, since=since, after_generation=after_generation,
                            workers_per_node=WORKERS_PER_NODE)


def seconds_to_world(steps: list[dict], event: float, world: int, nodes: set[str],
                     after_generation: int = -1) -> float | None:
    """Seconds from ``event`` (when the bench sent a signal or started a node, wall clock) to the
    first step line at ``world`` after it, once every worker of ``nodes`` trained there; else None."""
    together = together_at(steps, world, nodes, event, after_generation)
    return round(min(r["time"] for r in together) - event, 3) if together else None


def newest_generation(steps: list[dict]) -> int:
    """The newest generation in these step lines (-1: none): a later world forms in a later one."""
    return max((r.get("generation", -1) for r in steps), default=-1)


def workers_at(cluster: Cluster, world: int, nodes: set[str], since: float, timeout: float,
               give_up=lambda: False, after_generation: int = -1) -> list[dict] | None:
    """:func:`together_at` on the record, waited for up to ``timeout`` s."""
    return wait_for(lambda: together_at(cluster.record.steps(), world, nodes, since, after_generation), timeout,
                    give_up=give_up)


def replicas_identical(steps: list[dict]) -> bool | str:
    """True when every shard's replicas had the same digest before every step (per generation),
    else the checker's one-line reason."""
    try:
        check_replicas(steps)
    except AccountingError as exc:
        return str(exc)
    return True


def last_error(cluster: Cluster, names: list[str]) -> str | None:
    """The last line naming an error in these nodes' logs (the reason a join failed), shortened."""
    found = None
    for name in names:
        node = cluster.nodes.get(name)
        if node is None or not node.log_path.exists():
            continue
        for line in node.log_path.read_text(errors="replace").splitlines():
            if "Error" in line or "refus" in line:
                found = line.strip()
    return found[-200:] if found else None


def start_hsdp(workdir: Path, etcd: EtcdClient, cap: float, lm_args: tuple[str, ...] = (),
               rebuild: bool = False) -> Cluster:
    """A job of 3 nodes x 2 workers training HSDP, every worker at world 6; ScenarioFailed if not within ``cap``.
    ``rebuild``: every generation builds its groups, mesh and module anew (``ELASTICCTL_REBUILD_GROUPS=1``),
    the comparison for the mesh kept across the generations a join or a leave makes."""
    cluster = Cluster("elasticctl-hot", workdir, [*HSDP_TRAINING, *lm_args], etcd,
                      up_args=("--nproc-per-node", "2", "--node-ttl", str(NODE_TTL)), script=LM)
    if rebuild:
        cluster.env = {**cluster.env, REBUILD_GROUPS: "1"}
    started = cluster.clock()
    try:
        for name in NODES:
            cluster.start(name)
        if workers_at(cluster, 6, set(NODES), started, cap) is None:
            raise ScenarioFailed(f"the job did not reach world 6 within {cap:g} s "
                                 f"({last_error(cluster, list(NODES)) or 'no error logged'})")
    except BaseException:
        cluster.close()
        raise
    return cluster


def kill_node(cluster: Cluster, victim: str, cap: float) -> dict:
    """SIGKILL ``victim``'s tree: :func:`lose_node`'s measurement."""
    return lose_node(cluster, victim, cap, signal.SIGKILL)


def lose_node(cluster: Cluster, victim: str, cap: float, sig: int) -> dict:
    """Send ``sig`` to ``victim``'s whole tree (SIGKILL: the node is then forgotten; SIGSTOP: it
    stays frozen and in ``cluster.nodes``, for a SIGCONT later): seconds to the survivors' first step
    at world 4, steps re-done, survivors restarted, the shards' replicas identical."""
    survivors = set(cluster.nodes) - {victim}
    before = {(r["node"], r["pid"]) for r in cluster.record.steps() if r["node"] in survivors}
    lost = cluster.clock()
    cluster.nodes[victim].signal_tree(sig)
    if sig == signal.SIGKILL:
        cluster.nodes.pop(victim).stop()
    shrunk = workers_at(cluster, 4, survivors, lost, cap)
    if shrunk is None:
        return {"seconds": None, "cap_s": cap, "outcome": f"none within {cap:g} s"}
    first = min(r["time"] for r in shrunk)
    steps = cluster.record.steps()
    restored = [r for r in cluster.record.read() if r.get("event") == "state_restored" and r["time"] > lost]
    return {"seconds": seconds_to_world(shrunk, lost, 4, survivors), "cap_s": cap, "outcome": "recovered",
            "redone_steps": max(r["step"] for r in steps if r["time"] < first) + 1 - min(r["step"] for r in shrunk),
            "survivors_restarted": len({(r["node"], r["pid"]) for r in shrunk} - before),
            "restored_sources": sorted({r["source"] for r in restored}),
            "replicas_identical": replicas_identical(steps),
            # rank 0 reports its timeline after its first step at world 4: wait for that line
            **(wait_for(lambda: _phases(cluster, lost, 4), 10) or {})}


def join_node(cluster: Cluster, joiner: str, cap: float) -> dict:
    """Start ``joiner``: :func:`node_joins`' measurement."""
    return node_joins(cluster, joiner, cap, lambda: cluster.start(joiner))


def node_joins(cluster: Cluster, joiner: str, cap: float, bring_in: Callable[[], object]) -> dict:
    """``bring_in()`` adds ``joiner`` (starts a new node, or SIGCONTs a frozen one the job dropped):
    seconds to every worker at world 6, the running workers' pause, the joiner's shards' transfer;
    ``failed`` with a reason when it does not get there."""
    members = set(cluster.nodes) | {joiner}
    steps = cluster.record.steps()
    running = {(r["node"], r["pid"]) for r in steps if r["node"] in members - {joiner}}
    # world 6 must form in a later generation: a thawed node's lines of the one it was frozen in do not count
    generation = newest_generation(steps)
    joined = cluster.clock()
    bring_in()
    node = cluster.nodes[joiner]
    grown = workers_at(cluster, 6, members, joined, cap, give_up=lambda: node.process.poll() is not None,
                       after_generation=generation)
    if grown is None:
        why = (f"node {joiner} exited with status {node.process.poll()}" if node.process.poll() is not None
               else f"no step at world 6 within {cap:g} s")
        error = last_error(cluster, sorted(members))
        return {"seconds": None, "cap_s": cap, "outcome": f"failed: {why}" + (f" ({error})" if error else "")}
    first = min(r["time"] for r in grown)
    steps = cluster.record.steps()
    restarted = len({(r["node"], r["pid"]) for r in grown if r["node"] != joiner} - running)
    if restarted:  # e.g. a generation that failed and made the agents restart every worker
        error = last_error(cluster, sorted(members))
        return {"seconds": None, "cap_s": cap, "running_restarted": restarted,
                "outcome": f"failed: {restarted} of the running workers restarted (world 6 after "
                           f"{first - joined:.1f} s)" + (f" ({error})" if error else "")}
    rank0 = sorted(r["time"] for r in steps
                   if r["rank"] == 0 and r["world_size"] == 4 and joined - 60 < r["time"] < first)
    joiner_pids = {r["pid"] for r in grown if r["node"] == joiner}
    # after ``joined``: a thawed node's workers may have kept their processes, and their first restore
    restored = [r for r in cluster.record.read() if r.get("event") == "state_restored"
                and r["pid"] in joiner_pids and r["time"] > joined]
    transfer = max((r.get("seconds") or 0.0 for r in restored), default=None)
    first0 = min((r["time"] for r in grown if r["rank"] == 0), default=None)
    intervals = [b - a for a, b in zip(rank0[-11:], rank0[-10:])]  # rank 0's last 10 steps at world 4
    return {"seconds": seconds_to_world(grown, joined, 6, members, generation), "cap_s": cap, "outcome": "joined",
            # the gap in rank 0's steps across the change (one ordinary step included: step_interval_s)
            "pause_s": round(first0 - max(rank0), 3) if rank0 and first0 else None,
            "step_interval_s": round(statistics.median(intervals), 3) if intervals else None,
            "transfer_s": transfer, "transfer_bytes": sum(r.get("nbytes") or 0 for r in restored),
            "sources": sorted((r.get("shard"), r["source"]) for r in restored),
            "replicas_identical": replicas_identical(steps),
            # where the running workers' pause went (rank 0's timeline of the change, seconds since the start)
            **(wait_for(lambda: _phases(cluster, joined, 6), 10) or {})}


def hsdp_rounds(workdir: Path, etcd: EtcdClient, rounds: int, cap: float, lm_args: tuple[str, ...] = (),
                report=lambda line: None, rebuild: bool = False) -> list[dict]:
    """``rounds`` rounds of {"kill": kill_node's, "join": join_node's}; a round whose job cannot
    start is {"error": reason}. A failed join leaves the job in an unknown state: the next round
    starts a fresh one."""
    results: list[dict] = []
    cluster: Cluster | None = None
    victim = "c"
    try:
        for number in range(1, rounds + 1):
            if cluster is None:
                try:
                    cluster = start_hsdp(workdir / f"hsdp-{'rebuilt-' if rebuild else ''}{number}", etcd, cap,
                                         lm_args, rebuild=rebuild)
                except ScenarioFailed as exc:
                    results.append({"error": str(exc)})
                    report(f"hsdp round {number}: {exc}")
                    continue
                victim = "c"
            kill = kill_node(cluster, victim, cap)
            round_: dict = {"kill": kill}
            if kill["seconds"] is not None:
                victim = f"c{number}"
                round_["join"] = join_node(cluster, victim, cap)
            if kill["seconds"] is None or round_["join"]["seconds"] is None:
                cluster.close()
                cluster = None
            results.append(round_)
            report(f"hsdp{' (groups rebuilt)' if rebuild else ''} round {number}: {json.dumps(round_, default=str)}")
    finally:
        if cluster is not None:
            cluster.close()
    return results


FROZEN = "b"  # not the first node (it ran `up`), nor the last: the survivors are not a prefix of the ranks
# trainers/lm.py's default, passed explicitly: the sample check needs the epoch's length
FREEZE_DATASET_SIZE = 2048


def sample_accounting(steps: list[dict], dataset_size: int) -> dict:
    """Whether the record's lineage (a re-done step counts where it was applied last) trained every
    sample once: ``samples_ok`` with the steps and re-done steps counted, or the check's reason."""
    try:
        counted = check_samples(steps, dataset_size=dataset_size)
    except AccountingError as exc:
        return {"samples_ok": False, "samples_check": str(exc)}
    return {"samples_ok": True, "steps_counted": counted.steps, "steps_redone": counted.redone}


def freeze_node(cluster: Cluster, victim: str, cap: float) -> dict:
    """SIGSTOP ``victim``'s whole tree and time the survivors' first step at world 4 (``freeze``:
    :func:`lose_node`'s keys); then SIGCONT it and time every worker back at world 6 (``thaw``:
    :func:`node_joins`' keys, with ``thawed_restarted``: how many of the thawed node's workers are
    new processes); ``samples``: :func:`sample_accounting` of the whole record."""
    earlier = {r["pid"] for r in cluster.record.steps() if r["node"] == victim}
    result: dict = {"node": victim, "node_ttl_s": NODE_TTL,
                    "freeze": lose_node(cluster, victim, cap, signal.SIGSTOP)}
    if result["freeze"]["seconds"] is not None:
        # the job dropped the frozen node: after the SIGCONT it comes back as a newcomer
        thaw = node_joins(cluster, victim, cap, lambda: cluster.nodes[victim].signal_tree(signal.SIGCONT))
        if thaw["seconds"] is not None:
            thaw["thawed_restarted"] = len({r["pid"] for r in cluster.record.steps(0, 6)
                                            if r["node"] == victim} - earlier)
        result["thaw"] = thaw
    # else the node stays frozen: the caller's cluster.close() sends it SIGCONT before stopping it
    result["samples"] = sample_accounting(cluster.record.steps(), FREEZE_DATASET_SIZE)
    return result


def hsdp_freezes(workdir: Path, etcd: EtcdClient, repeats: int, cap: float,
                 report=lambda line: None) -> list[dict]:
    """``repeats`` jobs of 3 nodes x 2 workers, each with one :func:`freeze_node` of node b; a job
    that cannot start is {"error": reason}. Each job is closed (every tree stopped) before the next."""
    results: list[dict] = []
    for number in range(1, repeats + 1):
        try:
            cluster = start_hsdp(workdir / f"hsdp-freeze-{number}", etcd, cap,
                                 ("--dataset-size", str(FREEZE_DATASET_SIZE)))
        except ScenarioFailed as exc:
            results.append({"error": str(exc)})
            report(f"hsdp freeze {number}: {exc}")
            continue
        try:
            results.append(freeze_node(cluster, FROZEN, cap))
        except Exception as exc:  # noqa: BLE001 - a broken measurement must not cost bench.run the sections after it
            results.append({"error": f"{type(exc).__name__}: {exc}"})
        finally:
            cluster.close()
        report(f"hsdp freeze {number}: {json.dumps(results[-1], default=str)}")
    return results


def kill_c_of_three(cluster: Cluster, cap: float) -> tuple[dict, list[dict]]:
    """SIGKILL node c's tree in a job of a, b, c at 1 worker each: the time to the survivors' first
    step at world 2 (``_recovery``'s result, with the survivors' restarted processes, the sources
    their state was restored from and whether a checkpoint was resumed) and the event lines since."""
    survivors = {"a", "b"}
    before = {r["pid"] for r in cluster.record.steps() if r["node"] in survivors}
    killed = cluster.clock()
    cluster.nodes["c"].signal_tree(signal.SIGKILL)
    cluster.nodes.pop("c").stop()
    result = _recovery(cluster, killed, 2, survivors, cap)
    if result["seconds"] is None:
        return result, []
    result["seconds"] = round(result["seconds"], 3)
    after = {r["pid"] for r in cluster.record.steps(killed, 2) if r["node"] in survivors}
    lines = [r for r in cluster.record.read() if r.get("event") and r["time"] > killed]
    return {**result, "survivors_restarted": len(after - before),
            "restored_sources": sorted({r["source"] for r in lines if r["event"] == "state_restored"}),
            "resumed_from_checkpoint": any(r["event"] == "resume" for r in lines)}, lines


def fsdp_round(system: str, workdir: Path, etcd: EtcdClient, cap: float) -> dict:
    """FSDP2 over 3 nodes x 1 worker, no replica, checkpoints every 10 steps: SIGKILL node c once a
    checkpoint at world 3 exists, then the first step at world 2 (``system``: elasticctl-hot, the
    survivors restore the sharded checkpoint in process; elasticctl, they restart from it)."""
    checkpoints = workdir / "checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(system, workdir, list(FSDP_TRAINING), etcd, script=LM,
                      up_args=("--node-ttl", str(NODE_TTL), "--checkpoint-dir", str(checkpoints)))
    def checkpointed(world: int) -> int | None:
        steps = [r["step"] for r in cluster.record.read() if r.get("event") == "checkpoint"
                 and r.get("world_size") == world]
        return max(steps) if steps else None

    try:
        for world, name in enumerate(NODES, start=1):
            started = cluster.clock()
            cluster.start(name)
            if cluster.wait_world(world, set(NODES[:world]), started, cap) is None:
                return {"seconds": None, "cap_s": cap,
                        "outcome": f"the job did not reach world {world} within {cap:g} s"
                                   + (f" ({error})" if (error := last_error(cluster, list(NODES[:world]))) else "")}
            if wait_for(lambda world=world: checkpointed(world) is not None, cap) is None:
                return {"seconds": None, "cap_s": cap, "outcome": f"no checkpoint at world {world} within {cap:g} s"}
        after = checkpointed(3) + 5  # mid-interval: both modes go back the same few steps
        if not wait_for(lambda: any(r["step"] >= after for r in cluster.record.steps(0, 3)), cap):
            return {"seconds": None, "cap_s": cap, "outcome": f"no step {after} at world 3 within {cap:g} s"}
        return kill_c_of_three(cluster, cap)[0]
    finally:
        cluster.close()


PEER_COPIES_EVERY = 10
FSDP_PEER_COPY_TRAINING = ("--shard", "fsdp", "--peer-copies", str(PEER_COPIES_EVERY), "--steps", "10000000",
                           "--step-sleep", "0.05", "--log-every", "0", "--checkpoint-every", "0")


def fsdp_peer_copy_round(workdir: Path, etcd: EtcdClient, cap: float) -> dict:
    """FSDP2 with peer copies every 10 steps (the target: first step <= 3 s, <= 10 steps re-done,
    no restart, no disk read): 3 nodes x 1 worker of trainers/lm.py ``--shard fsdp --peer-copies 10``
    in hot mode, no checkpoint directory at all; SIGKILL node c half-way between two copy rounds
    (once a periodic round of all 3 workers at world 3 was agreed whole and 5 more steps began),
    then the first step at world 2. The result has ``fsdp_round``'s keys
    (seconds, cap_s, outcome, redone_steps, survivors_restarted, restored_sources,
    resumed_from_checkpoint) and the copies' own: the step the survivors went back to
    (``copy_step``), the newest step trained before (``trained_step``) and the shards' reshard
    (``restore_bytes``: sent by each survivor, ``restore_s``: its slowest)."""

    cluster = Cluster("elasticctl-hot", workdir, list(FSDP_PEER_COPY_TRAINING), etcd, script=LM,
                      up_args=("--node-ttl", "3"))
    try:
        started = cluster.clock()
        for name in NODES:
            cluster.start(name)
        if cluster.wait_world(3, set(NODES), started, cap) is None:
            return {"seconds": None, "cap_s": cap, "outcome": f"the job did not reach world 3 within {cap:g} s"}

        def half_way() -> bool:
            """Half-way to the next round after a periodic round (not a generation's first) of all 3
            workers at world 3 agreed whole: a kill then re-does about half the interval, the typical
            case (right after a round it would re-do one step; right before the next, all of them)."""
            lines = cluster.record.read()
            rounds = [(r["node"], r["step"]) for r in lines if r.get("event") == "peer_copy" and r.get("world_size") == 3]
            first = min((step for _, step in rounds), default=None)
            whole = [step for _, step in rounds if step != first and step % PEER_COPIES_EVERY == 0
                     and sum(1 for _, s in rounds if s == step) == 3]
            newest = max((r["step"] for r in lines if "event" not in r and r.get("world_size") == 3), default=-1)
            return bool(whole) and newest >= min(whole) + PEER_COPIES_EVERY // 2

        if not wait_for(half_way, cap):
            return {"seconds": None, "cap_s": cap, "outcome": f"no peer copy round at world 3 within {cap:g} s"}
        result, lines = kill_c_of_three(cluster, cap)
        if result["seconds"] is None:
            return result
        restored = [r for r in lines if r["event"] == "state_restored"]
        return {**result,
                "copy_step": min((r["step"] for r in restored), default=None),
                "trained_step": max((r.get("trained", -1) for r in restored), default=None),
                "restore_bytes": sorted(r.get("nbytes", 0) for r in restored),
                "restore_s": max((r.get("seconds", 0) for r in restored), default=None)}
    finally:
        cluster.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="HSDP rounds (a kill and a join each)")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 without copies instead, hot and restart mode")
    parser.add_argument("--freeze", action="store_true",
                        help="HSDP freezes instead (SIGSTOP node b, then SIGCONT), --rounds jobs")
    parser.add_argument("--cap", type=float, default=120.0, help="seconds a recovery or a join may take")
    parser.add_argument("--lm-args", nargs=argparse.REMAINDER, default=[],
                        help="more trainers/lm.py flags for HSDP (e.g. --hidden 256 --layers 4)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hsdp-bench-") as directory:
        workdir = Path(directory)
        with EmbeddedEtcd(data_dir=str(workdir / "etcd"), client_port=0, peer_port=0) as server, \
                EtcdClient(server.client_settings()) as client:
            if args.fsdp:
                for system in ("elasticctl-hot", "elasticctl"):
                    print(json.dumps({system: fsdp_round(system, workdir / system, client, args.cap)}), flush=True)
                return 0
            if args.freeze:
                freezes = hsdp_freezes(workdir, client, args.rounds, args.cap, report=print)
                return 0 if all((r.get("thaw") or {}).get("seconds") is not None for r in freezes) else 1
            rounds = hsdp_rounds(workdir, client, args.rounds, args.cap, tuple(args.lm_args), report=print)
    kills = [r["kill"]["seconds"] for r in rounds if r.get("kill", {}).get("seconds") is not None]
    joins = [r["join"]["seconds"] for r in rounds if (r.get("join") or {}).get("seconds") is not None]
    print(json.dumps({"rounds": len(rounds), "recovered": len(kills), "joined": len(joins),
                      "medians": {"kill_to_first_step_s": statistics.median(kills) if kills else None,
                                  "join_to_world_6_s": statistics.median(joins) if joins else None}}))
    return 0 if len(kills) == len(joins) == len(rounds) else 1


if __name__ == "__main__":
    raise SystemExit(main())
