"""The boundary collectives' own group in real worker processes: where the training group is not
gloo, every generation builds a gloo side group for the step boundary's flags and the straggler
exchange (CPU tensors: no step waits for a GPU on elasticctl's behalf), in hot and restart mode.

On this machine's CPUs the workers train on torch's gloo registered under another backend name
(``hot.py --backend-named``, through torch's public ``Backend.register_backend``): the runtime
sees a training backend that is not gloo, as it sees NCCL, and takes the very path it takes on
GPUs (the decision, ``process_group.control_channel``, is the same for both: its table is in
tests/unit/test_control_channel.py). Nothing in elasticctl knows of the test. The runtime's
log line of each generation names the group its boundary collectives go to, from that group's
own backend (``dist.get_backend``); joins, leaves and a straggler's naming, which need those
collectives, show that they travel there. With two GPUs the same job runs on NCCL.
"""

from __future__ import annotations

import signal
import sys

import pytest
import torch
from support.helpers import WORKERS, read_records, wait_for
from test_hot import HotJob, check_replicas_and_samples

from elasticctl.job.records import EventKind
from elasticctl.job import environment
from elasticctl.job.options import RecoveryMode
from elasticctl.job.settings import HotSettings, StragglerSettings, WorkerSettings

RENAMED = "renamed_gloo"
STRAGGLERS = StragglerSettings(ratio=1.5, window=10, interval=5)


def side_group_line(training_backend: str) -> str:
    return f"boundary collectives on a side group (gloo) beside the training group ({training_backend})"


def events_of(job: HotJob, kind: EventKind, node: str) -> list:
    from elasticctl.etcd.client import EtcdClient
    from elasticctl.job.events import EventLog
    from elasticctl.job.keys import JobKeys

    with EtcdClient(job.etcd.client_settings()) as client:
        return [e for e in EventLog(client, JobKeys(job.env["ELASTICCTL_JOB"])).read()
                if e.kind is kind and e.node == node]


def straggler_job(nodes, default_etcd, run_id, tmp_path, settings: HotSettings, *args: str) -> HotJob:
    return HotJob(nodes, default_etcd, run_id, tmp_path, settings, ["--log-transfers", *args], stragglers=STRAGGLERS)


def test_hot_mode_on_a_backend_that_is_not_gloo_runs_its_boundaries_on_a_gloo_side_group(
        nodes, default_etcd, run_id, tmp_path):
    job = straggler_job(nodes, default_etcd, run_id, tmp_path,
                        HotSettings(min_nodes=2, max_nodes=3, node_ttl=5, last_call=1.0, reform_last_call=0.5),
                        "--backend-named", RENAMED)
    workers = {name: job.start(name) for name in ("a", "b")}
    workers["c"] = job.start("c", extra=["--step-sleep", "0.25"])  # the straggler
    first = job.wait_world({"a", "b", "c"})
    # the straggler exchange (every 5 steps, on the side group) names c
    wait_for(lambda: events_of(job, EventKind.STRAGGLER, "c"), 120, "c named a straggler")
    assert not events_of(job, EventKind.STRAGGLER, "a") and not events_of(job, EventKind.STRAGGLER, "b")
    # c told to stop: the leaving flag, summed on the side group, lets it go at a boundary
    left_at = job.last_time()
    workers["c"].process.terminate()
    assert workers["c"].wait(60) == 0, workers["c"].log()
    job.wait_world({"a", "b"}, since=left_at)
    # a newcomer: the pending flag admits it at a boundary
    joined_at = job.last_time()
    job.start("d")
    joined = job.wait_world({"a", "b", "d"}, since=joined_at)
    pids = {r["node"]: r["pid"] for r in first}
    assert {r["node"]: r["pid"] for r in joined if r["node"] != "d"} == {n: pids[n] for n in ("a", "b")}
    check_replicas_and_samples(job.steps())
    for name in ("a", "b"):  # a side group in each of the three generations, at least
        log = workers[name].log()
        assert log.count(side_group_line(RENAMED)) >= 3, log
        assert "boundary collectives on the training group" not in log, log


def test_restart_mode_under_torchrun_builds_its_side_group_too(nodes, tmp_path):
    record = tmp_path / "record.jsonl"
    torchrun = nodes("local", [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        str(WORKERS / "hot.py"), "--record", str(record), "--steps", "30", "--step-sleep", "0.01",
        "--log-transfers", "--backend-named", RENAMED,
    ], env={environment.WORKER_SETTINGS: WorkerSettings(RecoveryMode.RESTART, STRAGGLERS).to_json()})
    # every step's flags (blocking in restart mode) and every 5th step's straggler exchange
    # went over the side group: 30 steps and a clean end on both ranks
    assert torchrun.wait(180) == 0, torchrun.log()
    log = torchrun.log()
    assert log.count(side_group_line(RENAMED)) == 2, log
    steps = [r for r in read_records(record) if "event" not in r]
    assert {(r["rank"], r["world_size"]) for r in steps} == {(0, 2), (1, 2)}
    assert max(r["step"] for r in steps) == 29
    check_replicas_and_samples(steps)


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason=f"NCCL needs a GPU per worker, 2; this machine has {torch.cuda.device_count()}")
def test_on_gpus_hot_mode_runs_its_boundaries_on_a_gloo_side_group_beside_nccl(
        nodes, default_etcd, run_id, tmp_path):
    job = straggler_job(nodes, default_etcd, run_id, tmp_path, HotSettings(min_nodes=1, max_nodes=2, node_ttl=5))
    workers = {name: job.start(name, local_rank=i) for i, name in enumerate(("a", "b"))}
    first = job.wait_world({"a", "b"})
    left_at = job.last_time()
    workers["b"].process.terminate()  # let go at a boundary the side group agreed on
    assert workers["b"].wait(60) == 0, workers["b"].log()
    job.wait_world({"a"}, since=left_at)
    joined_at = job.last_time()
    workers["c"] = job.start("c", local_rank=1)  # b's GPU, now free
    joined = job.wait_world({"a", "c"}, since=joined_at)
    assert {r["pid"] for r in joined if r["node"] == "a"} == {r["pid"] for r in first if r["node"] == "a"}
    check_replicas_and_samples(job.steps())
    assert workers["a"].log().count(side_group_line("nccl")) >= 2, workers["a"].log()
    assert side_group_line("nccl") in workers["c"].log(), workers["c"].log()


# -- freeze detection: a lost member aborts the pending collective where the backend can -----------

ABORTING = "lost while it may wait in a collective: aborting its training group"
NO_ABORT = "has no abort: a collective pending on a frozen member ends by its timeout"


@pytest.mark.parametrize("backend", ["gloo", RENAMED])
def test_a_frozen_members_lost_lease_reaches_the_abort_path_of_the_survivors(
        nodes, default_etcd, run_id, tmp_path, backend):
    """c freezes in a collective; the survivors' collective timeout (60 s) is far longer than the
    node TTL (2 s), so what they log comes from the lease: on the renamed gloo the runtime takes
    the NCCL branch and aborts the group (on gloo that abort is a no-op: c's thaw lets the
    collective finish); on gloo itself it says once that the collective waits for its timeout."""
    job = HotJob(nodes, default_etcd, run_id, tmp_path,
                 HotSettings(min_nodes=2, max_nodes=3, node_ttl=2, last_call=1.0, reform_last_call=0.5),
                 ["--pg-timeout", "60", *(["--backend-named", backend] if backend != "gloo" else [])])
    workers = {name: job.start(name) for name in ("a", "b", "c")}
    job.wait_world({"a", "b", "c"})
    workers["c"].signal_tree(signal.SIGSTOP)
    expected = ABORTING if backend == RENAMED else NO_ABORT
    try:
        wait_for(lambda: all(expected in workers[n].log() for n in ("a", "b")) or None, 60,
                 f"a and b saying: ...{expected}...")
    finally:
        workers["c"].signal_tree(signal.SIGCONT)
    thawed_at = job.last_time()
    job.wait_world({"a", "b", "c"}, since=thawed_at)
    for name in ("a", "b"):
        log = workers[name].log()
        assert log.count(expected) == 1, log  # once per generation (gloo: once per worker)
        assert "c.0 of generation" in log and (ABORTING if backend == "gloo" else NO_ABORT) not in log, log
    check_replicas_and_samples(job.steps())


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason=f"NCCL needs a GPU per worker, 2; this machine has {torch.cuda.device_count()}")
def test_on_gpus_a_frozen_members_lost_lease_aborts_the_survivors_nccl_collective(
        nodes, default_etcd, run_id, tmp_path):
    """With NCCL the abort works: a frozen b costs a the node TTL (3 s) and a re-formation, not
    the collective timeout (120 s)."""
    job = HotJob(nodes, default_etcd, run_id, tmp_path, HotSettings(min_nodes=1, max_nodes=2, node_ttl=3),
                 ["--pg-timeout", "120"])
    workers = {name: job.start(name, local_rank=i) for i, name in enumerate(("a", "b"))}
    job.wait_world({"a", "b"})
    frozen_at = job.last_time()
    workers["b"].signal_tree(signal.SIGSTOP)
    try:
        alone = job.wait_world({"a"}, since=frozen_at, timeout=60)
        assert min(r["time"] for r in alone) - frozen_at < 30, "a waited for the collective timeout"
        assert ABORTING in workers["a"].log(), workers["a"].log()
    finally:
        workers["b"].kill()
