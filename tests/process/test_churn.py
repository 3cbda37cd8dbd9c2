"""Repeated failures in hot mode, and a frozen node's return: real worker processes on a real etcd.

A member is killed again and again, and the killed node comes back (the next spare, when the job
has one). Every failure must cost one re-formation: back at full world in the generation right
after the one the kill ended, with every survivor in it, no generation that fails to form and no
member's state refused. A node frozen past its TTL while the other trains on alone is a newcomer
when it returns: the steps trained without it are kept, none is trained twice, and every sample
of every epoch is trained exactly once. Every wait is on the workers' records or keys.
"""

from __future__ import annotations

import collections
import json
import signal

import pytest
from support.helpers import wait_for
from test_hot import HotJob, hot_job  # noqa: F401 - the fixture

from bench.accounting import check_replicas, check_samples
from elasticctl.etcd.client import EtcdClient
from elasticctl.job.keys import JobKeys
from elasticctl.job.settings import HotSettings

pytestmark = pytest.mark.slow

FAILURES = 4
# Restart mode starts each victim's replacement under a new name (b1, b2, ...), so its failures
# repeat with a period of two: a first member killed, then the replacement that took its place.
RESTART_FAILURES = 2
DATASET = 256  # 64 steps an epoch at world 1, batch 4: the freeze crosses an epoch's end


def declared_pid(job: HotJob, worker: str) -> int | None:
    """The pid in ``worker``'s generation declaration (None: it has none)."""
    with EtcdClient(job.etcd.client_settings()) as client:
        kv = client.get(JobKeys(job.env["ELASTICCTL_JOB"]).generations().rdzv_node(worker))
    return None if kv is None else json.loads(kv.value)["pid"]


def generations_after(job: HotJob, since: float) -> dict[int, set[str]]:
    """The generations that trained a step after ``since``: their number -> the nodes in them."""
    seen = collections.defaultdict(set)
    for r in job.steps():
        if r["time"] > since:
            seen[r["generation"]].add(r["node"])
    return dict(seen)


def no_failed_formation_nor_refusal(job: HotJob) -> None:
    for name, worker in job.workers.items():
        log = worker.log()
        assert "did not form" not in log, f"{name}: a generation failed to form\n{log[-3000:]}"
        assert "far ahead" not in log, f"{name}: a member's state was refused\n{log[-3000:]}"


def repeated_steps(steps: list[dict]) -> dict[int, list[int]]:
    """Step numbers recorded in more than one generation, beyond the one a failure may interrupt:
    the last step a generation recorded can be in flight when it ends (recorded, never applied)
    and is then trained in the next one. Any other repeat is a step trained twice."""
    generations_of = collections.defaultdict(set)
    last_of = collections.defaultdict(int)
    for r in steps:
        generations_of[r["step"]].add(r["generation"])
        last_of[r["generation"]] = max(last_of[r["generation"]], r["step"])
    return {step: sorted(gens) for step, gens in generations_of.items()
            if len(gens) > 1 and any(step != last_of[g] for g in sorted(gens)[:-1])}


def processes_of(name: str, per_node: int) -> list[str]:
    """The names the test gives the worker processes of node ``name`` (one: the node's own)."""
    return [name] if per_node == 1 else [f"{name}{local_rank}" for local_rank in range(per_node)]


def start_node(job: HotJob, name: str, per_node: int) -> None:
    for local_rank, process in enumerate(processes_of(name, per_node)):
        job.start(process, local_rank, env={"ELASTICCTL_NODE": name, "LOCAL_WORLD_SIZE": str(per_node)})


def kill_node(job: HotJob, name: str, per_node: int) -> None:
    """SIGKILL every worker of node ``name`` at once, as a host's death does (killed one by one with
    a wait between, a worker could notice the first death and re-declare before its own)."""
    for process in processes_of(name, per_node):
        job.workers[process].signal_tree(signal.SIGKILL)
    for process in processes_of(name, per_node):
        job.workers[process].process.wait(10)


def wait_waiting(job: HotJob, name: str, per_node: int) -> None:
    """Until every worker process of node ``name`` now running waits in the rendezvous."""
    for local_rank, process in enumerate(processes_of(name, per_node)):
        pid = job.workers[process].process.pid
        wait_for(lambda worker=f"{name}.{local_rank}", pid=pid: declared_pid(job, worker) == pid or None, 120,
                 f"{name}'s worker {local_rank} waiting in the rendezvous")


def wait_nodes(job: HotJob, names: set[str], per_node: int, since: float) -> dict[int, set[str]]:
    """Until the nodes ``names`` trained a step together, all their workers, after ``since``; the
    generations that trained since then (number -> nodes)."""
    def reached():
        seen = collections.defaultdict(set)
        for r in job.steps():
            if r["time"] > since and r["world_size"] == per_node * len(names):
                seen[r["generation"]].add(r["node"])
        return any(nodes == names for nodes in seen.values()) or None

    wait_for(reached, 120, f"{sorted(names)} training together")
    return generations_after(job, since)


@pytest.mark.parametrize(("spare", "per_node"), [(True, 1), (False, 1), (True, 2)],
                         ids=["one-spare", "no-spare", "one-spare-two-workers-a-node"])
def test_each_of_repeated_failures_costs_one_re_formation(hot_job, spare, per_node):
    job = hot_job(HotSettings(min_nodes=1, max_nodes=3, node_ttl=3, last_call=1.0, reform_last_call=0.5))
    for name in ("a", "b", "c"):
        start_node(job, name, per_node)
    wait_nodes(job, {"a", "b", "c"}, per_node, 0.0)
    training, waiting = ["a", "b", "c"], None
    if spare:
        waiting = "d"
        start_node(job, waiting, per_node)
        wait_waiting(job, waiting, per_node)

    for failure in range(FAILURES):
        victim = training[1 + failure % 2]  # never the first node
        before = max(r["generation"] for r in job.steps())
        killed_at = job.last_time()
        kill_node(job, victim, per_node)
        survivors = [n for n in training if n != victim]
        if waiting is not None:
            training = survivors + [waiting]
            seen = wait_nodes(job, set(training), per_node, killed_at)
            # Every survivor and the spare in the generation right after the kill: nobody left out,
            # no second re-formation (a step or two of the old generation may be recorded before
            # the survivors notice).
            assert set(seen) <= {before, before + 1}, f"failure {failure}: generations {seen}"
            assert seen[before + 1] == set(training), f"failure {failure}: generations {seen}"
            assert not [r for r in job.steps() if r["time"] > killed_at and r["world_size"] != 3 * per_node], \
                f"failure {failure}: the world stayed short"
            waiting = victim
            if failure < FAILURES - 1:  # the killed node comes back: the next spare (the next failure admits it)
                start_node(job, victim, per_node)
                wait_waiting(job, victim, per_node)
        else:
            seen = wait_nodes(job, set(survivors), per_node, killed_at)
            assert set(seen) <= {before, before + 1}, f"failure {failure}: generations {seen}"
            back_at = job.last_time()
            start_node(job, victim, per_node)
            wait_nodes(job, set(training), per_node, back_at)
    no_failed_formation_nor_refusal(job)
    steps = job.steps()
    check_replicas(steps)
    check_samples(steps)
    assert not repeated_steps(steps), repeated_steps(steps)


def test_a_frozen_node_returns_as_a_newcomer_and_nothing_is_trained_twice(hot_job):
    job = hot_job(HotSettings(min_nodes=1, max_nodes=2, node_ttl=3, last_call=1.0, reform_last_call=0.5),
                  ["--dataset-size", str(DATASET)])
    a, c = job.start("a"), job.start("c")
    job.wait_world({"a", "c"})

    frozen_at = job.last_time()
    c.signal_tree(signal.SIGSTOP)
    alone = job.wait_world({"a"}, since=frozen_at)
    start = min(r["step"] for r in alone)
    # a trains on alone past the end of an epoch before c returns
    wait_for(lambda: max(r["step"] for r in job.steps()) >= start + DATASET // 4 + 10 or None, 180,
             "a training alone past an epoch's end")
    trained_alone = max(r["step"] for r in job.steps())
    thawed_at = job.last_time()
    c.signal_tree(signal.SIGCONT)
    together = job.wait_world({"a", "c"}, since=thawed_at)
    assert min(r["step"] for r in together) >= trained_alone, "the job went back past steps a trained alone"
    wait_for(lambda: max(r["step"] for r in job.steps()) >= trained_alone + 20 or None, 120, "20 more steps")

    steps = job.steps()
    assert not repeated_steps(steps), f"steps trained twice: {repeated_steps(steps)}"
    check_replicas(steps)
    check_samples(steps, dataset_size=DATASET)
    no_failed_formation_nor_refusal(job)


def test_a_node_with_more_workers_than_the_others_is_one_node_a_spare_beside_a_full_world(hot_job):
    """MAX counts nodes whatever their worker count: beside a full world of three one-worker nodes, a
    node that brings two workers waits warm (a spare: no re-formation, no step); when a member is lost,
    both of its workers take the place at once."""
    job = hot_job(HotSettings(min_nodes=1, max_nodes=3, node_ttl=3, last_call=1.0, reform_last_call=0.5))
    for name in ("a", "b", "c"):
        job.start(name)
    job.wait_world({"a", "b", "c"})
    for local_rank in (0, 1):
        job.start(f"d{local_rank}", local_rank, env={"ELASTICCTL_NODE": "d", "LOCAL_WORLD_SIZE": "2"})
    for local_rank in (0, 1):
        wait_for(lambda local_rank=local_rank: declared_pid(job, f"d.{local_rank}"), 120,
                 f"d's worker {local_rank} waiting in the rendezvous")
    full = max(r["generation"] for r in job.steps())
    since = job.last_time()
    wait_for(lambda: len([r for r in job.steps() if r["time"] > since]) >= 60 or None, 120, "20 more steps")
    assert max(r["generation"] for r in job.steps()) == full, "the node of two workers forced a re-formation"
    assert not [r for r in job.steps() if r["node"] == "d"], "the node of two workers trained beside a full world"

    killed_at = job.last_time()
    job.workers["c"].kill()
    # Two steps at world 4: every member of the first one has written its record by the time any
    # member writes the second's (the second's all-reduce waits for each of them).
    back = wait_for(lambda: (lambda at_4: at_4 if len({r["step"] for r in at_4}) >= 2 else None)(
        [r for r in job.steps() if r["time"] > killed_at and r["world_size"] == 4]),
        120, "a, b and both of d's workers training at world 4")
    first = min(r["step"] for r in back)
    back = [r for r in back if r["step"] == first]
    assert {r["node"] for r in back} == {"a", "b", "d"}, back[:4]
    assert max(r["generation"] for r in back) == full + 1, "more than one re-formation"
    check_replicas(job.steps())
    check_samples(job.steps())


def test_restart_mode_survives_its_two_first_ranks_freezing_together(nodes, default_etcd, run_id, tmp_path):
    """Ranks 0 and 1 frozen at once (two hosts behind one switch): a third member follows the
    declarations too, sees their leases end and publishes the loss, so the other two re-form at
    once; the workers' collective timeout (10 minutes here) is never what frees them."""
    from support.jobs import TRAIN, Job, after, steps_at

    job = Job(nodes, default_etcd, run_id, tmp_path, nnodes="1:4", extra=["--node-ttl", "3"],
              train=[*TRAIN, "--pg-timeout", "600"])
    started = job.start("a", "b", "c", "d")
    ranks = {r["rank"]: r["node"] for r in sorted(steps_at(job.records(), 4), key=lambda r: r["time"])}
    frozen = {ranks[0], ranks[1]}
    frozen_at = max(r["time"] for r in job.records())
    for name in frozen:
        started[name].signal_tree(signal.SIGSTOP)
    try:
        rest = {"a", "b", "c", "d"} - frozen
        job.wait_world(2, rest, since=frozen_at, timeout=150)
    finally:
        for name in frozen:
            started[name].signal_tree(signal.SIGCONT)
    assert not [r for r in after(job.records(), frozen_at) if r.get("node") in frozen and r.get("world_size") == 2]


def complete_checkpoint_steps(directory) -> set[int]:
    """The steps of the complete checkpoints in ``directory`` (a digest file marks one complete)."""
    return {int(path.name[len("step-"):-len(".pt.sha256")]) for path in directory.glob("step-*.pt.sha256")}


def test_workers_told_to_stop_on_either_side_of_a_boundary_keep_the_last_step_trained(hot_job, tmp_path):
    """A `down` reaches the workers at different moments: a and b stop at one boundary, c is told
    only once they have left, below MIN (2), where no generation forms. The step they all trained
    last is in a complete checkpoint all the same (saved by every worker before a and b left), and
    nothing was trained after it."""
    checkpoints = tmp_path / "checkpoints"
    job = hot_job(HotSettings(min_nodes=2, max_nodes=3, node_ttl=3, last_call=1.0, reform_last_call=0.5))
    job.env["ELASTICCTL_CHECKPOINT_DIR"] = str(checkpoints)
    workers = {name: job.start(name) for name in ("a", "b", "c")}
    job.wait_world({"a", "b", "c"})

    for name in ("a", "b"):
        workers[name].process.send_signal(signal.SIGTERM)
    for name in ("a", "b"):
        assert workers[name].wait(60) == 0, workers[name].log()
    workers["c"].process.send_signal(signal.SIGTERM)
    assert workers["c"].wait(60) == 0, workers["c"].log()

    last_trained = max(r["step"] for r in job.steps()) + 1  # a record line comes before its step's commit
    assert max(complete_checkpoint_steps(checkpoints), default=-1) == last_trained, \
        (sorted(complete_checkpoint_steps(checkpoints)), last_trained)


def test_restart_mode_each_of_repeated_failures_is_back_at_full_world_and_loses_no_sample(
        nodes, default_etcd, run_id, tmp_path):
    """The same churn in restart mode, with real `up`/`join` nodes: a member's whole tree SIGKILLed
    (never the first node), then a node started in its place; again, the victim now that
    replacement. Every failure ends with the survivors training at world 2 and, once the
    replacement joined, at world 3; every restart resumes from the newest checkpoint, so across
    all of them no sample of an epoch is lost (steps re-done since that checkpoint are trained
    again, in a later restart's lineage)."""
    from support.jobs import MLP, Job

    from bench.goodput import DATASET_SIZE, sample_check

    job = Job(nodes, default_etcd, run_id, tmp_path, nnodes="1:3",
              extra=["--node-ttl", "3", "--checkpoint-dir", str(tmp_path / "checkpoints")],
              train=[MLP, "--steps", "100000", "--step-sleep", "0.05", "--log-every", "0", "--checkpoint-every", "10",
                     "--record-params"])
    started = job.start("a", "b", "c")
    training = ["a", "b", "c"]
    for failure in range(RESTART_FAILURES):
        victim = training[1 + failure % 2]
        killed_at = max(r["time"] for r in job.records())
        started[victim].kill()
        survivors = [n for n in training if n != victim]
        job.wait_world(2, set(survivors), since=killed_at)
        replacement = f"{victim[0]}{failure + 1}"
        back_at = max(r["time"] for r in job.records())
        started[replacement] = job.join(replacement)
        training = [*survivors, replacement]
        job.wait_world(3, set(training), since=back_at)
    # A restart-mode line's generation is its node's own restart count, which a replacement's
    # does not follow: the step's newest line is its last execution (bench/goodput.py's reading).
    lost = sample_check([r for r in job.records() if "event" not in r], dataset_size=DATASET_SIZE)
    assert lost is None, lost
    assert all(started[name].process.poll() is None for name in training), "a node of the last world stopped"
