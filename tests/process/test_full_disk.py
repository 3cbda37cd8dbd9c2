"""Checkpoints on a full disk, on a small tmpfs each test mounts.

A failed periodic checkpoint costs training nothing: no crash, no restart, no re-formation.
It is logged, recorded (``checkpoint_failed``), published in the progress record (status,
doctor, the dashboard's /metrics), and checkpoints resume once space returns. Only a final
checkpoint that fails after its retries ends the run non-zero, naming the disk.

The disk fills after a known event: the test writes a filler file once the job's first
checkpoint is on disk, leaving less room than one checkpoint needs (its size is measured).

Layer tests/process: real processes (elasticctl, torchrun, workers, tools). The other tests of this
subject: tests/unit/test_full_disk_reason.py.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.helpers import MLP, read_records, torchrun_command, wait_for
from prometheus_client.parser import text_string_to_metric_families
from werkzeug.test import Client

from elasticctl import status
from elasticctl.doctor import checks
from elasticctl.train.checkpoint import Checkpointer, CheckpointError, CheckpointWriteError
from elasticctl.dashboard.server import Dashboard
from elasticctl.etcd.client import EtcdClient
from elasticctl.job.keys import JobKeys
from elasticctl.job.records import EventKind
from elasticctl.job.registry import Registry


HIDDEN = 16384  # mlp.py's width: a checkpoint of about 1.2 MB, large next to the tmpfs' pages
DISK_MB = 8     # room for keep=3 checkpoints and the one being written, once the filler is gone


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of DISK_MB mounted for this test only (unmounted even when the test fails)."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", str(mount_point)],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip() or result.returncode}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(disk: Path, leave: int) -> Path:
    """Write a filler file that leaves about ``leave`` bytes free on ``disk``."""
    filler = disk / "filler"
    filler.touch()
    top_up(filler, leave)
    return filler


def top_up(filler: Path, leave: int) -> None:
    """Grow ``filler`` until about ``leave`` bytes are free on its disk again, if more are; a write
    racing ours may take the last pages first (then the disk is full anyway)."""
    extra = free_bytes(filler.parent) - leave
    if extra <= 0:
        return
    try:
        with open(filler, "ab") as f:
            f.write(b"\0" * extra)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise


def checkpoint_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(("step-", ".tmp-")))


@pytest.mark.parametrize("async_save", [False, True], ids=["blocking", "async"])
def test_a_full_disk_is_a_checkpoint_error_naming_the_disk_and_leaves_nothing_half_written(
        small_disk, async_save):
    model = torch.nn.Linear(HIDDEN, 16)  # about 1 MB of parameters
    ckpt = Checkpointer(small_disk, keep=10, async_save=async_save)
    ckpt.save(1, model=model)
    ckpt.wait()
    fill(small_disk, leave=(1 << 20) // 2)
    with pytest.raises(CheckpointWriteError) as raised:  # old: RuntimeError("... unexpected pos ...")
        ckpt.save(2, model=model)
        ckpt.wait()  # async: the writer thread's failure
    assert isinstance(raised.value, CheckpointError)
    assert str(raised.value) == (f"Writing the checkpoint of step 2 to '{small_disk}' failed: "
                                 "the disk is full (No space left on device).")
    assert ckpt.failure is not None and ckpt.failures_in_a_row == 1
    assert checkpoint_files(small_disk) == ["step-00000001.pt", "step-00000001.pt.sha256"]
    (small_disk / "filler").unlink()  # space is back: the next save commits
    ckpt.save(3, model=model)
    ckpt.wait()
    assert ckpt.failure is None and ckpt.last_step == 3
    assert [step for step, _ in ckpt.checkpoints()] == [3, 1]


def test_a_digest_that_cannot_be_written_takes_its_data_file_with_it(small_disk):
    ckpt = Checkpointer(small_disk, keep=10)
    model = torch.nn.Linear(256, 16)
    ckpt.save(1, model=model)
    pages = -(-(small_disk / "step-00000001.pt").stat().st_size // 4096)
    fill(small_disk, leave=pages * 4096)  # room for the next data file, not for its digest
    assert free_bytes(small_disk) == pages * 4096
    with pytest.raises(CheckpointWriteError, match="the disk is full"):
        ckpt.save(2, model=model)
    # Old code: step-00000002.pt stayed, without its digest, holding the space.
    assert checkpoint_files(small_disk) == ["step-00000001.pt", "step-00000001.pt.sha256"]


# -- whole runs ------------------------------------------------------------------------------------

def _env(default_etcd, run_id: str, **extra: str) -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "ELASTICCTL_ETCD": default_etcd.endpoint,
            "ELASTICCTL_JOB": run_id, "ELASTICCTL_NODE": "n0", **extra}


def _mlp_args(record: Path, disk: Path, *more: str) -> list[str]:
    return ["--steps", "1000000", "--hidden", str(HIDDEN), "--checkpoint-every", "5", "--keep", "3",
            "--log-every", "0", "--record", str(record), "--checkpoint-dir", str(disk), *more]


def _metrics(default_etcd, run_id: str) -> dict:
    with EtcdClient(default_etcd.client_settings()) as client:
        response = Client(Dashboard(client, JobKeys(run_id))).get("/metrics")
        families = text_string_to_metric_families(response.get_data(as_text=True))
        return {s.labels.get("error", ""): s.value for f in families for s in f.samples
                if s.name == "elasticctl_checkpoint_failures"}


def _fill_disk_and_free_it_again(default_etcd, run_id: str, disk: Path, record: Path, log_of) -> None:
    """The shared middle of the runs: fill the disk after the first checkpoint, see every report
    of the failure, free the space, see checkpoints resume."""
    try:
        _fill_and_free(default_etcd, run_id, disk, record)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nthe job's log:\n{log_of()[-6000:]}") from exc


def _fill_and_free(default_etcd, run_id: str, disk: Path, record: Path) -> None:
    wait_for(lambda: any(r.get("event") == "checkpoint" for r in read_records(record)), 120,
             "the first checkpoint")
    wait_for(lambda: not any(p.name.startswith(".tmp-") for p in disk.iterdir()), 30, "the first write's end")
    one = max(p.stat().st_size for p in disk.glob("step-*.pt"))
    filler = fill(disk, leave=one // 2)

    def failed_checkpoints() -> list[dict]:
        # The trainer rotates: a commit just after the filler was sized deletes the oldest checkpoint
        # and gives back a whole checkpoint's room for good (seen in CI: no save ever failed). Keep
        # the disk full until one does.
        top_up(filler, leave=one // 2)
        return [r for r in read_records(record) if r.get("event") == "checkpoint_failed"]

    failed = wait_for(failed_checkpoints, 120, "a failed checkpoint")[0]
    assert "the disk is full" in failed["reason"] and str(disk) in failed["reason"], failed
    with EtcdClient(default_etcd.client_settings()) as client:
        registry = Registry(client, run_id)
        progress = wait_for(lambda: (registry.progress() or {}).get("checkpoint_error") and registry.progress(),
                            60, "the failure in the progress record")
        assert "the disk is full" in progress["checkpoint_error"] and str(disk) in progress["checkpoint_error"]
        assert progress["checkpoint_failures"] >= 1
        assert "CHECKPOINTS FAILING" in status.render(registry.view())
        check = checks.decide_checkpoint_health(registry.progress())
        assert check.status is checks.Status.WARN and "the disk is full" in check.detail, check
        events = wait_for(lambda: [e for e in _events(client, run_id) if e.kind is EventKind.CHECKPOINT_FAILED],
                          30, "a checkpoint_failed event")
        assert "the disk is full" in events[0].reason and str(disk) in events[0].reason, events
    metrics = _metrics(default_etcd, run_id)
    # the label is the error's kind, never its sentence (a path in it would make a series of each)
    assert metrics.get("disk_full", 0) >= 1 and set(metrics) <= {"", "disk_full"}, metrics
    # Training went on: more steps after the failure, in the same process.
    at_failure = failed["step"]
    wait_for(lambda: max((r["step"] for r in read_records(record) if "loss" in r), default=0) > at_failure + 10,
             120, "steps after the failed checkpoint")
    filler.unlink()
    wait_for(lambda: any(r.get("event") == "checkpoint" and r["step"] > at_failure for r in read_records(record)),
             120, "a checkpoint after the space came back")
    with EtcdClient(default_etcd.client_settings()) as client:
        wait_for(lambda: not (Registry(client, run_id).progress() or {}).get("checkpoint_error"), 60,
                 "the failure cleared from the progress record")
    wait_for(lambda: all(v == 0 for v in _metrics(default_etcd, run_id).values()), 30, "the metric back to 0")


def _events(client, run_id):
    from elasticctl.job.events import EventLog

    return EventLog(client, JobKeys(run_id)).read()


def _assert_trained_once_without_restart(record: Path) -> None:
    steps = [r for r in read_records(record) if "loss" in r]
    assert len({r["pid"] for r in steps}) == 1 and {r["restart"] for r in steps} == {0}
    numbers = [r["step"] for r in steps]
    assert numbers == list(range(len(numbers))), "a step was re-done or skipped"


def _assert_complete_checkpoints_only(disk: Path) -> None:
    names = checkpoint_files(disk)
    assert not [n for n in names if n.startswith(".tmp-")], names
    data = [n for n in names if n.endswith(".pt")]
    assert data and all(f"{n}.sha256" in names for n in data), names
    ckpt = Checkpointer(disk)
    for _, path in ckpt.checkpoints():
        ckpt.read(path)


def test_restart_mode_trains_through_a_full_disk_and_checkpoints_resume(default_etcd, run_id, small_disk, tmp_path):
    record = tmp_path / "record.jsonl"
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        worker = subprocess.Popen([sys.executable, MLP, *_mlp_args(record, small_disk)], stdout=log,
                                  stderr=subprocess.STDOUT, env=_env(default_etcd, run_id))
    try:
        _fill_disk_and_free_it_again(default_etcd, run_id, small_disk, record, log_path.read_text)
        worker.send_signal(signal.SIGTERM)  # ends at a step boundary with a final checkpoint
        assert worker.wait(60) == 0, log_path.read_text()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert "the disk is full" in log_path.read_text()
    _assert_trained_once_without_restart(record)
    _assert_complete_checkpoints_only(small_disk)


def test_hot_mode_trains_through_a_full_disk_without_re_forming(default_etcd, run_id, small_disk, tmp_path, nodes):
    record = tmp_path / "record.jsonl"
    # Async saves: the failure happens on the writer thread and is reported at the next save.
    node = nodes("n0", torchrun_command(default_etcd.endpoint, run_id, "1",
                                        _mlp_args(record, small_disk, "--async-checkpoint", "--record-params"),
                                        rdzv_conf="recovery=hot"),
                 env={"ELASTICCTL_ETCD": default_etcd.endpoint, "ELASTICCTL_JOB": run_id})
    _fill_disk_and_free_it_again(default_etcd, run_id, small_disk, record, node.log)
    assert {r["generation"] for r in read_records(record) if "generation" in r} == {1}, "a re-formation"
    assert "generation 1 ends" not in node.log()
    _assert_trained_once_without_restart(record)
    node.signal_tree(signal.SIGTERM)
    node.wait(60)
    _assert_complete_checkpoints_only(small_disk)


def test_a_final_checkpoint_that_cannot_be_written_ends_the_run_naming_the_disk(small_disk, tmp_path):
    record = tmp_path / "record.jsonl"
    fill(small_disk, leave=0)
    result = subprocess.run(
        [sys.executable, MLP, "--steps", "20", "--hidden", str(HIDDEN), "--checkpoint-every", "0",
         "--log-every", "0", "--record", str(record), "--checkpoint-dir", str(small_disk)],
        capture_output=True, text=True, timeout=120, check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("ELASTICCTL_")})
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "The final checkpoint failed 4 times" in last and "the disk is full" in last, result.stderr
    assert str(small_disk) in last, result.stderr
    assert result.stderr.count("retrying the final checkpoint") == 3, result.stderr
    assert max(r["step"] for r in read_records(record) if "loss" in r) == 19  # every step trained
    assert checkpoint_files(small_disk) == []


@pytest.mark.parametrize("recovery", ["restart", "hot"])
def test_a_final_checkpoint_no_rank_can_write_stops_every_node_without_a_restart(
        default_etcd, run_id, small_disk, tmp_path, nodes, recovery):
    """Two nodes share the full disk: rank 0 fails to write the final checkpoint, every rank learns
    why, and each node stops naming the disk instead of restarting workers that would re-train
    from the last good checkpoint and fail on the same disk (the restart budget is not spent)."""
    record = tmp_path / "record.jsonl"
    fill(small_disk, leave=0)
    args = ["--steps", "30", "--hidden", str(HIDDEN), "--checkpoint-every", "0", "--log-every", "0",
            "--record", str(record), "--checkpoint-dir", str(small_disk)]
    env = {"ELASTICCTL_ETCD": default_etcd.endpoint, "ELASTICCTL_JOB": run_id}
    conf = "recovery=hot" if recovery == "hot" else ""
    started = [nodes(name, torchrun_command(default_etcd.endpoint, run_id, "2", args, rdzv_conf=conf), env=env)
               for name in ("n0", "n1")]
    for node in started:
        assert node.wait(120) != 0, node.log()
        lines = node.log().strip().splitlines()
        stop = [line for line in lines if "stops without restarting its workers" in line]
        assert stop and "the disk is full" in stop[-1] and str(small_disk) in stop[-1], node.log()[-4000:]
        assert "Traceback" not in "\n".join(lines[lines.index(stop[-1]):]), node.log()[-4000:]
    steps = [r for r in read_records(record) if "loss" in r]
    assert {r["world_size"] for r in steps} == {2} and max(r["step"] for r in steps) == 29
    assert len({r["pid"] for r in steps}) == 2 and {r["restart"] for r in steps} == {0}, "a worker restarted"
    with EtcdClient(default_etcd.client_settings()) as client:
        members = Registry(client, run_id).members()
    assert {m["state"] for m in members.values()} == {"failed"}, members
    assert all("the disk is full" in m["reason"] for m in members.values()), members
    assert checkpoint_files(small_disk) == []
