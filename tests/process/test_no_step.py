"""A script that never reaches a step boundary: the worker says so, in its log
and as a ``no_step`` event; a function that returns at step 0 is warned about; a SIGTERM that no
boundary answers ends the worker within the runtime's bound, in one line.

Layer tests/process: real processes (elasticctl, torchrun, workers, tools). The other tests of this
subject: tests/unit/test_no_step_warning.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from support.helpers import WORKERS, wait_for

from elasticctl.etcd.client import EtcdClient
from elasticctl.job.events import EventLog
from elasticctl.job.keys import JobKeys
from elasticctl.job.records import EventKind
from elasticctl.train.runtime import EXIT_STOPPED_WITHOUT_BOUNDARY, STOP_BOUND


NO_COMMIT = str(WORKERS / "no_commit.py")


def _start(tmp_path: Path, env: dict) -> tuple[subprocess.Popen, Path, Path]:
    stop_file, log_path = tmp_path / "stop", tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        worker = subprocess.Popen([sys.executable, NO_COMMIT, str(stop_file), "1"], stdout=log,
                                  stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
    return worker, stop_file, log_path


def test_a_script_that_never_commits_is_warned_about(default_etcd, run_id, tmp_path):
    worker, stop_file, log_path = _start(tmp_path, {"ELASTICCTL_ETCD": default_etcd.endpoint,
                                                    "ELASTICCTL_JOB": run_id, "ELASTICCTL_NODE": "n0"})
    try:
        wait_for(lambda: "no step boundary for" in log_path.read_text(), 60,
                 "the worker's warning")  # old code: nothing, ever
        stop_file.touch()  # the function returns, at step 0
        assert worker.wait(60) == 0, log_path.read_text()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    log = log_path.read_text()
    assert "does the training function call state.commit()" in log, log
    assert "its training function returned at step 0: nothing was trained" in log, log
    assert "Traceback" not in log, log
    with EtcdClient(default_etcd.client_settings()) as client:
        reasons = wait_for(lambda: [e.reason for e in EventLog(client, JobKeys(run_id)).read()
                                    if e.kind is EventKind.NO_STEP], 10, "two no_step events", )
        assert any("no step boundary for" in r for r in reasons), reasons
        wait_for(lambda: any("returned at step 0" in e.reason for e in EventLog(client, JobKeys(run_id)).read()
                             if e.kind is EventKind.NO_STEP), 10, "the step-0 event")


def test_a_sigterm_no_boundary_answers_ends_the_worker_within_the_bound(tmp_path):
    worker, _, log_path = _start(tmp_path, {})
    try:
        wait_for(lambda: "training function entered" in log_path.read_text(), 60, "the training function")
        sent = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(STOP_BOUND + 20)  # old code: still running (torch's agent SIGKILLs at 30 s)
        assert time.monotonic() - sent < STOP_BOUND + 20
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    log = log_path.read_text()
    assert code == EXIT_STOPPED_WITHOUT_BOUNDARY, log
    assert "Traceback" not in log, log
    assert "told to stop, it reached no step boundary (state.commit) within" in log, log


def test_down_of_a_job_whose_script_never_commits_is_bounded_and_quiet(default_etcd, run_id, nodes, tmp_path):
    from test_orchestrator import ELASTICCTL, cli

    node = nodes("a", [*ELASTICCTL, "up", "--node-id", "a", "--etcd", default_etcd.endpoint, "--job", run_id,
                       "--nnodes", "1", NO_COMMIT, str(tmp_path / "never"), "1"])
    wait_for(lambda: "no step boundary for" in node.log(), 120, "the worker's warning")
    result = cli("down", "--etcd", default_etcd.endpoint, "--job", run_id, timeout=60)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    node.wait(STOP_BOUND + 20)  # old code: 31 s (torch's agent SIGKILLed the worker at 30 s)
    log = node.log()
    assert "Traceback" not in log, log
    assert "told to stop, it reached no step boundary" in log, log
