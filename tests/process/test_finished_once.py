"""A finished worker group never trains again.

torch's agent judges a worker group all-or-nothing: one worker that exited 0 and
one that died (say by SIGABRT in a C++ destructor at interpreter exit, as gloo
teardown can) make the group FAILED, and with restarts left the agent
rendezvous again and starts every worker from scratch. The script then trains a
second time and writes its end-of-run record twice.

The scripts here make that deterministic with real processes: rank 1 returns and
exits 0 first; rank 0 waits (on a pidfd, no sleep) until rank 1 has exited, writes
its end record and then dies, on the first attempt only:

* ``teardown``: rank 0's script returns normally and the process aborts in a
  C-level exit handler, after Python has finalized: exactly where a gloo/NCCL
  destructor aborts. The job is complete; the node must say so and exit 0.
* ``failure``: rank 0 raises after rank 1 finished (a failing final save, say).
  Nothing may train again either, but the node must report the failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from support.helpers import read_records

from elasticctl.etcd.client import EtcdClient
from elasticctl.job.registry import Registry

ELASTICCTL = [sys.executable, "-m", "elasticctl.cli"]

# A torch.distributed.launch-era script: --local_rank flag, env:// gloo, 20 tiny steps.
SCRIPT = textwrap.dedent(
    """
    import argparse, ctypes, datetime, json, os, select, sys

    import torch
    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--rank0-dies", choices=("teardown", "failure"), required=True)
    args = parser.parse_args()

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


    def record(event, **fields):
        with open(args.record, "a") as out:
            out.write(json.dumps({"event": event, "rank": dist.get_rank(), "pid": os.getpid(),
                                  "attempt": attempt, **fields}) + "\\n")


    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    record("start")
    value = torch.ones(1)
    for step in range(20):
        dist.all_reduce(value)
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    dist.barrier()
    dist.destroy_process_group()
    rank = int(os.environ["RANK"])
    if rank == 0:
        # Wait until rank 1 has exited (status 0: it just returns below).
        pidfd = os.pidfd_open(pids[1])
        select.select([pidfd], [], [], 120)
        with open(args.record, "a") as out:
            out.write(json.dumps({"event": "end", "rank": 0, "pid": os.getpid(), "attempt": attempt}) + "\\n")
        if attempt == 0:
            if args.rank0_dies == "failure":
                raise RuntimeError("rank 0 failed after rank 1 had finished")
            # Abort after Python has finalized, in a C exit handler: what a C++
            # destructor (gloo, NCCL) that aborts at interpreter exit does.
            libc = ctypes.CDLL(None)
            libc.__cxa_atexit.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None)
    """
)


def run_job(etcd, run_id, tmp_path, rank0_dies: str) -> tuple[subprocess.CompletedProcess, list[dict], dict]:
    script = tmp_path / "legacy_train.py"
    script.write_text(SCRIPT)
    record = tmp_path / "record.jsonl"
    result = subprocess.run(
        [*ELASTICCTL, "up", "--etcd", etcd.endpoint, "--job", run_id, "--node-id", "a", "--nnodes", "1",
         "--nproc-per-node", "2", "--legacy-local-rank", str(script),
         "--record", str(record), "--rank0-dies", rank0_dies],
        check=False, capture_output=True, text=True, timeout=240,
    )
    with EtcdClient(etcd.client_settings()) as client:
        member = Registry(client, run_id).members().get("a", {})
    return result, read_records(record), member


def starts_per_rank(records: list[dict]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for r in records:
        if r["event"] == "start":
            counts[r["rank"]] = counts.get(r["rank"], 0) + 1
    return counts


def test_abort_at_exit_after_a_peer_exited_0_does_not_train_again(default_etcd, run_id, tmp_path):
    result, records, member = run_job(default_etcd, run_id, tmp_path, "teardown")
    log = result.stderr
    # The scenario happened as designed: rank 0 died by SIGABRT (torch logs exitcode -6).
    assert "exitcode: -6" in log, log
    ends = [r for r in records if r["event"] == "end"]
    assert len(ends) == 1, f"the finished job trained again: {json.dumps(records)}\n{log}"
    assert starts_per_rank(records) == {0: 1, 1: 1}, json.dumps(records)
    # Training completed (rank 0's script returned): a crash in teardown is not a failed job.
    assert result.returncode == 0, log
    assert "training finished" in log, log
    assert member.get("state") == "done" and member.get("restarts") == 0, member


def test_failure_after_a_peer_exited_0_is_reported_not_retrained(default_etcd, run_id, tmp_path):
    result, records, member = run_job(default_etcd, run_id, tmp_path, "failure")
    log = result.stderr
    assert "exitcode: 1" in log, log
    assert starts_per_rank(records) == {0: 1, 1: 1}, f"the group trained again: {json.dumps(records)}\n{log}"
    # A worker's script failed: the node says so instead of claiming success.
    assert result.returncode != 0, log
    assert "training finished" not in log, log
    assert member.get("state") == "failed", member


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


@pytest.mark.parametrize("stopped", [False, True])
def test_entry_marks_done_only_a_script_that_was_not_asked_to_stop(tmp_path, stopped):
    """`python -m elasticctl.train.entry` runs as `__main__`; the runtime and GracefulStop note a
    stop request in the imported `elasticctl.train.entry`. Both must be one module, or a worker
    stopped by SIGTERM (exit 0) is marked finished and its node stops instead of restarting."""
    from elasticctl.job.environment import WORKER_MARKS

    script = tmp_path / "script.py"
    script.write_text("from elasticctl.train import entry\n" + ("entry.note_stop_request()\n" if stopped else ""))
    marks = tmp_path / "marks"
    marks.mkdir()
    subprocess.run([sys.executable, "-m", "elasticctl.train.entry", str(script)], check=True, timeout=60,
                   env={**os.environ, WORKER_MARKS: str(marks), "LOCAL_RANK": "0"})
    assert sorted(p.name for p in marks.iterdir()) == (["started-0"] if stopped else ["done-0", "started-0"])
