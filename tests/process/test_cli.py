"""The elasticctl CLI as users meet it: dry runs, one-sentence errors, a real `up`, no orphans."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
from support.helpers import ELASTICCTL, MLP, read_records, wait_for

from bench.harness import wait_ended
from elasticctl.embedded_etcd import free_port

def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*ELASTICCTL, *args], check=False, capture_output=True, text=True, timeout=timeout)


def test_dry_run_prints_the_torchrun_command():
    result = run_cli("up", "--dry-run", "--etcd", "etcd-a:2379,etcd-b", "--job", "exp1", "--nnodes", "2:4",
                     "--max-restarts", "5", "--local-addr", "127.0.0.1", MLP, "--steps", "7")
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip()
    for expected in ("torch.distributed.run", "--nnodes=2:4", "--rdzv-backend=etcd3",
                     "--rdzv-endpoint=etcd-a:2379,etcd-b:2379", "--rdzv-id=exp1", "max_restarts=5",
                     f"{MLP} --steps 7"):
        assert expected in line


def test_torchruns_command_line_habits_are_kept():
    # Underscore spellings before the script are up's own options; after it they are the
    # script's; torchrun's worker-log options pass through; --nproc-per-node cpu is one per CPU.
    result = run_cli("up", "--dry-run", "--etcd", "127.0.0.1:2379", "--nnodes", "1", "--nproc_per_node", "cpu",
                     "--max_restarts=5", "--log-dir", "/tmp/worker-logs", "--tee", "3", "--local_ranks_filter", "0",
                     MLP, "--max_restarts", "9")
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip()
    for expected in (f"--nproc-per-node={os.cpu_count()}", "max_restarts=5", "--log-dir=/tmp/worker-logs", "--tee=3",
                     "--local-ranks-filter=0", f"{MLP} --max_restarts 9"):
        assert expected in line, line


def test_an_unknown_option_before_the_script_is_refused_with_a_suggestion():
    result = run_cli("up", "--nnodes", "1", "--nproc-per-nod", "2", MLP)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "elasticctl: error: No such option '--nproc-per-nod'. Did you mean '--nproc-per-node'?"], result.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--nnodes", "3:2"], "'3:2'"),
        (["--nnodes", "0:2"], "'0:2'"),
        (["--nnodes", "a:b"], "'a:b'"),
        (["--nnodes", "1", "--etcd", "host:notaport"], "'host:notaport'"),
        (["--nnodes", "1", "--nproc-per-node", "zero"], "'zero'"),
        (["--nnodes", "1", "--job", "bad/name"], "'bad/name'"),
        (["--nnodes", "1", "--rdzv-conf", "novalue"], "'novalue'"),
        (["--nnodes", "1", "--tee", "7"], "'7'"),
        (["--nnodes", "1", "--local-ranks-filter", "a"], "'a'"),
    ],
)
def test_bad_input_is_one_sentence_and_a_usage_error(args, needle):
    result = run_cli("up", "--dry-run", *args, MLP)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr


def test_missing_script_is_named():
    result = run_cli("up", "--dry-run", "--nnodes", "1", "no/such/train.py")
    assert result.returncode == 2
    assert "'no/such/train.py' does not exist" in result.stderr


@pytest.mark.parametrize("command", [["status"], ["events"], ["jobs"], ["leave", "--node", "a"], ["down"],
                                     ["join", "--wait", "30"], ["up", "--nnodes", "1", MLP]])
def test_every_command_that_reads_etcd_gives_up_after_its_connect_timeout(command):
    # Nothing listens on the port: the command says so after --connect-timeout, not after 10-120 s.
    port = free_port()
    result = run_cli(*command[:1], "--etcd", f"127.0.0.1:{port}", "--connect-timeout", "0.5", *command[1:])
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"elasticctl: error: Cannot reach etcd at 127.0.0.1:{port}: no answer within 0.5 s (is it running there?).")


def test_up_with_embedded_etcd_trains_and_leaves_nothing_behind(tmp_path):
    record = tmp_path / "record.jsonl"
    port, peer = free_port(), free_port()
    result = run_cli("up", "--etcd-listen", "127.0.0.1", "--etcd-port", str(port), "--etcd-peer-port", str(peer),
                     "--etcd-data-dir", str(tmp_path / "etcd"), "--nnodes", "1", MLP, "--steps", "5",
                     "--record", str(record), timeout=180)
    assert result.returncode == 0, result.stderr
    assert f"--etcd 127.0.0.1:{port}" in result.stderr  # the line for another node
    assert "on loopback: it serves this host only" in result.stderr  # not other hosts
    assert [r["step"] for r in read_records(record) if "event" not in r] == [0, 1, 2, 3, 4]
    assert not _listening(port), "the embedded etcd outlived elasticctl"


def test_embedded_etcd_port_in_use_is_a_clear_error(default_etcd):
    result = run_cli("up", "--etcd-listen", "127.0.0.1", "--etcd-port", str(default_etcd.client_port),
                     "--nnodes", "1", MLP)
    assert result.returncode != 0
    assert f"port {default_etcd.client_port}" in result.stderr and "already in use" in result.stderr


def test_sigterm_leaves_gracefully_and_stops_every_worker(default_etcd, tmp_path, run_id):
    up, record = _start_training(default_etcd, tmp_path, run_id)
    try:
        wait_for(lambda: read_records(record), 120, "the first training step")
        tree = psutil.Process(up.pid).children(recursive=True)
        assert any("mlp.py" in " ".join(p.cmdline()) for p in tree)
        up.send_signal(signal.SIGTERM)  # preemption: leave like `elasticctl leave`
        assert up.wait(60) == 0
        assert "left the job" in (tmp_path / "up.log").read_text()
        alive = wait_ended(tree, 30)  # a zombie has ended: its orphans' init collects it later
        assert not alive, f"orphans left behind: {alive}"
    finally:
        if up.poll() is None:
            up.kill()


def _start_training(etcd, tmp_path, run_id) -> tuple[subprocess.Popen, Path]:
    """`elasticctl up` of a long one-node job; its output goes to up.log, its steps to the record."""
    record = tmp_path / "record.jsonl"
    with open(tmp_path / "up.log", "wb") as log:
        up = subprocess.Popen([*ELASTICCTL, "up", "--etcd", etcd.endpoint, "--job", run_id, "--nnodes", "1",
                               MLP, "--steps", "100000", "--step-sleep", "0.05", "--record", str(record)],
                              stdout=log, stderr=subprocess.STDOUT)
    return up, record


def _listening(port: int) -> bool:
    return any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
               for c in psutil.net_connections("tcp"))


def test_sigkill_of_elasticctl_takes_torchrun_and_workers_down(default_etcd, tmp_path, run_id):
    up, record = _start_training(default_etcd, tmp_path, run_id)
    tree: list[psutil.Process] = []
    try:
        wait_for(lambda: read_records(record), 120, "the first training step")
        tree = psutil.Process(up.pid).children(recursive=True)
        up.kill()  # no chance to clean up: the parent-death signal must do it
        up.wait(10)
        alive = wait_ended(tree, 60)
        assert not alive, f"orphans left behind: {alive}"
    finally:
        if up.poll() is None:
            up.kill()
        for proc in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()


def test_a_node_waiting_for_the_others_says_so_at_a_steady_pace(job):
    # MIN 2 and one node: it says how many more it waits for, and which it has, every few seconds
    # (the claim holder counts; another waiting node names it), then trains once b joins.
    j = job(nnodes="2:3")
    a = j.up("a")
    wait_for(lambda: "round 1: waiting for 1 more node (have a; min 2)" in a.log(), 60, "a's waiting line")
    j.join("b")
    j.wait_world(2, {"a", "b"})


def test_join_wait_says_what_it_waits_for_while_it_waits(default_etcd, run_id):
    result = run_cli("join", "--etcd", default_etcd.endpoint, "--job", run_id, "--wait", "6")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith(f"elasticctl: still waiting for job {run_id} to be published (5 s of 6 s)"), lines
    assert f"'{run_id}' does not exist" in lines[-1], lines
