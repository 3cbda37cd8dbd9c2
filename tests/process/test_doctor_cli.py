"""`elasticctl doctor`: each check's verdicts from a table of facts, then the pass and fail
paths against a real etcd on loopback, and `up`/`join` refusing a host that fails one.

Layer tests/process: real processes (elasticctl, torchrun, workers, tools). The other tests of this
subject: tests/contract/test_doctor_clock.py, tests/unit/test_doctor.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import pytest
from support.helpers import ELASTICCTL, MLP

from elasticctl.doctor import gather
from elasticctl.etcd.client import EtcdClient
from elasticctl.embedded_etcd import free_port
from elasticctl.etcd.lease import Lease
from elasticctl.job.registry import DEFAULT_KEY_PREFIX, Registry
from elasticctl.job.spec import JobSpec


# -- against a real etcd ----------------------------------------------------------------------------

def run_doctor(*args: str, env: dict | None = None) -> tuple[int, dict[str, dict], str]:
    """`elasticctl doctor --json ...` as a subprocess: exit code, checks by name, stderr."""
    result = subprocess.run([*ELASTICCTL, "doctor", "--json", *args], capture_output=True, text=True,
                            timeout=60, check=False, env={**os.environ, **(env or {})})
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, {c["name"]: c for c in json.loads(result.stdout or "[]")}, result.stderr


@pytest.fixture
def client(default_etcd):
    with EtcdClient(default_etcd.client_settings()) as etcd_client:
        yield etcd_client


@pytest.fixture
def job(client, run_id):
    """A published job named ``run_id`` with no node yet."""
    registry = Registry(client, run_id)
    registry.publish_spec(JobSpec(name=run_id, script=MLP, min_nodes=1, max_nodes=2))
    yield registry
    registry.delete_job()


@pytest.fixture
def lease(client):
    kept = Lease(client, 10).start()
    yield kept.id()
    kept.stop(revoke=True)


def add_node(registry: Registry, lease: int, node: str, **record) -> None:
    """A node record; by default one of a node on this host (as an `up` on loopback writes it)."""
    registry.register_node({"host": socket.gethostname(), "addr": "127.0.0.1", "pid": 1, **record}, lease, node)


def test_a_healthy_host_passes_every_check(default_etcd, job, tmp_path):
    code, checks, _ = run_doctor("--etcd", default_etcd.endpoint, "--job", job.job,
                                 "--checkpoint-dir", str(tmp_path / "ckpt"), "--local-addr", "127.0.0.1")
    assert code == 0, checks
    assert [c for c in checks.values() if c["status"] == "fail"] == []
    for name in ("job", "versions", "torch-agreement", "gpus", "interface", "etcd", "clock", "ports", "shm",
                 "checkpoint-dir", "checkpoint-shared", "etcd-version"):
        assert name in checks, name
    for name in ("interface", "ports", "checkpoint-dir", "checkpoint-shared", "etcd-version"):
        assert checks[name]["status"] == "pass", checks[name]
    assert checks["etcd-version"]["detail"].startswith("1 member ('elasticctl' 3."), checks["etcd-version"]
    for name in ("etcd", "clock"):  # a latency warning is what a loaded machine (the suite) earns
        assert checks[name]["status"] in ("pass", "warn"), checks[name]
    assert checks["etcd"]["detail"].startswith(f"{default_etcd.endpoint} answers, median ")


def test_unreachable_etcd_fails_quickly_naming_the_endpoint():
    closed = f"127.0.0.1:{free_port()}"  # bound then released: nothing listens there
    started = time.monotonic()
    code, checks, _ = run_doctor("--etcd", closed)
    assert code == 1
    assert checks["etcd"]["status"] == "fail" and closed in checks["etcd"]["detail"]
    assert checks["etcd"]["fix"]
    assert time.monotonic() - started < 30
    assert checks["versions"]["status"] == "pass"  # the checks that need no etcd still ran


def test_bad_checkpoint_dir_fails(default_etcd, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code, checks, _ = run_doctor("--etcd", default_etcd.endpoint, "--checkpoint-dir", str(blocker / "ckpt"))
    assert code == 1
    assert checks["checkpoint-dir"]["status"] == "fail"
    assert f"'{blocker / 'ckpt'}' is not writable: Not a directory" in checks["checkpoint-dir"]["detail"]


def test_loopback_interface_fails_in_a_multi_host_job(default_etcd, job, lease):
    add_node(job, lease, "local")
    code, checks, _ = run_doctor("--etcd", default_etcd.endpoint, "--job", job.job, "--local-addr", "127.0.0.1")
    assert code == 0 and checks["interface"]["status"] == "pass", checks["interface"]

    add_node(job, lease, "far", host="other-host", addr="10.9.9.9")
    code, checks, _ = run_doctor("--etcd", default_etcd.endpoint, "--job", job.job, "--local-addr", "127.0.0.1")
    assert code == 1
    assert checks["interface"]["status"] == "fail"
    assert "far on other-host (10.9.9.9)" in checks["interface"]["detail"]
    assert "--local-addr" in checks["interface"]["fix"]


def test_a_gloo_interface_this_host_lacks_fails(default_etcd):
    code, checks, _ = run_doctor("--etcd", default_etcd.endpoint, "--local-addr", "127.0.0.1",
                                 env={"GLOO_SOCKET_IFNAME": "nosuch9"})
    assert code == 1 and "GLOO_SOCKET_IFNAME=nosuch9 names no interface" in checks["interface"]["detail"]


def test_torch_versions_of_the_other_nodes(default_etcd, job, lease):
    local = gather.installed_torch_version()
    add_node(job, lease, "old-elasticctl")  # no torch field: unknown, not an error
    add_node(job, lease, "same", torch=local)
    code, checks, _ = run_doctor("--etcd", default_etcd.endpoint, "--job", job.job, "--local-addr", "127.0.0.1")
    assert code == 0 and checks["torch-agreement"]["status"] == "pass"
    assert "did not publish theirs (old-elasticctl)" in checks["torch-agreement"]["detail"]

    add_node(job, lease, "ancient", torch="1.13.1")
    code, checks, _ = run_doctor("--etcd", default_etcd.endpoint, "--job", job.job, "--local-addr", "127.0.0.1")
    assert code == 1 and checks["torch-agreement"]["status"] == "fail"
    assert "ancient has 1.13.1" in checks["torch-agreement"]["detail"]


def test_checkpoint_marker_tells_a_different_directory_apart(default_etcd, job, tmp_path):
    shared, other = tmp_path / "shared", tmp_path / "other"
    args = ("--etcd", default_etcd.endpoint, "--job", job.job, "--local-addr", "127.0.0.1")
    shared.mkdir()
    other.mkdir()
    code, checks, _ = run_doctor(*args, "--checkpoint-dir", str(shared))
    assert code == 0 and "no node of job" in checks["checkpoint-shared"]["detail"]  # doctor claims nothing
    # The job's first node (`up` runs the same checks, preparing) claims the marker.
    outcome = gather.gather_checkpoint_marker(job, str(shared))
    assert "first node of job" in outcome.check.detail
    marker = (shared / f".elasticctl-{job.job}.marker").read_text().strip()
    kv = job.client.get(f"{DEFAULT_KEY_PREFIX}/{job.job}/checkpoint-marker")
    assert kv is not None and kv.value.decode() == marker

    code, checks, _ = run_doctor(*args, "--checkpoint-dir", str(shared))
    assert code == 0 and "the same directory as the other nodes" in checks["checkpoint-shared"]["detail"]

    code, checks, _ = run_doctor(*args, "--checkpoint-dir", str(other))
    assert code == 1 and checks["checkpoint-shared"]["status"] == "fail"
    assert "holds no marker" in checks["checkpoint-shared"]["detail"]
    (other / f".elasticctl-{job.job}.marker").write_text("a-stale-token\n")
    code, checks, _ = run_doctor(*args, "--checkpoint-dir", str(other))
    assert code == 1 and "holds a different marker" in checks["checkpoint-shared"]["detail"]


def test_doctor_uses_the_jobs_checkpoint_dir_by_default(default_etcd, client, run_id, tmp_path):
    registry = Registry(client, run_id)
    registry.publish_spec(JobSpec(name=run_id, script=MLP, checkpoint_dir=str(tmp_path / "ck")))
    try:
        code, checks, _ = run_doctor("--etcd", default_etcd.endpoint, "--local-addr", "127.0.0.1",
                                     "--job", run_id)
        assert code == 0 and str(tmp_path / "ck") in checks["checkpoint-dir"]["detail"]
    finally:
        registry.delete_job()


def test_deep_reads_the_torch_build(default_etcd):
    code, checks, _ = run_doctor("--etcd", default_etcd.endpoint, "--local-addr", "127.0.0.1", "--deep")
    assert code == 0 and checks["torch-build"]["status"] == "pass"
    assert checks["torch-build"]["detail"].startswith("torch ")


@pytest.mark.parametrize(("args", "needle"), [
    (["--etcd", "host:notaport"], "'host:notaport'"),
    (["--job", "bad/name"], "'bad/name'"),
])
def test_bad_input_is_one_sentence(args, needle):
    result = subprocess.run([*ELASTICCTL, "doctor", *args], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elasticctl: error: ") and needle in lines[0], result.stderr


# -- up and join refuse a host that fails a check -----------------------------------------------------

def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*ELASTICCTL, *args], capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, **(env or {})})


def one_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("elasticctl: error: ")]
    assert len(errors) == 1 and result.stderr.strip().splitlines()[-1] == errors[0], result.stderr
    assert all(needle in errors[0] for needle in needles), result.stderr
    return errors[0]


def job_keys(client: EtcdClient, job: str) -> list[str]:
    return [kv.key.decode() for kv in client.get_prefix(f"{DEFAULT_KEY_PREFIX}/{job}/")]


def test_up_refuses_an_unwritable_checkpoint_dir_and_publishes_nothing(default_etcd, client, run_id, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = run_cli("up", "--etcd", default_etcd.endpoint, "--job", run_id, "--nnodes", "1",
                     "--checkpoint-dir", str(blocker / "ckpt"), MLP, "--steps", "1")
    one_error(result, f"This host cannot join job '{run_id}'", f"'{blocker / 'ckpt'}' is not writable")
    assert job_keys(client, run_id) == []


def test_up_that_fails_after_claiming_the_marker_takes_it_back(default_etcd, client, run_id, tmp_path):
    # The checks pass (the marker is claimed), then the node is refused: one GPU, two processes.
    # The GPU is pretended (CUDA_VISIBLE_DEVICES on a host without one): its admission check, which
    # would run a matmul on it, is skipped.
    result = run_cli("up", "--etcd", default_etcd.endpoint, "--job", run_id, "--nnodes", "1",
                     "--nproc-per-node", "2", "--checkpoint-dir", str(tmp_path / "ckpt"), "--skip-check", "devices",
                     MLP, env={"CUDA_VISIBLE_DEVICES": "0"})
    one_error(result, "processes per node (2) exceed the 1 GPUs")
    assert job_keys(client, run_id) == []


def test_join_refuses_a_loopback_node_in_a_multi_host_job(default_etcd, job, lease):
    add_node(job, lease, "far", host="other-host", addr="10.9.9.9")
    result = run_cli("join", "--etcd", default_etcd.endpoint, "--job", job.job, "--local-addr", "127.0.0.1")
    one_error(result, f"This host cannot join job '{job.job}'", "loopback interface lo",
              "far on other-host (10.9.9.9)", "--local-addr")
    assert sorted(job.live_nodes()) == ["far"]  # refused before registering


def test_join_refuses_a_different_checkpoint_directory(default_etcd, client, run_id, tmp_path, lease):
    registry = Registry(client, run_id)
    shared = tmp_path / "shared"
    registry.publish_spec(JobSpec(name=run_id, script=MLP, checkpoint_dir=str(shared)))
    try:
        add_node(registry, lease, "first")
        registry.claim_checkpoint_marker("token-of-the-first-node")
        shared.mkdir()
        (shared / f".elasticctl-{run_id}.marker").write_text("token-on-another-host\n")
        result = run_cli("join", "--etcd", default_etcd.endpoint, "--job", run_id, "--local-addr", "127.0.0.1")
        one_error(result, f"'{shared}' holds a different marker for job {run_id}")
        assert sorted(registry.live_nodes()) == ["first"]
    finally:
        registry.delete_job()


# -- a check changes nothing it checks -------------------------------------------------------------

@pytest.mark.parametrize("relative", ["ck", "deep/er/and/deeper/ck", "a name\nwith a newline/ck"],
                         ids=["relative", "deep", "newline"])
def test_doctor_creates_no_checkpoint_directory_and_claims_no_marker(default_etcd, job, tmp_path, relative):
    result = subprocess.run([*ELASTICCTL, "doctor", "--json", "--etcd", default_etcd.endpoint, "--job", job.job,
                             "--local-addr", "127.0.0.1", "--checkpoint-dir", relative],
                            capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path)
    assert "Traceback" not in result.stderr, result.stderr
    checks = {c["name"]: c for c in json.loads(result.stdout)}
    assert checks["checkpoint-dir"]["status"] == "pass", checks["checkpoint-dir"]
    assert "does not exist yet" in checks["checkpoint-dir"]["detail"]
    assert str(tmp_path) in checks["checkpoint-dir"]["detail"]  # where the job would create it
    assert checks["checkpoint-shared"]["status"] == "pass", checks["checkpoint-shared"]
    assert list(tmp_path.iterdir()) == []  # old: the whole path was created
    assert job.client.get(f"{DEFAULT_KEY_PREFIX}/{job.job}/checkpoint-marker") is None  # old: claimed


def test_doctor_on_an_existing_directory_leaves_it_as_it_was(default_etcd, job, tmp_path):
    (tmp_path / "ckpt").mkdir()
    code, checks, _ = run_doctor("--etcd", default_etcd.endpoint, "--job", job.job, "--local-addr", "127.0.0.1",
                                 "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert code == 0 and "is writable" in checks["checkpoint-dir"]["detail"], checks
    assert list((tmp_path / "ckpt").iterdir()) == []  # the probe file removed, no marker written
    assert job.client.get(f"{DEFAULT_KEY_PREFIX}/{job.job}/checkpoint-marker") is None


def test_a_missing_directory_the_job_could_not_create_fails(default_etcd, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, checks, _ = run_doctor("--etcd", default_etcd.endpoint, "--local-addr", "127.0.0.1",
                                 "--checkpoint-dir", str(blocker / "deep" / "ckpt"))
    assert code == 1 and "Not a directory" in checks["checkpoint-dir"]["detail"], checks
