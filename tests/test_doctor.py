"""`elasticctl doctor`: each check's verdicts from a table of facts, then the pass and fail
paths against a real etcd on loopback, and `up`/`join` refusing a host that fails one."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time

import pytest
from click.testing import CliRunner
from support.helpers import ELASTICCTL, MLP

from elasticctl import doctor
from elasticctl.cli import cli
from elasticctl.doctor import (
    Check,
    DateSample,
    Gpu,
    InterfaceFacts,
    RemoteNode,
    Report,
    Status,
)
from elasticctl.etcd.client import EtcdClient
from elasticctl.embedded_etcd import free_port
from elasticctl.etcd.lease import Lease
from elasticctl.job.registry import DEFAULT_KEY_PREFIX, NODE_FIELDS, Registry, typed_record
from elasticctl.job.spec import JobSpec

PASS, WARN, FAIL = Status.PASS, Status.WARN, Status.FAIL
GIB = 1 << 30


# -- the pure decisions, from tables ------------------------------------------------------------

@pytest.mark.parametrize(("python", "torch", "status", "needle"), [
    ((3, 11, 7), "2.14.1", PASS, "Python 3.11.7, torch 2.14.1"),
    ((3, 9, 18), "2.14.1", FAIL, "Python 3.9.18 is older than the 3.10"),
    ((3, 12, 0), None, FAIL, "torch is not installed"),
])
def test_versions(python, torch, status, needle):
    check = doctor.decide_versions(python, torch)
    assert (check.status, needle in check.detail) == (status, True), check


@pytest.mark.parametrize(("local", "others", "status", "needle"), [
    ("2.14.1", {}, PASS, "no other live node"),
    ("2.14.1", {"a": "2.14.1", "b": "2.14.1"}, PASS, "on 2 other node(s)"),
    ("2.14.1", {"a": "2.14.0"}, WARN, "a has 2.14.0"),
    ("2.14.1+cu124", {"a": "2.14.1+cpu"}, WARN, "a has 2.14.1+cpu"),
    ("2.14.1", {"a": "2.13.0", "b": "2.14.1"}, FAIL, "this host has torch 2.14.1 but a has 2.13.0"),
    # A node of an older elasticctl publishes no version: unknown, not an error.
    ("2.14.1", {"old": None}, PASS, "1 node(s) did not publish theirs (old)"),
    ("2.14.1", {"old": None, "a": "2.14.1"}, PASS, "did not publish theirs (old)"),
    (None, {"a": "2.14.1"}, PASS, "nothing to compare"),
])
def test_torch_agreement(local, others, status, needle):
    check = doctor.decide_torch_agreement(local, others)
    assert check.status is status and needle in check.detail, check


@pytest.mark.parametrize(("args", "status", "needle"), [
    (("2.14.1", None, False, None, True, 0), PASS, "CUDA none (CPU build)"),
    (("2.14.1", "12.4", True, "2.21.5", True, 8), PASS, "NCCL 2.21.5"),
    (("2.14.1", None, False, None, True, 2), FAIL, "but 2 GPU(s) are visible"),
    (("2.14.1", "12.4", False, None, True, 2), FAIL, "CUDA cannot use the 2 visible GPU(s)"),
    (("2.14.1", None, False, None, False, 0), FAIL, "gloo is not available"),
])
def test_torch_build(args, status, needle):
    check = doctor.decide_torch_build(*args)
    assert check.status is status and needle in check.detail, check


def test_nvidia_smi_rows_are_parsed_and_junk_is_skipped():
    text = ("0, NVIDIA A100-SXM4-80GB, 41, 1024, 81920, 0\n"
            "1, NVIDIA A100-SXM4-80GB, 93, 0, 81920, [N/A]\n"
            "No devices were found\n")
    assert doctor.parse_nvidia_smi(text) == [
        Gpu(0, "NVIDIA A100-SXM4-80GB", 41, 1024, 81920, 0),
        Gpu(1, "NVIDIA A100-SXM4-80GB", 93, 0, 81920, None),
    ]


HEALTHY = Gpu(0, "A100", 40, 0, 81920, 0)


@pytest.mark.parametrize(("gpus", "error", "devices", "peers", "status", "needle"), [
    (None, None, 0, (), PASS, "no GPU: CPU/gloo"),
    ([], None, 0, (), PASS, "no GPU: CPU/gloo"),
    (None, None, 0, ("b",), WARN, "but b have GPUs"),
    (None, None, 2, (), WARN, "2 /dev/nvidia device(s) but no nvidia-smi"),
    (None, "exit code 9: NVIDIA-SMI has failed", 1, (), FAIL, "nvidia-smi failed: exit code 9"),
    ([HEALTHY], None, 1, (), PASS, "1 GPU(s) healthy (0: A100)"),
    ([HEALTHY, Gpu(1, "A100", 40, 0, 81920, 3)], None, 2, (), WARN, "GPU 1 has 3 uncorrected ECC errors"),
    ([Gpu(0, "A100", 95, 0, 81920, None)], None, 1, (), WARN, "GPU 0 is at 95 C"),
])
def test_gpus(gpus, error, devices, peers, status, needle):
    check = doctor.decide_gpus(gpus, error, devices, peers)
    assert check.status is status and needle in check.detail, check


OTHER_HOST = RemoteNode("b", "host-b", "10.0.0.2")
LOOPBACK = InterfaceFacts(local_addr="127.0.0.1", interface="lo", addresses=("127.0.0.1", "::1"),
                          loopback=True, available=("eth0", "lo"))
ETH0 = InterfaceFacts(local_addr="10.0.0.1", interface="eth0", addresses=("10.0.0.1",), loopback=False,
                      available=("eth0", "lo"))


@pytest.mark.parametrize(("facts", "status", "needle"), [
    (LOOPBACK, PASS, "loopback, fine while every node runs on this host"),
    (InterfaceFacts(**{**LOOPBACK.__dict__, "remote_nodes": (OTHER_HOST,)}), FAIL,
     "loopback interface lo (127.0.0.1, ::1) while the job has nodes on other hosts: b on host-b (10.0.0.2)"),
    (InterfaceFacts(**{**ETH0.__dict__, "remote_nodes": (OTHER_HOST,)}), PASS, "eth0 (10.0.0.1) holding 10.0.0.1"),
    (InterfaceFacts(**{**ETH0.__dict__, "interface": None, "variable": "GLOO_SOCKET_IFNAME",
                       "requested": "ib0"}), FAIL, "GLOO_SOCKET_IFNAME=ib0 names no interface of this host"),
    (InterfaceFacts(**{**ETH0.__dict__, "variable": "GLOO_SOCKET_IFNAME", "requested": "eth0"}), PASS,
     "from GLOO_SOCKET_IFNAME"),
    (InterfaceFacts(**{**ETH0.__dict__, "nccl_requested": "ib"}), FAIL, "NCCL_SOCKET_IFNAME=ib matches no"),
    (InterfaceFacts(**{**ETH0.__dict__, "interface": None, "addresses": ()}), WARN,
     "the local address 10.0.0.1 is on no interface of this host"),
])
def test_interface(facts, status, needle):
    check = doctor.decide_interface(facts)
    assert check.status is status and needle in check.detail, check


@pytest.mark.parametrize(("value", "exact", "chosen"), [
    ("eth0", True, ("eth0",)),
    ("eth", True, ()),
    ("eth0,lo", True, ("eth0", "lo")),
    ("eth", False, ("eth0", "eth1")),
    ("=eth", False, ()),
    ("^docker,lo", False, ("eth0", "eth1")),
])
def test_socket_ifname_values_select_interfaces_as_gloo_and_nccl_do(value, exact, chosen):
    assert doctor._interfaces_named(value, ("docker0", "eth0", "eth1", "lo"), exact) == chosen


@pytest.mark.parametrize(("latencies", "error", "status", "needle"), [
    ([0.6, 0.8, 0.7], None, PASS, "median 0.7 ms over 3 reads"),
    ([80.0, 90.0, 1.0], None, WARN, "median 80.0 ms over 3 reads (above 50 ms)"),
    ([], "cannot reach etcd at h:1: no answer", FAIL, "cannot reach etcd at h:1"),
    ([], None, WARN, "etcd not checked"),
])
def test_etcd(latencies, error, status, needle):
    check = doctor.decide_etcd("h:1", latencies, error)
    assert check.status is status and needle in check.detail, check


def samples_with_offset(offset: float, start: float = 1_000_000.25, count: int = 6) -> list[DateSample]:
    """What a host whose clock is ``offset`` s behind etcd's would see (1 ms round trips)."""
    found = []
    for i in range(count):
        sent = start + i / count
        found.append(DateSample(sent, sent + 0.001, float(int(sent + 0.0005 + offset))))
    return found


@pytest.mark.parametrize(("offset", "status"), [
    (0.0, PASS), (0.4, PASS), (-0.7, PASS), (2.5, WARN), (-5.0, WARN), (45.0, FAIL), (-3600.0, FAIL),
])
def test_clock_offset_is_bounded_from_date_headers(offset, status):
    low, high = doctor.clock_offset_bounds(samples_with_offset(offset))
    assert low <= offset <= high and high - low < 0.25
    assert doctor.decide_clock((low, high)).status is status


def test_one_date_sample_reports_only_an_offset_it_is_sure_of():
    # One sample bounds the offset to a second: 1.4 s could be 0.9 s, not enough to warn.
    bounds = doctor.clock_offset_bounds(samples_with_offset(1.4, count=1))
    assert bounds[1] - bounds[0] == pytest.approx(1.001)
    assert doctor.decide_clock(bounds).status is PASS
    assert doctor.decide_clock(doctor.clock_offset_bounds(samples_with_offset(-31.5, count=1))).status is FAIL


def test_clock_that_steps_between_samples_trusts_the_last_one():
    stepped = [DateSample(100.0, 100.001, 100.0), DateSample(101.0, 101.001, 160.0)]
    assert doctor.clock_offset_bounds(stepped) == pytest.approx((58.999, 60.0))
    check = doctor.decide_clock(doctor.clock_offset_bounds(stepped))
    assert check.status is FAIL and "leases and record timestamps would lie" in check.detail


def test_clock_unmeasurable_is_a_warning():
    check = doctor.decide_clock(None, "Connection refused")
    assert check.status is WARN and "Connection refused" in check.detail


@pytest.mark.parametrize(("total", "free", "status", "needle"), [
    (24 * GIB, 23 * GIB, PASS, "/dev/shm 24.0 GiB, 23.0 GiB free"),
    (64 << 20, 64 << 20, WARN, "DataLoader workers and NCCL need more"),
    (None, None, WARN, "/dev/shm is missing"),
])
def test_shm(total, free, status, needle):
    check = doctor.decide_shm(total, free)
    assert check.status is status and needle in check.detail, check


def test_port():
    assert doctor.decide_port("0.0.0.0", 4242, None).status is PASS
    check = doctor.decide_port("0.0.0.0", None, "Address already in use")
    assert check.status is FAIL and "cannot listen on 0.0.0.0: Address already in use" in check.detail


def test_a_free_port_listens_here():
    assert doctor.gather_port("127.0.0.1").status is PASS


@pytest.mark.parametrize(("path", "error", "status", "needle"), [
    (None, None, PASS, "no checkpoint directory given"),
    ("/ckpt", None, PASS, "'/ckpt' is writable"),
    ("/ckpt", "Permission denied", FAIL, "the checkpoint directory '/ckpt' is not writable: Permission denied"),
])
def test_checkpoint_dir(path, error, status, needle):
    check = doctor.decide_checkpoint_dir(path, error)
    assert check.status is status and needle in check.detail, check


@pytest.mark.parametrize(("in_etcd", "in_file", "claimed", "status", "needle"), [
    ("t1", "t1", True, PASS, "first node of job j"),
    ("t1", "t1", False, PASS, "the same directory as the other nodes"),
    ("t1", "t2", False, FAIL, "holds a different marker for job j"),
    ("t1", None, False, FAIL, "holds no marker for job j"),
])
def test_checkpoint_marker(in_etcd, in_file, claimed, status, needle):
    check = doctor.decide_checkpoint_marker("/ckpt", "j", in_etcd, in_file, claimed)
    assert check.status is status and needle in check.detail, check


@pytest.mark.parametrize(("named", "jobs", "status", "chosen"), [
    (None, {}, PASS, None),
    (None, {"a": 2}, PASS, "a"),
    (None, {"a": 2, "b": 1}, PASS, None),
    ("b", {"a": 2, "b": 1}, PASS, "b"),
    ("c", {"a": 2}, WARN, None),
])
def test_job(named, jobs, status, chosen):
    check, job = doctor.decide_job(named, jobs)
    assert (check.status, job) == (status, chosen)


def test_refusal_is_one_sentence_naming_the_first_failure():
    report = Report((
        Check("shm", WARN, "small", "Grow it."),
        Check("checkpoint-dir", FAIL, "the checkpoint directory '/x' is not writable: Permission denied",
              "Create the directory with write permission for this user."),
        Check("interface", FAIL, "loopback", "Pass --local-addr."),
    ))
    assert doctor.refusal(report, "j") == (
        "This host cannot join job 'j': the checkpoint directory '/x' is not writable: Permission denied "
        "(and 1 more failed check(s) above); create the directory with write permission for this user.")
    assert doctor.refusal(Report((Check("shm", WARN, "small", "Grow it."),)), "j") is None


def test_check_lines_show_the_fix_only_when_something_is_wrong():
    assert Check("a", PASS, "fine").lines() == ["PASS a: fine"]
    assert Check("b", WARN, "meh", "Do x.").lines() == ["WARN b: meh", "  fix: Do x."]


def test_node_records_keep_the_torch_version_and_older_records_still_read():
    assert typed_record(b'{"id": "a", "torch": "2.14.1"}', NODE_FIELDS) == {"id": "a", "torch": "2.14.1"}
    assert typed_record(b'{"id": "a", "torch": 2}', NODE_FIELDS) == {"id": "a"}


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
                 "checkpoint-dir", "checkpoint-shared"):
        assert name in checks, name
    for name in ("interface", "ports", "checkpoint-dir", "checkpoint-shared"):
        assert checks[name]["status"] == "pass", checks[name]
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


def test_checkpoint_dir_probe_leaves_nothing_behind(tmp_path):
    assert doctor.probe_writable(str(tmp_path / "new" / "ckpt")) is None
    assert list((tmp_path / "new" / "ckpt").iterdir()) == []


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
    local = doctor.installed_torch_version()
    add_node(job, lease, "old-elasticctl")  # no torch field: unknown, not an error
    add_node(job, lease, "same", torch=local)
    code, checks, _ = run_doctor("--etcd", default_etcd.endpoint, "--job", job.job, "--local-addr", "127.0.0.1")
    assert code == 0 and checks["torch-agreement"]["status"] == "pass"
    assert "did not publish theirs (old-elasticctl)" in checks["torch-agreement"]["detail"]

    add_node(job, lease, "ancient", torch="1.13.1")
    code, checks, _ = run_doctor("--etcd", default_etcd.endpoint, "--job", job.job, "--local-addr", "127.0.0.1")
    assert code == 1 and checks["torch-agreement"]["status"] == "fail"
    assert "ancient has 1.13.1" in checks["torch-agreement"]["detail"]


@pytest.mark.parametrize(("skew", "status"), [(0.0, "pass"), (-5.0, "warn"), (45.0, "fail")])
def test_clock_offset_against_a_real_etcd(default_etcd, monkeypatch, skew, status):
    # This host's clock, faked: `skew` seconds ahead of etcd's (the real one).
    monkeypatch.setattr(doctor, "wall_clock", lambda: time.time() + skew)
    result = CliRunner().invoke(cli, ["doctor", "--json", "--etcd", default_etcd.endpoint,
                                      "--local-addr", "127.0.0.1"])
    clock = {c["name"]: c for c in json.loads(result.output)}["clock"]
    assert clock["status"] == status, clock
    assert result.exit_code == (1 if status == "fail" else 0)
    if skew:
        direction = "ahead of" if skew > 0 else "behind"
        seconds, error = (float(v) for v in re.findall(r"([0-9.]+) s", clock["detail"])[:2])
        assert abs(seconds - abs(skew)) <= error + 0.05 and f"{direction} etcd's" in clock["detail"], clock


def test_checkpoint_marker_tells_a_different_directory_apart(default_etcd, job, tmp_path):
    shared, other = tmp_path / "shared", tmp_path / "other"
    args = ("--etcd", default_etcd.endpoint, "--job", job.job, "--local-addr", "127.0.0.1")
    shared.mkdir()
    other.mkdir()
    code, checks, _ = run_doctor(*args, "--checkpoint-dir", str(shared))
    assert code == 0 and "no node of job" in checks["checkpoint-shared"]["detail"]  # doctor claims nothing
    # The job's first node (`up` runs the same checks, preparing) claims the marker.
    outcome = doctor.gather_checkpoint_marker(job, str(shared))
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
    result = run_cli("up", "--etcd", default_etcd.endpoint, "--job", run_id, "--nnodes", "1",
                     "--nproc-per-node", "2", "--checkpoint-dir", str(tmp_path / "ckpt"), MLP,
                     env={"CUDA_VISIBLE_DEVICES": "0"})
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


# -- issue 23, item 9: a check changes nothing it checks -------------------------------------------

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


@pytest.mark.parametrize(("progress", "status", "needle"), [
    (None, PASS, "no failed checkpoint"),
    ({"step": 5}, PASS, "no failed checkpoint"),
    ({"checkpoint_error": "Writing ... failed: the disk is full (No space left on device).",
      "checkpoint_failures": 3}, WARN, "the job's last 3 checkpoint(s) failed: Writing ... failed: the disk is full"),
])
def test_checkpoint_health(progress, status, needle):  # issue 23, item 6
    check = doctor.decide_checkpoint_health(progress)
    assert check.status is status and needle in check.detail, check
