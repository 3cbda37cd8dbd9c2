"""HSDP under hot recovery: a node SIGKILLed to the survivors' first step, and a node joining.

A job of 3 nodes x 2 workers (``elasticctl up --recovery hot --nproc-per-node 2``) trains
trainers/lm.py ``--shard hsdp`` on loopback. Each round SIGKILLs the third node's whole tree and
times the first step at world 4 (and, from rank 0's ``recovery_timeline``, where the seconds
went), then starts a new third node (``join``) and times the first step at world 6 and the bytes its workers
received. Not part of ``bench.run``; ``python -m bench.hsdp_recovery --rounds 3``. Prints one JSON
line per round, then the medians; the survivors never restart (a pid changing is reported).
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
