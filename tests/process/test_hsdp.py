"""Sharded models (trainers/lm.py --shard hsdp) end to end: real `elasticctl up/join` processes,
real torchrun, a real etcd, loopback; every wait on the trainer's JSON record, never a sleep.

Hot mode with HSDP: 3 nodes of 2 workers, each node a replica of the model sharded
over its 2 workers. A node SIGKILLed whole: the 4 survivors keep their processes, each still
holds its shard with a replica on the other node, and they go on at world 4 from their own
shards, none sent; a node that joins gets each of its workers' shards from the replicas of that
shard index, not from disk. Before every step, the replicas of each shard have identical digests.
Restart mode: a sharded checkpoint written at world 2 resumes at world 1. Plain FSDP over every
worker (no replica): after a node is lost the survivor restores the sharded checkpoint in process.
"""

from __future__ import annotations

import collections
import json
import signal

import psutil
import pytest
import torch
from support.helpers import REPO, cli, trained_together, wait_for

from bench.accounting import check_replicas, check_samples

LM = str(REPO / "trainers" / "lm.py")
HSDP = [LM, "--shard", "hsdp", "--steps", "100000", "--step-sleep", "0.25", "--log-every", "0", "--record-params"]


def steps_of(records: list[dict]) -> list[dict]:
    return [r for r in records if "event" not in r]


def pids_by_node(records: list[dict]) -> dict[str, set[int]]:
    pids = collections.defaultdict(set)
    for r in records:
        pids[r["node"]].add(r["pid"])
    return pids


def wait_workers(j, world: int, nodes: set[str], since: float = 0.0) -> list[dict]:
    """The step lines since ``since`` at ``world`` workers, once each of the 2 workers of every node
    in ``nodes`` wrote one."""
    return wait_for(lambda: trained_together(j.records(), world, nodes, since=since, workers_per_node=2), 180,
                    f"the workers of {sorted(nodes)} training at world size {world}")


def check_shard_replicas(steps: list[dict], world: int) -> None:
    """Every generation of ``world`` workers ran 2 shards, each held by world / 2 replicas whose
    digests matched before every step (check_replicas compares them)."""
    check_replicas(steps)
    holders = collections.defaultdict(set)
    for r in steps:
        if r["world_size"] == world:
            holders[(r["generation"], r["step"], r["shard"])].add(r["rank"])
    assert {shard for _, _, shard in holders} == {0, 1}, holders
    complete = [ranks for ranks in holders.values() if len(ranks) == world // 2]
    assert complete, f"no step at world {world} was recorded by every replica of a shard"


def test_hsdp_survivors_keep_their_shards_through_a_node_lost(job):
    j = job(nnodes="1:3", extra=["--recovery", "hot", "--node-ttl", "3", "--nproc-per-node", "2"], train=HSDP)
    started = {"a": j.up("a")}
    wait_for(j.registry.read_spec, 60, "the job spec in etcd")
    started.update({name: j.join(name) for name in ("b", "c")})
    pids = pids_by_node(wait_workers(j, 6, {"a", "b", "c"}))
    check_shard_replicas(steps_of(j.records()), 6)
    assert {r["shard"] for r in steps_of(j.records()) if r["node"] == "a"} == {0, 1}

    killed_at = max(r["time"] for r in j.records())
    started["c"].kill()
    shrunk = wait_workers(j, 4, {"a", "b"}, since=killed_at)
    assert pids_by_node(shrunk) == {n: pids[n] for n in ("a", "b")}, "a survivor's worker restarted"
    records = j.records()
    steps = steps_of(records)
    last_at_6 = max(r["step"] for r in steps if r["world_size"] == 6)
    # after the kill: on a loaded machine c's workers may have missed the first generation, which
    # then trained at world 4 too
    first_at_4 = min(r["step"] for r in steps if r["world_size"] == 4 and r["time"] > killed_at)
    # nothing re-done: at most the step in flight when c died, which no worker had applied
    assert first_at_4 >= last_at_6, (last_at_6, first_at_4)
    restored = [r for r in records if r.get("event") == "state_restored" and r["time"] > killed_at]
    assert restored == [], f"the survivors' shards all had a replica at the newest step: {restored}"
    check_shard_replicas(steps, 4)


def test_hsdp_a_frozen_node_costs_the_survivors_its_ttl_not_the_mesh_groups_default_timeout(job):
    """A node frozen (SIGSTOP) stays frozen: its lease ends at the node TTL, and the survivors' pending
    collective on the mesh's groups must give up by then too (torch builds a mesh's groups with a
    30-minute timeout unless told otherwise); they re-form at world 4 while it is still frozen."""
    j = job(nnodes="1:3", extra=["--recovery", "hot", "--node-ttl", "3", "--nproc-per-node", "2"], train=HSDP)
    started = {"a": j.up("a")}
    wait_for(j.registry.read_spec, 60, "the job spec in etcd")
    started.update({name: j.join(name) for name in ("b", "c")})
    pids = pids_by_node(wait_workers(j, 6, {"a", "b", "c"}))

    frozen_at = max(r["time"] for r in j.records())
    started["c"].signal_tree(signal.SIGSTOP)
    try:
        shrunk = wait_workers(j, 4, {"a", "b"}, since=frozen_at)
    finally:
        started["c"].signal_tree(signal.SIGCONT)
    assert pids_by_node(shrunk) == {n: pids[n] for n in ("a", "b")}, "a survivor's worker restarted"
    check_shard_replicas(steps_of(j.records()), 4)
    # Each survivor's collective timed out on the frozen node: it kept its groups (reconfigured in
    # place) and re-wrapped its module, which the failed step left half-way, on the same kept mesh.
    shrunk_in = min(r["generation"] for r in shrunk)
    timelines = wait_for(lambda: len(found := [r for r in j.records() if r.get("event") == "recovery_timeline"
                                               and r["round"] == shrunk_in]) == 4 and found, 30,
                         "all four survivors' recovery timelines")
    assert sorted(r["node"] for r in timelines if "group_reconfigured" in r and "rewrapped" in r) == \
        ["a", "a", "b", "b"], timelines



def test_hsdp_with_a_spare_each_of_repeated_failures_costs_one_re_formation(job):
    """Churn on a sharded model: a training node (never the first) SIGKILLed, the spare node admitted
    whole at the survivors' own re-formation, the killed node back as the next spare; twice, the
    second failure killing the spare admitted at the first and admitting the node killed there. Each
    failure is back at world 6 in the generation right after the one the kill ended, with no
    generation that fails to form and no member's state refused."""
    from elasticctl.job.keys import JobKeys

    j = job(nnodes="1:3", extra=["--recovery", "hot", "--node-ttl", "3", "--nproc-per-node", "2",
                                 "--spares", "1"], train=HSDP)
    started = {"a": j.up("a")}
    wait_for(j.registry.read_spec, 60, "the job spec in etcd")
    started.update({name: j.join(name) for name in ("b", "c")})
    wait_workers(j, 6, {"a", "b", "c"})
    keys = JobKeys(j.name).generations()

    def spare_waits(name: str) -> None:
        """Until both workers of the node ``name`` now running declared (a killed node's declarations
        stay until their leases end: the pids tell the new workers')."""
        def declared() -> bool | None:
            tree = {p.pid for p in psutil.Process(started[name].process.pid).children(recursive=True)}
            found = [j.client.get(keys.rdzv_node(f"{name}.{local}")) for local in (0, 1)]
            return all(kv is not None and json.loads(kv.value)["pid"] in tree for kv in found) or None

        wait_for(declared, 180, f"both of {name}'s workers waiting as a spare")

    started["d"] = j.join("d")
    spare_waits("d")
    training, spare = ["a", "b", "c"], "d"
    for failure in range(2):
        victim = training[1 + failure % 2]
        before = max(r["generation"] for r in steps_of(j.records()))
        killed_at = max(r["time"] for r in j.records())
        started[victim].kill()
        training = [n for n in training if n != victim] + [spare]
        wait_workers(j, 6, set(training), since=killed_at)
        after_kill = [r for r in steps_of(j.records()) if r["time"] > killed_at]
        assert {r["generation"] for r in after_kill} <= {before, before + 1}, f"failure {failure}"
        assert {r["world_size"] for r in after_kill} == {6}, f"failure {failure}: the world stayed short"
        if failure == 1:  # the last: the first one's victim, back as the spare, was admitted
            break
        wait_for(lambda: victim not in j.registry.live_nodes() or None, 60, f"{victim}'s node record gone")
        started[victim], spare = j.join(victim), victim
        spare_waits(victim)
    for name, node in started.items():
        assert "did not form" not in node.log() and "far ahead" not in node.log(), f"{name}: {node.log()[-3000:]}"
    check_shard_replicas(steps_of(j.records()), 6)


GPUS_FOR_HSDP = 6  # 3 nodes x 2 workers on one host, each node on GPUs of its own


@pytest.mark.skipif(torch.cuda.device_count() < GPUS_FOR_HSDP,
                    reason=f"HSDP on NCCL needs {GPUS_FOR_HSDP} GPUs (3 nodes x 2 workers, one GPU each); "
                           f"this machine has {torch.cuda.device_count()}")
def test_on_gpus_hsdp_survivors_abort_their_nccl_groups_and_a_joiner_gets_its_shards(job):
    """The NCCL path of sharded hot recovery: the mesh on cuda (device from LOCAL_RANK within
    each node's CUDA_VISIBLE_DEVICES), the survivors' NCCL groups aborted before the next
    generation's are built, the joiner's shards sent by the replicas over NCCL."""
    j = job(nnodes="1:3", extra=["--recovery", "hot", "--node-ttl", "3", "--nproc-per-node", "2"], train=HSDP)
    gpus = {"a": "0,1", "b": "2,3", "c": "4,5"}
    started = {"a": j.up("a", {"CUDA_VISIBLE_DEVICES": gpus["a"]})}
    wait_for(j.registry.read_spec, 60, "the job spec in etcd")
    started.update({name: j.join(name, {"CUDA_VISIBLE_DEVICES": gpus[name]}) for name in ("b", "c")})
    pids = pids_by_node(wait_workers(j, 6, {"a", "b", "c"}))
    killed_at = max(r["time"] for r in j.records())
    started["c"].kill()  # the survivors' NCCL kernels wait on c until their groups are aborted
    shrunk = wait_workers(j, 4, {"a", "b"}, since=killed_at)
    assert pids_by_node(shrunk) == {n: pids[n] for n in ("a", "b")}, "a survivor's worker restarted"
    joined_at = max(r["time"] for r in j.records())
    j.join("d", {"CUDA_VISIBLE_DEVICES": gpus["c"]})  # c's GPUs, now free
    wait_workers(j, 6, {"a", "b", "d"}, since=joined_at)
    restored = [r for r in j.records() if r.get("event") == "state_restored" and r["time"] > joined_at]
    assert {r["source"] for r in restored} == {"replica"}, restored
    check_shard_replicas(steps_of(j.records()), 6)


def test_hsdp_a_joining_node_gets_its_shards_from_replicas(job):
    j = job(nnodes="1:3", extra=["--recovery", "hot", "--node-ttl", "3", "--nproc-per-node", "2"], train=HSDP)
    started = {"a": j.up("a")}
    wait_for(j.registry.read_spec, 60, "the job spec in etcd")
    started["b"] = j.join("b")
    pids = pids_by_node(wait_workers(j, 4, {"a", "b"}))
    first_at_4 = min(r["step"] for r in steps_of(j.records()) if r["world_size"] == 4)

    grown_at = max(r["time"] for r in j.records())
    j.join("c")
    grown = wait_workers(j, 6, {"a", "b", "c"}, since=grown_at)
    assert pids_by_node(r for r in grown if r["node"] in ("a", "b")) == {n: pids[n] for n in ("a", "b")}
    records = j.records()
    d_pids = {r["pid"] for r in grown if r["node"] == "c"}
    assert len(d_pids) == 2 and min(r["step"] for r in grown if r["node"] == "c") > first_at_4
    restored = [r for r in records if r.get("event") == "state_restored" and r["pid"] in d_pids]
    assert sorted((r["source"], r["shard"]) for r in restored) == [("replica", 0), ("replica", 1)], restored
    # each from the two replicas of its shard index, on a and b
    joined_in = min(r["generation"] for r in grown if r["node"] == "c")
    shard_of_rank = {r["rank"]: r["shard"] for r in grown if r["generation"] == joined_in}
    for r in restored:
        assert len(r["senders"]) == 2 and {shard_of_rank[s] for s in r["senders"]} == {r["shard"]}, r
    # A join is agreed at a step boundary: the groups are reconfigured in place, every survivor
    # keeps its sharded module (run(..., sharded="hsdp")), and only the joiners wrap one.
    # (a joiner's first generation has no timeline: nothing was recovered; a survivor's follows its first step)
    timelines = wait_for(lambda: len(found := [r for r in j.records() if r.get("event") == "recovery_timeline"
                                               and r["round"] == joined_in]) == 4 and found, 30,
                         "the four survivors' recovery timelines")
    kept = sorted(r["node"] for r in timelines if "module_kept" in r and "rewrapped" not in r)
    assert kept == ["a", "a", "b", "b"] and all("group_reconfigured" in r for r in timelines), timelines
    # The joiners paid torch's first sharded wrap and step before they were admitted, alone.
    warmed = [r for r in records if r.get("event") == "warmed_up"]
    assert d_pids <= {r["pid"] for r in warmed}, warmed
    steps = steps_of(records)
    check_shard_replicas(steps, 6)
    check_samples(steps, dataset_size=2048)  # lm.py's default: an epoch's last step pads


def test_hsdp_survivors_keep_their_module_when_the_first_node_leaves(job):
    """A leave is agreed at a step boundary too: the groups are reconfigured, and the survivors'
    rows move up (b's replicas were row 1 of 3, now row 0 of 2) on a mesh made when they were not."""
    j = job(nnodes="1:3", extra=["--recovery", "hot", "--node-ttl", "3", "--nproc-per-node", "2"], train=HSDP)
    started = {"a": j.up("a")}
    wait_for(j.registry.read_spec, 60, "the job spec in etcd")
    started["b"] = j.join("b")
    wait_workers(j, 4, {"a", "b"})
    grown_at = max(r["time"] for r in j.records())
    started["c"] = j.join("c")
    pids = pids_by_node(wait_workers(j, 6, {"a", "b", "c"}, since=grown_at))

    left_at = max(r["time"] for r in j.records())
    assert cli("leave", "--etcd", j.etcd.endpoint, "--job", j.name, "--node", "a").returncode == 0
    assert started["a"].wait(60) == 0, started["a"].log()
    smaller = wait_workers(j, 4, {"b", "c"}, since=left_at)
    later = max(r["step"] for r in smaller) + 5  # some steps on the moved rows
    wait_for(lambda: max(r["step"] for r in steps_of(j.records())) >= later, 60, f"step {later} at world 4")
    records = j.records()
    left_in = min(r["generation"] for r in smaller)
    assert pids_by_node(r for r in steps_of(records) if r["generation"] >= left_in) == {n: pids[n] for n in "bc"}
    timelines = [r for r in records if r.get("event") == "recovery_timeline" and r["round"] == left_in]
    assert sorted(r["node"] for r in timelines if "module_kept" in r and "group_reconfigured" in r) == \
        ["b", "b", "c", "c"], timelines
    assert not [r for r in records if r.get("event") == "state_restored" and r["time"] > left_at]
    steps = steps_of(records)
    check_shard_replicas(steps, 4)
    check_samples(steps, dataset_size=2048)


def test_lm_restart_mode_resumes_a_sharded_checkpoint_at_a_smaller_world(job, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    j = job(nnodes="1:2", extra=["--checkpoint-dir", str(checkpoints)],
            train=[LM, "--shard", "hsdp", "--steps", "100000", "--step-sleep", "0.05", "--log-every", "0",
                   "--checkpoint-every", "10"])
    started = j.start("a", "b")
    wait_for(lambda: any(r.get("event") == "checkpoint" and r["world_size"] == 2 for r in j.records()), 120,
             "a sharded checkpoint at world 2")
    killed_at = max(r["time"] for r in j.records())
    started["b"].kill()
    j.wait_world(1, {"a"}, since=killed_at)
    records = j.records()
    resumed = [r for r in records if r.get("event") == "resume" and r["time"] > killed_at]
    assert resumed and resumed[0]["from_world_size"] == 2 and resumed[0]["path"].startswith(str(checkpoints)), resumed
    assert (checkpoints / f"step-{resumed[0]['step']:08d}" / "manifest.json").exists()
    after = [r for r in steps_of(records) if r["time"] > killed_at and r["world_size"] == 1]
    assert min(r["step"] for r in after) == resumed[0]["step"], "the run did not go on from the checkpoint"
    assert min(r["samples_seen"] for r in after) > 0


def test_fsdp_without_replicas_survivor_restores_the_sharded_checkpoint_in_process(job, tmp_path):
    """Plain FSDP over every worker has no replica of a shard; after a node is lost the
    survivor keeps its process and restores the newest sharded checkpoint, resharded to world 1."""
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    j = job(nnodes="1:2", extra=["--recovery", "hot", "--node-ttl", "3", "--checkpoint-dir", str(checkpoints)],
            train=[LM, "--shard", "fsdp", "--steps", "100000", "--step-sleep", "0.05", "--log-every", "0",
                   "--checkpoint-every", "10"])
    started = j.start("a", "b")
    wait_for(lambda: any(r.get("event") == "checkpoint" and r["world_size"] == 2 for r in j.records()), 120,
             "a sharded checkpoint at world 2")
    pid = next(r["pid"] for r in steps_of(j.records()) if r["node"] == "a")
    killed_at = max(r["time"] for r in j.records())
    started["b"].kill()
    alone = j.wait_world(1, {"a"}, since=killed_at)
    assert {r["pid"] for r in alone} == {pid}, "the survivor restarted"
    restored = [r for r in j.records() if r.get("event") == "state_restored" and r["time"] > killed_at]
    assert [r["source"] for r in restored] == ["checkpoint"], restored
    assert restored[0]["path"].startswith(str(checkpoints)) and restored[0]["step"] % 10 == 0, restored
    assert min(r["step"] for r in alone) == restored[0]["step"], "the survivor did not go on from the checkpoint"
