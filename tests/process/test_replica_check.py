"""The replica check in real jobs: `elasticctl up` nodes in hot mode, one replica corrupted by the
trainer's ``--flip-bit STEP:RANK`` knob (one bit of one weight, after step STEP's commit, on that
rank); the next check names its node (a ``replica_diverged`` event) and, with
``--evict-diverged 1``, asks it to leave while the others train on at world 2. A healthy job
checked every other step names nobody.

Every wait is on the job's records or events, never a sleep, and nothing is asserted on seconds:
the jobs run far more steps than the tests need (at --step-sleep 0.05) and end with them. The
corruption must land in a generation of three workers (two replicas that differ have no
majority and stop the job), so the first generation waits for all three nodes: --nnodes 3:3,
or a last call long enough that the third node, started with the others, is always in it.
"""

from __future__ import annotations

from support.helpers import MLP, cli, wait_for
from support.jobs import Job, after, steps_at

from elasticctl.job.events import EventLog, render_line
from elasticctl.job.records import EventKind

CHECK = 5       # --replica-check: steps between checks
FLIP_STEP = 20  # the bit flips right after this step's commit, on rank 1; the next check is at step 25


def replica_job(nodes, etcd, run_id, tmp_path, *, check: int = CHECK, flip: bool = True, evict: bool = False,
                nnodes: str = "3:3") -> Job:
    train = [MLP, "--steps", "100000", "--step-sleep", "0.05", "--log-every", "0", "--checkpoint-every", "20",
             *(["--flip-bit", f"{FLIP_STEP}:1"] if flip else [])]
    extra = ["--recovery", "hot", "--checkpoint-dir", str(tmp_path / "checkpoints"), "--replica-check", str(check),
             *(["--evict-diverged", "1"] if evict else []),
             # MIN below 3: the first generation still waits for the third node, however loaded the machine
             *(["--rdzv-conf", "last_call_timeout=120"] if not nnodes.startswith("3:") else [])]
    return Job(nodes, etcd, run_id, tmp_path, nnodes=nnodes, extra=extra, train=train)


def events_of(job: Job, kind: EventKind, node: str | None = None) -> list:
    return [e for e in EventLog(job.client, job.registry.keys).read()
            if e.kind is kind and (node is None or e.node == node)]


def history(job: Job) -> str:
    return "\n".join(render_line(e) for e in EventLog(job.client, job.registry.keys).read())


def flipped_node(job: Job) -> str:
    """The node whose worker flipped the bit (rank 1 of a generation of three), from its record."""
    flips = wait_for(lambda: [r for r in job.records() if r.get("event") == "bit_flipped"] or None, 180,
                     "the bit flipped")
    assert len(flips) == 1 and flips[0]["rank"] == 1 and flips[0]["world_size"] == 3, flips
    return flips[0]["node"]


def test_a_corrupted_replica_is_named_at_the_next_check_and_trains_on(nodes, default_etcd, run_id, tmp_path):
    job = replica_job(nodes, default_etcd, run_id, tmp_path)
    job.start("a", "b", "c")
    node = flipped_node(job)
    named = wait_for(lambda: events_of(job, EventKind.REPLICA_DIVERGED) or None, 180, "a replica named diverged")
    assert [(e.node, e.step) for e in named] == [(node, FLIP_STEP + CHECK)], history(job)
    assert FLIP_STEP < named[0].step <= FLIP_STEP + CHECK and "rank 1's parameters differ" in named[0].reason
    listed = cli("events", "--etcd", default_etcd.endpoint, "--job", run_id)
    assert any(" replica_diverged " in line and f" {node} " in line for line in listed.stdout.splitlines()), \
        listed.stdout
    # Naming is all it does without --evict-diverged: the job trains on at world 3, and the node
    # is named once in the generation (it stays diverged at every later check)
    job.wait_world(3, {"a", "b", "c"}, since=named[0].time + 1.0)
    wait_for(lambda: max(r["step"] for r in steps_at(job.records(), 3)) >= FLIP_STEP + 6 * CHECK, 180,
             "five more checks")
    assert len(events_of(job, EventKind.REPLICA_DIVERGED)) == 1, history(job)
    assert not events_of(job, EventKind.LEAVE_REQUESTED), history(job)


def test_with_evict_diverged_the_corrupted_node_leaves_and_the_others_train_on(nodes, default_etcd, run_id,
                                                                              tmp_path):
    job = replica_job(nodes, default_etcd, run_id, tmp_path, evict=True, nnodes="2:3")
    started = job.start("a", "b", "c")
    node = flipped_node(job)
    others = {"a", "b", "c"} - {node}
    asked = wait_for(lambda: [e for e in events_of(job, EventKind.REPLICA_DIVERGED, node) if "evicted" in e.reason]
                     or None, 180, f"{node} evicted")[0]
    assert FLIP_STEP < asked.step <= FLIP_STEP + CHECK, render_line(asked)
    assert started[node].wait(120) == 0, started[node].log()
    assert events_of(job, EventKind.LEAVE_REQUESTED, node), history(job)
    shrunk = job.wait_world(2, others, since=asked.time)
    resumed = min(r["step"] for r in shrunk)
    wait_for(lambda: max(r["step"] for r in steps_at(job.records(), 2)) >= resumed + 4 * CHECK, 180,
             "four checks at world 2")
    # The two healthy replicas agree at every check since: nobody else is named, nobody else leaves
    assert {e.node for e in events_of(job, EventKind.REPLICA_DIVERGED)} == {node}, history(job)
    assert {e.node for e in events_of(job, EventKind.LEAVE_REQUESTED)} == {node}, history(job)
    assert {r["node"] for r in after(job.records(), min(r["time"] for r in shrunk)) if "event" not in r} <= others


def test_healthy_replicas_checked_every_other_step_name_nobody(nodes, default_etcd, run_id, tmp_path):
    job = replica_job(nodes, default_etcd, run_id, tmp_path, check=2, flip=False)
    job.start("a", "b", "c")
    wait_for(lambda: max(r["step"] for r in steps_at(job.records(), 3)) >= 100, 300, "100 steps at world 3")
    assert events_of(job, EventKind.REPLICA_DIVERGED) == [], history(job)
    assert not [r for r in job.records() if r.get("event") == "bit_flipped"]
    job.wait_world(3, {"a", "b", "c"}, since=max(r["time"] for r in job.records()))
