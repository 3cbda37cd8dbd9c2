"""FSDP2 without replicas survives a lost node from its peers' in-memory copies: real
`elasticctl up/join` processes, real torchrun, a real etcd, loopback; every wait on the trainer's
JSON record, never a sleep.

3 nodes of 2 workers train trainers/lm.py ``--shard fsdp --peer-copies K`` in hot mode: the model
is sharded over all 6 workers, no shard has a replica, and every K steps each worker sends its
shards to a buddy on the next node. The job has no checkpoint directory at all. A node SIGKILLed
whole: the 4 survivors keep their processes, go back to the step of the last copy round (at most K
steps re-done), the lost node's shards come from their buddies' copies, resharded from 6 shards
to 4 in memory, and training goes on at world 4.
"""

from __future__ import annotations

import collections

from support.helpers import REPO, wait_for

LM = str(REPO / "trainers" / "lm.py")
EVERY = 5
FSDP_COPIES = [LM, "--shard", "fsdp", "--peer-copies", str(EVERY), "--steps", "100000", "--step-sleep", "0.05",
               "--log-every", "0", "--checkpoint-every", "0"]


def steps_of(records: list[dict]) -> list[dict]:
    return [r for r in records if "event" not in r]


def pids_by_node(records) -> dict[str, set[int]]:
    pids = collections.defaultdict(set)
    for r in records:
        pids[r["node"]].add(r["pid"])
    return pids


def test_fsdp_survivors_restore_a_lost_node_from_peer_copies(job, tmp_path):
    j = job(nnodes="1:3", extra=["--recovery", "hot", "--node-ttl", "3", "--nproc-per-node", "2"], train=FSDP_COPIES)
    started = {"a": j.up("a")}
    wait_for(j.registry.read_spec, 60, "the job spec in etcd")
    started.update({name: j.join(name) for name in ("b", "c")})

    def copied_at_6():
        """The first copy round every one of the 6 workers agreed on at world 6 (its record lines)."""
        rounds = collections.defaultdict(set)
        for r in j.records():
            if r.get("event") == "peer_copy" and r["world_size"] == 6:
                rounds[r["step"]].add((r["node"], r["pid"]))
        whole = [step for step, workers in rounds.items() if len(workers) == 6]
        return min(whole) if whole else None

    wait_for(copied_at_6, 240, "a peer copy round of all 6 workers at world 6")
    records = j.records()
    pids = pids_by_node(r for r in steps_of(records) if r["world_size"] == 6)
    assert set(pids) == {"a", "b", "c"} and all(len(p) == 2 for p in pids.values()), pids
    copies = [r for r in records if r.get("event") == "peer_copy" and r["world_size"] == 6]
    assert all(len(r["copies_of"]) == 1 and r["nbytes"] > 0 for r in copies), copies[:3]

    latest = {}
    for r in steps_of(j.records()):
        if r["node"] == "c" and r["world_size"] == 6:
            latest[r["pid"]] = r["rank"]
    c_shards = sorted(latest.values())  # a 1-D mesh: a worker's shard index is its rank
    killed_at = max(r["time"] for r in j.records())
    started["c"].kill()

    def going_on_at_4():
        """The step lines at world 4 once both workers of a and b trained EVERY steps there."""
        recent = [r for r in steps_of(j.records()) if r["time"] > killed_at and r["world_size"] == 4]
        if not recent:
            return None
        first = min(r["step"] for r in recent)
        done = pids_by_node(r for r in recent if r["step"] >= first + EVERY)
        return recent if set(done) == {"a", "b"} and all(len(p) == 2 for p in done.values()) else None

    shrunk = wait_for(going_on_at_4, 180, "the survivors training on at world 4")
    assert pids_by_node(shrunk) == {n: pids[n] for n in ("a", "b")}, "a survivor's worker restarted"
    records = j.records()
    restored = [r for r in records if r.get("event") == "state_restored" and r["time"] > killed_at]
    assert len(restored) == 4 and {r["source"] for r in restored} == {"peer_copy"}, restored
    assert not [r for r in records if r.get("event") == "resume"], "a checkpoint was read"
    step = restored[0]["step"]
    assert {r["step"] for r in restored} == {step}, "the survivors went back to different steps"
    assert sorted(r["shard"] for r in restored) == [0, 1, 2, 3]
    # c's two shards of the old mesh came from their buddies' copies (on node a)
    assert len(c_shards) == 2 and all(sorted(r["copies_of"]) == c_shards for r in restored), (c_shards, restored)
    steps = steps_of(records)
    last_at_6 = max(r["step"] for r in steps if r["world_size"] == 6)
    first_at_4 = min(r["step"] for r in steps if r["world_size"] == 4 and r["time"] > killed_at)
    assert first_at_4 == step, (first_at_4, step)
    # at most EVERY committed steps re-done (last_at_6 is the step in flight when c died, maybe not applied)
    assert all(r["redone"] <= EVERY for r in restored), restored
    assert last_at_6 + 1 - first_at_4 <= EVERY + 1, (last_at_6, first_at_4)
