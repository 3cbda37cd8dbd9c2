"""HSDP under hot recovery: a node SIGKILLed to the survivors' first step, and a node joining.

A job of 3 nodes x 2 workers (``elasticctl up --recovery hot --nproc-per-node 2``) trains
trainers/lm.py ``--shard hsdp`` on loopback. Each round SIGKILLs the third node's whole tree and
times the first step at world 4 (and, from rank 0's ``recovery_timeline``, where the seconds
went), then starts a new third node (``join``) and times the first step at world 6 and the bytes its workers
received. Not part of ``bench.run``; ``python -m bench.hsdp_recovery --rounds 3``. Prints one JSON
line per round, then the medians; the survivors never restart (a pid changing is reported).

FSDP2 with peer copies every 10 steps: :func:`fsdp_peer_copy_round` (``workdir, etcd, cap -> dict``),
a scenario function for ``bench.run``: 3 nodes x 1 worker, SIGKILL a node, the first step at world 2
and the steps re-done.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import tempfile
import time
from pathlib import Path

from bench.cluster import REPO, Cluster, wait_for
from bench.scenarios import _phases
from elasticctl.embedded_etcd import EmbeddedEtcd
from elasticctl.etcd.client import EtcdClient

LM = str(REPO / "trainers" / "lm.py")
NODES = ("a", "b", "c")


def workers_at(cluster: Cluster, world: int, nodes: set[str], since: float, timeout: float) -> list[dict] | None:
    """The step lines at ``world`` since ``since`` once both workers of every node in ``nodes`` wrote one."""
    def reached():
        recent = cluster.record.steps(since, world)
        pids = {(r["node"], r["pid"]) for r in recent if r["node"] in nodes}
        return recent if len(pids) == 2 * len(nodes) else None

    return wait_for(reached, timeout)


def one_round(cluster: Cluster, victim: str, joiner: str, cap: float) -> dict:
    """SIGKILL ``victim``, then start ``joiner`` (a new node id: the victim's record has to expire first)."""
    survivors = set(cluster.nodes) - {victim}
    before = {(r["node"], r["pid"]) for r in cluster.record.steps() if r["node"] in survivors}
    killed = time.time()
    cluster.nodes[victim].signal_tree(signal.SIGKILL)
    cluster.nodes.pop(victim).stop()
    shrunk = workers_at(cluster, 4, survivors, killed, cap)
    if shrunk is None:
        return {"outcome": f"no step at world 4 within {cap:g} s"}
    first = min(r["time"] for r in shrunk)
    steps = cluster.record.steps()
    round_ = {"kill_to_first_step_s": round(first - killed, 3),
              "survivors_restarted": sorted({(r["node"], r["pid"]) for r in shrunk} - before),
              "redone_steps": max(r["step"] for r in steps if r["time"] < first) + 1
              - min(r["step"] for r in shrunk), **_phases(cluster, killed, 4)}
    joined = time.time()
    cluster.start(joiner)
    grown = workers_at(cluster, 6, survivors | {joiner}, joined, cap)
    if grown is None:
        return {**round_, "outcome": f"{joiner} did not join within {cap:g} s"}
    restored = [r for r in cluster.record.read() if r.get("event") == "state_restored" and r["time"] > joined]
    return {**round_, "outcome": "recovered", "join_to_world_6_s": round(min(r["time"] for r in grown) - joined, 3),
            "joiner_shards": sorted((r["shard"], r["source"], r["nbytes"], r["seconds"]) for r in restored)}


PEER_COPIES_EVERY = 10
FSDP_PEER_COPY_TRAINING = ("--shard", "fsdp", "--peer-copies", str(PEER_COPIES_EVERY), "--steps", "10000000",
                           "--step-sleep", "0.05", "--log-every", "0", "--checkpoint-every", "0")


def fsdp_peer_copy_round(workdir: Path, etcd: EtcdClient, cap: float) -> dict:
    """FSDP2 with peer copies every 10 steps (issue 20's target: first step <= 3 s, <= 10 steps re-done,
    no restart, no disk read): 3 nodes x 1 worker of trainers/lm.py ``--shard fsdp --peer-copies 10``
    in hot mode, no checkpoint directory at all; SIGKILL node c half-way between two copy rounds
    (once a periodic round of all 3 workers at world 3 was agreed whole and 5 more steps began),
    then the first step at world 2. The result has ``fsdp_round``'s keys
    (seconds, cap_s, outcome, redone_steps, survivors_restarted, restored_sources,
    resumed_from_checkpoint) and the copies' own: the step the survivors went back to
    (``copy_step``), the newest step trained before (``trained_step``) and the shards' reshard
    (``restore_bytes``: sent by each survivor, ``restore_s``: its slowest)."""
    from bench.scenarios import _recovery

    cluster = Cluster("elasticctl-hot", workdir, list(FSDP_PEER_COPY_TRAINING), etcd, script=LM,
                      up_args=("--node-ttl", "3"))
    try:
        started = time.time()
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
        survivors = {"a", "b"}
        before = {r["pid"] for r in cluster.record.steps() if r["node"] in survivors}
        killed = time.time()
        cluster.nodes["c"].signal_tree(signal.SIGKILL)
        cluster.nodes.pop("c").stop()
        result = _recovery(cluster, killed, 2, survivors, cap)
        if result["seconds"] is None:
            return result
        result["seconds"] = round(result["seconds"], 3)
        after = {r["pid"] for r in cluster.record.steps(killed, 2) if r["node"] in survivors}
        lines = [r for r in cluster.record.read() if r.get("event") and r["time"] > killed]
        restored = [r for r in lines if r["event"] == "state_restored"]
        return {**result, "survivors_restarted": len(after - before),
                "restored_sources": sorted({r["source"] for r in restored}),
                "resumed_from_checkpoint": any(r["event"] == "resume" for r in lines),
                "copy_step": min((r["step"] for r in restored), default=None),
                "trained_step": max((r.get("trained", -1) for r in restored), default=None),
                "restore_bytes": sorted(r.get("nbytes", 0) for r in restored),
                "restore_s": max((r.get("seconds", 0) for r in restored), default=None)}
    finally:
        cluster.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cap", type=float, default=120.0, help="seconds a recovery or a join may take")
    parser.add_argument("--lm-args", nargs=argparse.REMAINDER, default=[],
                        help="more trainers/lm.py flags (e.g. --hidden 256 --layers 4)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hsdp-bench-") as directory:
        workdir = Path(directory)
        etcd = EmbeddedEtcd(data_dir=str(workdir / "etcd"), client_port=0, peer_port=0).start()
        client = EtcdClient(etcd.client_settings())
        cluster = Cluster("elasticctl-hot", workdir / "job", [
            "--shard", "hsdp", "--steps", "10000000", "--step-sleep", "0.05", "--log-every", "0", *args.lm_args],
            client, up_args=("--nproc-per-node", "2", "--node-ttl", "3"), script=LM)
        rounds = []
        try:
            started = time.time()
            for name in NODES:
                cluster.start(name)
            if workers_at(cluster, 6, set(NODES), started, args.cap) is None:
                raise SystemExit(f"the job did not reach world 6 within {args.cap:g} s; see {workdir / 'job'}")
            for number in range(1, args.rounds + 1):
                rounds.append(one_round(cluster, "c" if number == 1 else f"c{number - 1}", f"c{number}", args.cap))
                print(json.dumps(rounds[-1]), flush=True)
        finally:
            cluster.close()
            client.close()
            etcd.stop()
    done = [r for r in rounds if r.get("outcome") == "recovered"]
    medians = {key: round(statistics.median(r[key] for r in done), 3)
               for key in ("kill_to_first_step_s", "join_to_world_6_s")} if done else {}
    print(json.dumps({"rounds": len(rounds), "recovered": len(done), "medians": medians}))
    return 0 if len(done) == len(rounds) else 1


if __name__ == "__main__":
    raise SystemExit(main())
