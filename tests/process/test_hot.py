"""Hot recovery with real worker processes on a real etcd: survivors keep their processes.

The workers (tests/support/workers/hot.py) run elasticctl.train directly, without torchrun: the
runtime needs only its environment (etcd, job, node, address, hot settings). Every wait is
on the workers' JSON record, never a sleep.
"""

from __future__ import annotations

import collections
import re
import signal
import sys
import time

import psutil
import pytest
import torch
from support.helpers import WORKERS, read_records, trained_together, wait_for

from bench.accounting import check_replicas, check_samples
from elasticctl.embedded_etcd import EmbeddedEtcd
from elasticctl.job import environment
from elasticctl.job.options import RecoveryMode
from elasticctl.job.settings import HotSettings, StragglerSettings, WorkerSettings

HOT = str(WORKERS / "hot.py")


class HotJob:
    def __init__(self, nodes, etcd, run_id, tmp_path, settings: HotSettings, args=(),
                 stragglers: StragglerSettings | None = None) -> None:
        self.nodes, self.etcd, self.record = nodes, etcd, tmp_path / "record.jsonl"
        # What a node's handler hands its workers in hot mode (no straggler detection unless given).
        worker_settings = WorkerSettings(RecoveryMode.HOT, stragglers, settings)
        self.env = {"ELASTICCTL_ETCD": etcd.endpoint, "ELASTICCTL_JOB": run_id, "ELASTICCTL_NODE_ADDR": "127.0.0.1",
                    environment.WORKER_SETTINGS: worker_settings.to_json(), "LOCAL_RANK": "0"}
        self.args = ["--record", str(self.record), *args]
        self.workers = {}

    def start(self, name: str, local_rank: int = 0, extra=(), env: dict | None = None):
        """``env``: the worker's own variables (e.g. ELASTICCTL_NODE and LOCAL_WORLD_SIZE: one of
        several workers of a node, ``name`` then naming the process, not the node)."""
        env = {**self.env, "LOCAL_RANK": str(local_rank), **(env or {})}
        self.workers[name] = self.nodes(name, [sys.executable, HOT, *self.args, *extra], env=env)
        return self.workers[name]

    def steps(self) -> list[dict]:
        return [r for r in read_records(self.record) if "event" not in r]

    def wait_world(self, names: set[str], since: float = 0.0, timeout: float = 120) -> list[dict]:
        """Until every one of ``names`` trained a step in a generation of exactly them."""
        return wait_for(lambda: trained_together(self.steps(), len(names), names, since=since, exactly=True),
                        timeout, f"{sorted(names)} training together")

    def declarations(self) -> set[str]:
        from elasticctl.etcd.client import EtcdClient
        from elasticctl.job.keys import JobKeys

        with EtcdClient(self.etcd.client_settings()) as client:
            prefix = JobKeys(self.env["ELASTICCTL_JOB"]).generations().rdzv_nodes
            return {kv.key.decode()[len(prefix):] for kv in client.get_prefix(prefix)}

    def last_time(self) -> float:
        return max(r["time"] for r in self.steps())


def check_replicas_and_samples(steps: list[dict]) -> None:
    check_replicas(steps)
    check_samples(steps)


@pytest.fixture
def hot_job(nodes, default_etcd, run_id, tmp_path):
    def make(settings: HotSettings, args=()) -> HotJob:
        return HotJob(nodes, default_etcd, run_id, tmp_path, settings, args)
    return make


def test_survivors_keep_their_processes_through_a_kill_a_join_a_freeze_and_a_leave(hot_job):
    job = hot_job(HotSettings(min_nodes=2, max_nodes=3, node_ttl=3, last_call=1.0, reform_last_call=0.5))
    workers = {name: job.start(name) for name in ("a", "b", "c")}
    first = job.wait_world({"a", "b", "c"})
    pids = {r["node"]: r["pid"] for r in first}

    killed_at = job.last_time()
    workers["c"].kill()
    shrunk = job.wait_world({"a", "b"}, since=killed_at)
    assert {r["node"]: r["pid"] for r in shrunk} == {n: pids[n] for n in ("a", "b")}, "a survivor restarted"

    joined_at = job.last_time()
    d = job.start("d")
    grown = job.wait_world({"a", "b", "d"}, since=joined_at)
    assert min(r["step"] for r in grown if r["node"] == "d") > 0, "the joiner did not get the state"

    frozen_at = job.last_time()
    d.signal_tree(signal.SIGSTOP)
    job.wait_world({"a", "b"}, since=frozen_at)
    thawed_at = job.last_time()
    d.signal_tree(signal.SIGCONT)
    job.wait_world({"a", "b", "d"}, since=thawed_at)

    left_at = job.last_time()
    d.process.send_signal(signal.SIGTERM)
    assert d.wait(60) == 0, d.log()
    after = job.wait_world({"a", "b"}, since=left_at)
    assert {r["node"]: r["pid"] for r in after} == {n: pids[n] for n in ("a", "b")}, "a survivor restarted"

    check_replicas_and_samples(job.steps())


def test_a_newcomer_claiming_a_far_later_step_does_not_send_its_state(hot_job):
    """Without a job secret, any process that can write etcd can join a generation.
    One that claims step 50,000 with constant weights must not become the sender: the state
    comes from the members of the previous generation, which trained together."""
    job = hot_job(HotSettings(min_nodes=2, max_nodes=3, node_ttl=3, last_call=1.0, reform_last_call=0.5))
    for name in ("a", "b"):
        job.start(name)
    before = job.wait_world({"a", "b"})
    impostor = job.start("x", extra=["--claim-step", "50000"])
    joined = job.wait_world({"a", "b", "x"}, since=before[-1]["time"])
    steps = job.steps()
    assert max(r["step"] for r in steps) < 50000, "the impostor's state was taken"
    by_node = {r["node"]: r for r in joined}
    assert by_node["x"]["params"] == by_node["a"]["params"] == by_node["b"]["params"]
    assert by_node["x"]["step"] == by_node["a"]["step"] > before[-1]["step"]  # a and b's state, a step on
    check_replicas_and_samples(steps)
    assert impostor.process.poll() is None


def test_a_joiner_receives_the_state_from_both_survivors_in_many_buckets(hot_job):
    """State transfer: two survivors at one step each send part of the state (buckets of 64 KiB,
    round-robin), point to point into the joiner's own tensors; its fresh optimizer has no
    momentum buffers yet."""
    job = hot_job(HotSettings(min_nodes=2, max_nodes=3, node_ttl=3, last_call=1.0, reform_last_call=0.5),
                  args=["--state-mb", "1", "--transfer-bucket-bytes", str(64 * 1024), "--log-transfers"])
    for name in ("a", "b"):
        job.start(name)
    before = job.wait_world({"a", "b"})
    joiner = job.start("c")
    joined = job.wait_world({"a", "b", "c"}, since=before[-1]["time"])
    by_node = {}
    for r in joined:
        by_node.setdefault(r["node"], r)  # each one's first step together
    assert by_node["c"]["step"] > 0, "the joiner did not get the state"
    assert by_node["c"]["params"] == by_node["a"]["params"] == by_node["b"]["params"]
    received = [line for line in joiner.log().splitlines() if "buckets from rank(s)" in line]
    assert received and re.search(r"from rank\(s\) \d+, \d+ in", received[0]), joiner.log()[-3000:]
    buckets = int(received[0].split(" buckets from")[0].rsplit(" ", 1)[1])
    assert buckets >= 16, received[0]  # the 1 MiB ballast buffer alone is 16 buckets
    check_replicas_and_samples(job.steps())


def test_a_joiner_whose_model_does_not_fit_the_state_is_refused_before_any_copy(hot_job):
    """The description is checked against the joiner's own state first: one sentence on the joiner,
    which ends (its node would restart it); the survivors carry on without it."""
    job = hot_job(HotSettings(min_nodes=2, max_nodes=3, node_ttl=3, last_call=1.0, reform_last_call=0.5))
    for name in ("a", "b"):
        job.start(name)
    before = job.wait_world({"a", "b"})
    misfit = job.start("x", extra=["--hidden", "32"])
    assert misfit.wait(120) != 0, misfit.log()
    assert "The model's tensor '0.weight' received is float32 [16, 8], this worker's is float32 [32, 8]." \
        in misfit.log(), misfit.log()[-3000:]
    job.wait_world({"a", "b"}, since=max(before[-1]["time"], job.last_time()))
    assert not [r for r in job.steps() if r["node"] == "x"], "the misfit trained"
    check_replicas_and_samples(job.steps())


def test_two_failures_in_one_recovery_and_a_sender_killed_mid_transfer(hot_job):
    job = hot_job(HotSettings(min_nodes=2, max_nodes=4, node_ttl=3), args=["--state-mb", "64"])
    workers = {name: job.start(name) for name in ("a", "b", "c", "d")}
    job.wait_world({"a", "b", "c", "d"})

    # Two workers die in one recovery: the second while the others re-form after the first.
    killed_at = job.last_time()
    workers["c"].kill()
    workers["d"].kill()
    job.wait_world({"a", "b"}, since=killed_at)

    # A joiner's state comes from the most advanced member; kill that one as soon as the
    # joiner has declared: the transfer (64 MB) fails on the others, who re-form and finish it.
    joined_at = job.last_time()
    latest = max(r["generation"] for r in job.steps())
    sender = next(r["node"] for r in job.steps() if r["generation"] == latest and r["rank"] == 0)
    survivor = ({"a", "b"} - {sender}).pop()
    workers["e"] = job.start("e")
    wait_for(lambda: "e.0" in job.declarations(), 120, "e's declaration")
    workers[sender].kill()
    job.wait_world({survivor, "e"}, since=joined_at)
    check_replicas_and_samples(job.steps())


@pytest.mark.skipif(torch.cuda.device_count() < 3,
                    reason=f"the NCCL path needs a GPU per worker, 3; this machine has {torch.cuda.device_count()}")
def test_on_gpus_survivors_of_a_kill_abort_and_rebuild_their_nccl_group(hot_job):
    job = hot_job(HotSettings(min_nodes=2, max_nodes=3, node_ttl=5))
    workers = {name: job.start(name, local_rank=i) for i, name in enumerate(("a", "b", "c"))}
    first = job.wait_world({"a", "b", "c"})
    killed_at = job.last_time()
    workers["c"].kill()  # the survivors' NCCL kernels wait on c until the group is aborted
    shrunk = job.wait_world({"a", "b"}, since=killed_at)
    pids = {r["node"]: r["pid"] for r in first}
    assert {r["node"]: r["pid"] for r in shrunk} == {n: pids[n] for n in ("a", "b")}, "a survivor restarted"
    joined_at = job.last_time()
    job.start("d", local_rank=2)  # c's GPU, now free
    job.wait_world({"a", "b", "d"}, since=joined_at)
    check_replicas_and_samples(job.steps())


def test_a_stop_right_after_a_boundary_read_the_flag_waits_for_the_next_boundary(hot_job, tmp_path):
    """What a boundary sends and what it records come from one read of the stop flag. b is told
    to stop at its third boundary together with a, and sends "leaving" at the fourth; a is told
    at that fourth boundary just after it read the flag (the runtime's seam, not a timing), so it
    sends "not leaving" there, as it records. At the fifth, b leaves and a stays: both save the
    step first, and a, told to stop too, leaves with it. Both end the same way, with the same
    step saved once. Had a sent "leaving" while recording that it did not, b would enter the
    whole job's final checkpoint and a would re-form without it: b's checkpoint would fail."""
    checkpoints = tmp_path / "checkpoints"
    job = hot_job(HotSettings(min_nodes=1, max_nodes=2, node_ttl=5, last_call=1.0, reform_last_call=0.5))
    job.env["ELASTICCTL_CHECKPOINT_DIR"] = str(checkpoints)
    workers = {"a": job.start("a", extra=["--stop-after-read-at", "4", "--step-sleep", "0.2"]),
               "b": job.start("b", extra=["--stop-after-read-at", "3", "--step-sleep", "0.2"])}
    for name, worker in workers.items():
        assert worker.wait(120) == 0, f"{name}\n{worker.log()[-3000:]}"
    left = {name: re.findall(r"\] left at step (\d+)(.*)", worker.log()) for name, worker in workers.items()}
    assert left["a"] == left["b"] and len(left["a"]) == 1, left  # the same step, the same way
    step = int(left["a"][0][0])
    assert sorted(p.name for p in checkpoints.iterdir() if p.suffix == ".pt") == [f"step-{step:08d}.pt"]
    assert not any("final checkpoint" in worker.log() for worker in workers.values())  # no retry, no failure


def test_sigterm_ends_the_wait_for_a_generation(hot_job):
    job = hot_job(HotSettings(min_nodes=2, max_nodes=2, node_ttl=5, join_timeout=600))
    alone = job.start("a")
    wait_for(lambda: job.declarations(), 60, "a's declaration for the first generation")
    alone.process.send_signal(signal.SIGTERM)
    assert alone.wait(30) == 0, alone.log()  # not join_timeout (600 s) later
    assert "told to stop while it waited for a generation" in alone.log()
    assert job.declarations() == set(), "the declaration is withdrawn, not left to its lease"


def test_a_recovery_rides_out_an_etcd_restart(nodes, run_id, tmp_path):
    etcd = EmbeddedEtcd(data_dir=str(tmp_path / "etcd"), client_port=0, peer_port=0).start()
    try:
        job = HotJob(nodes, etcd, run_id, tmp_path, HotSettings(min_nodes=2, max_nodes=3, node_ttl=5))
        workers = {name: job.start(name) for name in ("a", "b", "c")}
        job.wait_world({"a", "b", "c"})
        killed_at = job.last_time()
        etcd.stop()  # the survivors re-form while etcd is away, and finish once it is back
        workers["c"].kill()
        etcd.start()
        job.wait_world({"a", "b"}, since=killed_at)
        check_replicas_and_samples(job.steps())
    finally:
        etcd.stop()


def test_elasticctl_runs_a_hot_job_whose_survivors_keep_training_and_which_goes_down_whole(
        nodes, default_etcd, run_id, tmp_path):
    from test_orchestrator import Job, cli

    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    job = Job(nodes, default_etcd, run_id, tmp_path, extra=["--recovery", "hot", "--checkpoint-dir", str(checkpoints),
                                                            "--node-ttl", "3"],
              train=[HOT, "--checkpoint-every", "50"])
    started = job.start("a", "b", "c")
    first = job.records()
    pids = {r["node"]: r["pid"] for r in first if "event" not in r}

    killed_at = max(r["time"] for r in first)
    started["c"].kill()
    shrunk = job.wait_world(2, {"a", "b"}, since=killed_at)
    assert {r["node"]: r["pid"] for r in shrunk} == {n: pids[n] for n in ("a", "b")}, "a survivor restarted"
    assert job.registry.members()["a"]["restarts"] == 0
    status = job.status()
    assert status["recovery"] == "hot" and status["world_size"] == 2, status
    ranks = {n["id"]: n.get("rank") for n in status["nodes"]}
    assert {ranks["a"], ranks["b"]} == {0, 1} and ranks.get("c") is None, ranks  # c: until its record expires
    assert "generation" in cli("status", "--etcd", default_etcd.endpoint, "--job", run_id).stdout

    left_at = max(r["time"] for r in job.records())
    d = job.join("d")
    job.wait_world(3, {"a", "b", "d"}, since=left_at)
    assert cli("leave", "--etcd", default_etcd.endpoint, "--job", run_id, "--node", "d").returncode == 0
    assert d.wait(60) == 0, d.log()
    job.wait_world(2, {"a", "b"}, since=max(r["time"] for r in job.records()))

    assert cli("down", "--etcd", default_etcd.endpoint, "--job", run_id).returncode == 0
    for name in ("a", "b"):
        assert started[name].wait(60) == 0, started[name].log()
    steps = [r for r in job.records() if "event" not in r]
    check_replicas_and_samples(steps)
    # the whole job went down: a final checkpoint at the last step trained
    last = max(r["step"] for r in steps) + 1
    assert (checkpoints / f"step-{last:08d}.pt").exists(), sorted(p.name for p in checkpoints.iterdir())


def test_two_workers_per_node_a_lost_node_takes_both_and_a_crashed_worker_restarts_only_its_node(
        nodes, default_etcd, run_id, tmp_path):
    """Several workers per node in hot mode. A node's loss takes both its workers and
    the other nodes' four keep their processes; one worker crashing on a node that keeps its other
    worker: that node's agent restarts its two workers (torchrun restarts a node's worker group
    as one), they rejoin as newcomers and get the state, and the other node never restarts."""
    from test_orchestrator import Job

    job = Job(nodes, default_etcd, run_id, tmp_path, nnodes="1:3",
              extra=["--recovery", "hot", "--node-ttl", "3", "--nproc-per-node", "2"], train=[HOT])
    started = {"a": job.up("a")}
    wait_for(job.registry.read_spec, 60, "the job spec in etcd")
    started.update({name: job.join(name) for name in ("b", "c")})
    def both_workers_of(names: set[str], world: int, since: float = 0.0) -> dict[str, set[int]]:
        """Each node's two workers trained at ``world`` after ``since`` (a node's two workers log a
        step at slightly different moments: waiting for the node is not waiting for both)."""
        def found():
            pids = collections.defaultdict(set)
            for r in job.records():
                if "event" not in r and r["world_size"] == world and r["time"] > since and r["node"] in names:
                    pids[r["node"]].add(r["pid"])
            return pids if set(pids) == names and all(len(p) >= 2 for p in pids.values()) else None

        return wait_for(found, 180, f"both workers of each of {sorted(names)} training at world {world}")

    pids = both_workers_of({"a", "b", "c"}, 6)
    assert all(len(p) == 2 for p in pids.values()), pids

    killed_at = max(r["time"] for r in job.records())
    started["c"].kill()
    shrunk = both_workers_of({"a", "b"}, 4, since=killed_at)
    assert shrunk["a"] | shrunk["b"] == pids["a"] | pids["b"], "a survivor's worker restarted"

    crashed_at = max(r["time"] for r in job.records())
    victim = min(pids["b"])
    psutil.Process(victim).kill()

    def rejoined():  # both of b's new workers trained at world 4 (b's old one may still log a step first)
        recent = [r for r in job.records() if "event" not in r and r["time"] > crashed_at and r["world_size"] == 4]
        return recent if len({r["pid"] for r in recent if r["node"] == "b"} - pids["b"]) == 2 else None

    recent = wait_for(rejoined, 180, "b's two new workers training at world 4")
    rejoined_in = min(r["generation"] for r in recent if r["node"] == "b" and r["pid"] not in pids["b"])
    back = [r for r in recent if r["generation"] >= rejoined_in]
    by_node = collections.defaultdict(set)
    for r in back:
        by_node[r["node"]].add(r["pid"])
    assert by_node["a"] == pids["a"], "the node that kept both workers restarted one"
    assert len(by_node["b"]) == 2 and not by_node["b"] & pids["b"], "b's agent restarts its worker group whole"
    assert min(r["step"] for r in back if r["node"] == "b") > 0, "b's new workers did not get the state"

    steps = [r for r in job.records() if "event" not in r]
    check_replicas_and_samples(steps)


def test_a_hot_recovery_reports_its_timeline_to_the_script_and_the_history(nodes, default_etcd, run_id, tmp_path):
    """Where a recovery's seconds go. The survivor's script hears a ``recovery_timeline`` (fault
    seen, then each phase's end, in order) and the job's history says the same in its
    ``recovery_finished``. A failure builds the group anew (train/worker/lifecycle.py)."""
    from test_orchestrator import Job

    from elasticctl.job.events import EventLog
    from elasticctl.job.keys import JobKeys
    from elasticctl.job.records import EventKind
    from elasticctl.train.recovery.timeline import RECOVERY_PHASES

    job = Job(nodes, default_etcd, run_id, tmp_path, nnodes="1:2", extra=["--recovery", "hot", "--node-ttl", "3"])
    started = job.start("a", "b")
    killed_at = time.time()
    started["b"].kill()
    job.wait_world(1, {"a"}, since=killed_at)
    timelines = wait_for(lambda: [r for r in job.records() if r.get("event") == "recovery_timeline"
                                  and r["noticed"] > killed_at], 60, "the survivor's recovery timeline")
    timeline = timelines[0]
    # every phase ran (the state is in sync at world 1) but the re-wrap or the kept module, which only
    # a sharded model has, and the reconfigure in place, which a lost peer's failure does not do
    only_some = ("rewrapped", "module_kept", "group_reconfigured")
    ends = [timeline[phase] for phase in RECOVERY_PHASES if phase not in only_some]
    assert not set(only_some) & set(timeline), timeline
    assert ends == sorted(ends) and 0 <= ends[0], timeline
    history = EventLog(job.client, JobKeys(run_id))
    finished = wait_for(lambda: [e for e in history.read(since=killed_at) if e.kind is EventKind.RECOVERY_FINISHED],
                        30, "recovery_finished in the history")
    assert "generation sealed +" in finished[0].reason and finished[0].reason.endswith(
        f"first step +{timeline['first_step']:.3f} s"), finished[0].reason


@pytest.mark.parametrize("rebuild", [False, True], ids=["reconfigured", "rebuilt-as-asked"])
def test_a_join_reconfigures_the_survivors_group_in_place(nodes, default_etcd, run_id, tmp_path, rebuild):
    """A change every member agreed on at a boundary (here a join) re-forms the survivors' one
    process group in place (train/groups/reconfigure.py); ELASTICCTL_REBUILD_GROUPS=1 builds one anew,
    as a failure does. The survivor's timeline names which; the training goes on either way."""
    from support.jobs import TRAIN
    from test_orchestrator import Job

    env = {"ELASTICCTL_REBUILD_GROUPS": "1"} if rebuild else None
    job = Job(nodes, default_etcd, run_id, tmp_path, nnodes="1:2", extra=["--recovery", "hot", "--node-ttl", "3"],
              train=[*TRAIN, "--record-params"])
    job.up("a", env)
    job.wait_world(1, {"a"})
    joined_at = time.time()
    job.join("b", env)
    job.wait_world(2, {"a", "b"}, since=joined_at)
    timeline = wait_for(lambda: [r for r in job.records() if r.get("event") == "recovery_timeline"
                                 and r.get("node") == "a" and r["noticed"] > joined_at], 60,
                        "the survivor's timeline of the join")[0]
    assert ("group_built" in timeline) is rebuild and ("group_reconfigured" in timeline) is not rebuild, timeline
    check_replicas([r for r in job.records() if "event" not in r])
