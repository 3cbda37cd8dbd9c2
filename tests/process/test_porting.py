"""The porting examples (trainers/porting/) under real `elasticctl up`/`join` on a real etcd: a
launch-style script unchanged, plain DDP resuming from its newest checkpoint after a kill, an
mp.spawn script stopped with its fix (and its conversion running), DataParallel named, and a
BatchNorm model on elasticctl.train through a kill and a join in hot mode. Every wait is on the
scripts' printed lines or records, never a sleep. The decisions behind the checks are
table-tested in tests/unit/test_porting.py."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
from support.helpers import ELASTICCTL, REPO, cli, wait_for
from support.jobs import Job

from bench.accounting import check_replicas
from elasticctl.etcd.client import EtcdClient
from elasticctl.job.events import EventLog
from elasticctl.job.keys import JobKeys
from elasticctl.job.records import EventKind
from elasticctl.job.registry import Registry
from elasticctl.train import porting

pytestmark = pytest.mark.slow

PORTING = REPO / "trainers" / "porting"
LAUNCH = str(PORTING / "launch_local_rank.py")
DDP_RESUMABLE = str(PORTING / "ddp_resumable.py")
MP_SPAWN = str(PORTING / "mp_spawn.py")
MP_SPAWN_CONVERTED = str(PORTING / "mp_spawn_converted.py")
DATA_PARALLEL = str(PORTING / "data_parallel.py")
SYNC_BATCHNORM = str(PORTING / "sync_batchnorm.py")


def up(etcd, job: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """`elasticctl up` to its end; one that does not end fails the test instead of hanging it."""
    try:
        return cli("up", "--etcd", etcd.endpoint, "--job", job, "--node-id", "a", *args, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"elasticctl up {' '.join(args)!r} was still running after {timeout:g} s")


@pytest.mark.parametrize("legacy", [True, False], ids=["legacy-local-rank", "use-env"])
def test_a_launch_style_script_runs_unchanged(default_etcd, run_id, legacy):
    flags = ["--legacy-local-rank"] if legacy else []
    result = up(default_etcd, run_id, "--nnodes", "1", "--nproc-per-node", "2", *flags, LAUNCH, "--epochs", "1")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    source = "--local_rank" if legacy else "LOCAL_RANK"
    for rank in (0, 1):
        assert f"rank {rank} of 2: local rank {rank} from {source}" in output, output
    assert "epoch 0 loss" in output, output


def test_an_mp_spawn_script_ends_at_once_with_its_fix_in_one_sentence(default_etcd, run_id):
    started = time.monotonic()
    result = up(default_etcd, run_id, "--nnodes", "1", MP_SPAWN, timeout=120)
    seconds = time.monotonic() - started
    try:
        assert result.returncode != 0, result.stderr
        assert "Traceback" not in result.stderr, result.stderr
        last = result.stderr.strip().splitlines()[-1]
        reason = porting.spawn_refusal("spawn", {"RANK": "0", "WORLD_SIZE": "1"})
        assert last.startswith("elasticctl: node a stopped: ") and reason in last, result.stderr
        assert "quarantine" not in result.stderr and seconds < 120, (seconds, result.stderr)
    finally:
        with EtcdClient(default_etcd.client_settings()) as client:
            Registry(client, run_id).delete_job()


def test_the_mp_spawn_script_runs_as_written_without_a_launcher():
    from elasticctl.embedded_etcd import free_port

    result = subprocess.run([sys.executable, MP_SPAWN, "--port", str(free_port()), "--steps", "3"], check=False,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "trained 3 steps at world size 2" in result.stdout


def test_the_converted_mp_spawn_script_runs_one_process_per_worker(default_etcd, run_id):
    result = up(default_etcd, run_id, "--nnodes", "1", "--nproc-per-node", "2", MP_SPAWN_CONVERTED, "--steps", "5")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    for rank in (0, 1):
        assert f"rank {rank} (local rank {rank}): trained 5 steps at world size 2" in output, output
    assert "torch.multiprocessing" not in output, output


def test_data_parallel_is_named_with_the_line_that_replaces_it(default_etcd, run_id):
    result = up(default_etcd, run_id, "--nnodes", "1", DATA_PARALLEL, "--steps", "3")
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("elasticctl: warning: nn.DataParallel")]
    assert len(warnings) == 1, result.stderr
    assert "DistributedDataParallel(model, device_ids=[local_rank])" in warnings[0], warnings
    assert "trained 3 steps" in result.stdout + result.stderr
    with EtcdClient(default_etcd.client_settings()) as client:
        events = [e for e in EventLog(client, JobKeys(run_id)).read() if e.kind is EventKind.SCRIPT_WARNING]
    assert [(e.node, e.reason) for e in events] == [("a", warnings[0].removeprefix("elasticctl: warning: "))]


# -- plain DDP made resumable: restart mode, a kill, a join -----------------------------------------

RESUMED = re.compile(r"resumed from step (\d+) \(epoch \d+\) at world size (\d+)")
SAVED = re.compile(r"saved a (?:final )?checkpoint at step (\d+)")


def resumes(text: str, world: int) -> list[int]:
    return [int(m[1]) for m in RESUMED.finditer(text) if int(m[2]) == world]


def test_plain_ddp_resumes_from_the_newest_checkpoint_after_a_kill_and_a_join(nodes, default_etcd, run_id, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    script = [DDP_RESUMABLE, "--epochs", "100000", "--dataset-size", "256", "--checkpoint-every", "10",
              "--log-every", "5", "--step-sleep", "0.05"]

    def join(name: str):
        return nodes(name, [*ELASTICCTL, "join", "--etcd", default_etcd.endpoint, "--job", run_id, "--node-id", name])

    a = nodes("a", [*ELASTICCTL, "up", "--etcd", default_etcd.endpoint, "--job", run_id, "--node-id", "a",
                    "--nnodes", "1:2", "--checkpoint-dir", str(checkpoints), *script])
    wait_for(lambda: "starting at step 0 at world size 1" in a.log(), 180, "a training alone")
    b = join("b")

    def checkpointed_at_world_2():  # rank 0 (a's worker or b's) resumed at world 2, then saved a checkpoint
        for text in (a.log(), b.log()):
            resumed = resumes(text, 2)
            after = text.split("at world size 2", 1)[-1]
            if resumed and any(int(step) > resumed[0] for step in SAVED.findall(after)):
                return (resumed[0],)
        return None

    (first_resume,) = wait_for(checkpointed_at_world_2, 180, "a checkpoint written at world size 2")
    assert first_resume > 0, "b's join restarted the training from step 0"

    a_at_kill = len(a.log())
    b.kill()  # SIGKILL: b's node and its worker die at once; a's worker fails in its next all-reduce
    b_log = b.log()

    def resumed_alone():
        text = a.log()
        match = next((m for m in RESUMED.finditer(text, a_at_kill) if m[2] == "1"), None)
        return (int(match[1]), text[:match.start()]) if match else None

    step, before = wait_for(resumed_alone, 180, "a resuming alone after the kill")
    saved_before = [int(s) for s in SAVED.findall(b_log) + SAVED.findall(before)]
    # The newest checkpoint any rank 0 said it wrote before the kill (a later one, written just
    # before the kill and not yet printed, may be newer still), never step 0.
    assert saved_before and step >= max(saved_before) > 0, (step, saved_before)
    trained = re.compile(r"step (\d+) epoch \d+ loss \S+ world 1")
    wait_for(lambda: any(int(m[1]) > step for m in trained.finditer(a.log(), a_at_kill)), 120,
             "a training on alone past the checkpoint it resumed from")

    a_at_join = len(a.log())
    c = join("c")  # a's worker gets SIGTERM: it writes a final checkpoint, then a and c resume from it
    final = int(wait_for(lambda: re.compile(r"saved a final checkpoint at step (\d+)").search(a.log(), a_at_join),
                         180, "a's final checkpoint when c joins")[1])
    assert final > step
    wait_for(lambda: final in resumes(a.log()[a_at_join:] + c.log(), 2), 180,
             f"a and c resuming from step {final} at world size 2")
    assert a.process.poll() is None and c.process.poll() is None


# -- SyncBatchNorm (BatchNorm without a GPU) in hot mode: a kill and a join ---------------------------

def test_a_batchnorm_model_trains_through_a_kill_and_a_join_in_hot_mode(nodes, default_etcd, run_id, tmp_path):
    job = Job(nodes, default_etcd, run_id, tmp_path, nnodes="1:3", extra=["--recovery", "hot", "--node-ttl", "3"],
              train=[SYNC_BATCHNORM, "--steps", "100000", "--batch-size", "8", "--step-sleep", "0.05"])
    started = job.start("a", "b", "c")
    steps = [r for r in job.records() if "event" not in r]
    pids = {r["node"]: r["pid"] for r in steps}

    killed_at = max(r["time"] for r in steps)
    started["c"].kill()
    shrunk = job.wait_world(2, {"a", "b"}, since=killed_at)
    assert {r["node"]: r["pid"] for r in shrunk} == {n: pids[n] for n in ("a", "b")}, "a survivor restarted"

    joined_at = max(r["time"] for r in job.records())
    job.join("d")
    grown = job.wait_world(3, {"a", "b", "d"}, since=joined_at)
    assert {r["node"]: r["pid"] for r in grown if r["node"] != "d"} == {n: pids[n] for n in ("a", "b")}
    assert min(r["step"] for r in grown if r["node"] == "d") > 0, "the joiner did not get the state"
    check_replicas([r for r in job.records() if "event" not in r])
