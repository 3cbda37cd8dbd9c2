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


@pytest.mark.parametrize("spare", [True, False], ids=["one-spare", "no-spare"])
def test_each_of_repeated_failures_costs_one_re_formation(hot_job, spare):
    job = hot_job(HotSettings(min_nodes=1, max_nodes=3, node_ttl=3, last_call=1.0, reform_last_call=0.5))
    for name in ("a", "b", "c"):
        job.start(name)
    job.wait_world({"a", "b", "c"})
    training, waiting = ["a", "b", "c"], None
    if spare:
        waiting = "d"
        job.start(waiting)
        wait_for(lambda: declared_pid(job, "d.0"), 120, "the spare d waiting in the rendezvous")

    for failure in range(FAILURES):
        victim = training[1 + failure % 2]  # never the first node
        before = max(r["generation"] for r in job.steps())
        killed_at = job.last_time()
        job.workers[victim].kill()
        survivors = [n for n in training if n != victim]
        if waiting is not None:
            training = survivors + [waiting]
            job.wait_world(set(training), since=killed_at)
            seen = generations_after(job, killed_at)
            # Every survivor and the spare in the generation right after the kill: nobody left out,
            # no second re-formation (a step or two of the old generation may be recorded before
            # the survivors notice).
            assert set(seen) <= {before, before + 1}, f"failure {failure}: generations {seen}"
            assert seen[before + 1] == set(training), f"failure {failure}: generations {seen}"
            assert not [r for r in job.steps() if r["time"] > killed_at and r["world_size"] != 3], \
                f"failure {failure}: the world stayed short"
            waiting = victim
            job.start(victim)  # the killed node comes back: the next spare
            pid = job.workers[victim].process.pid
            wait_for(lambda: declared_pid(job, f"{victim}.0") == pid or None, 120,
                     f"{victim} waiting in the rendezvous again")
        else:
            job.wait_world(set(survivors), since=killed_at)
            assert set(generations_after(job, killed_at)) <= {before, before + 1}, f"failure {failure}"
            back_at = job.last_time()
            job.start(victim)
            job.wait_world(set(training), since=back_at)
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
    back = wait_for(lambda: [r for r in job.steps() if r["time"] > killed_at and r["world_size"] == 4] or None,
                    120, "a, b and both of d's workers training at world 4")
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
