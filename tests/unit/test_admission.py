"""The admission checks of `up` and `join`: the code's digests (hashing, the spec's fields, the
`code` check), room for a checkpoint, the device probe's answer, the user's own checks and the
switches that skip them; the node_refused event.

Layer tests/unit: no etcd, no GPU (the device probe's process is not run: its answer is parsed
from text). The processes: tests/process/test_admission.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from elasticctl import doctor
from elasticctl.cli import cli
from elasticctl.doctor import checks, code, gather
from elasticctl.doctor.checks import DeviceProbe, DeviceResult, Status
from elasticctl.errors import ConfigError
from elasticctl.job.counters import JobCounters
from elasticctl.job.events import describe
from elasticctl.job.records import Event, EventKind
from elasticctl.job.spec import JobSpec

PASS, WARN, FAIL = Status.PASS, Status.WARN, Status.FAIL
ROOT = Path(__file__).resolve().parents[2]
MIB, GIB = 1 << 20, 1 << 30
A, B = "a" * 64, "b" * 64


def tree(root, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


# -- hashing ---------------------------------------------------------------------------------------

def test_a_files_digest_is_its_sha256(tmp_path):
    (tmp_path / "t.py").write_bytes(b"print(1)\n")
    assert code.hash_file(str(tmp_path / "t.py")) == hashlib.sha256(b"print(1)\n").hexdigest()


def test_the_code_digest_does_not_depend_on_the_order_files_were_made_in(tmp_path, monkeypatch):
    files = {"pkg/a.py": b"a", "pkg/sub/b.py": b"b", "pkg/z.py": b"z", "top.py": b"t"}
    tree(tmp_path / "one", files)
    tree(tmp_path / "two", dict(reversed(list(files.items()))))
    monkeypatch.chdir(tmp_path / "one")
    first = code.hash_code(["pkg", "top.py"])
    assert [name for name, _ in code.code_files(["top.py", "pkg"])] == ["pkg/a.py", "pkg/sub/b.py", "pkg/z.py",
                                                                         "top.py"]
    assert code.hash_code(["top.py", "pkg"]) == first  # the order of the paths given does not matter
    monkeypatch.chdir(tmp_path / "two")
    assert code.hash_code(["pkg", "top.py"]) == first


@pytest.mark.parametrize("change", [
    lambda root: (root / "pkg/a.py").write_bytes(b"A"),            # a changed byte
    lambda root: (root / "pkg/a.py").write_bytes(b"a "),           # a byte more
    lambda root: (root / "pkg/a.py").rename(root / "pkg/c.py"),    # a renamed file
    lambda root: (root / "pkg/new.py").write_bytes(b""),           # a new empty file
    lambda root: (root / "pkg/a.py").unlink(),                     # a file less
], ids=["byte", "longer", "renamed", "added", "removed"])
def test_any_change_of_the_code_changes_its_digest(tmp_path, monkeypatch, change):
    tree(tmp_path, {"pkg/a.py": b"a", "pkg/b.py": b"b"})
    monkeypatch.chdir(tmp_path)
    before = code.hash_code(["pkg"])
    change(tmp_path)
    assert code.hash_code(["pkg"]) != before


def test_bytecode_caches_and_git_are_not_code(tmp_path, monkeypatch):
    tree(tmp_path, {"pkg/a.py": b"a"})
    monkeypatch.chdir(tmp_path)
    before = code.hash_code(["pkg"])
    tree(tmp_path, {"pkg/__pycache__/a.cpython-311.pyc": b"x", "pkg/b.pyc": b"y", "pkg/.git/HEAD": b"z",
                    "pkg/sub/__pycache__/c.pyc": b"w"})
    assert code.hash_code(["pkg"]) == before
    assert [name for name, _ in code.code_files(["pkg"])] == ["pkg/a.py"]


def test_a_missing_code_path_is_one_sentence(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="The code path 'nope' does not exist on this host"):
        code.hash_code(["nope"])


def test_too_much_code_is_refused(tmp_path, monkeypatch):
    tree(tmp_path, {f"pkg/{i}.py": b"" for i in range(4)})
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(code, "MAX_CODE_FILES", 3)
    with pytest.raises(ConfigError, match="more than 3 files"):
        code.hash_code(["pkg"])
    monkeypatch.setattr(code, "MAX_CODE_FILES", 100)
    (tmp_path / "pkg/0.py").write_bytes(b"x" * 10)
    monkeypatch.setattr(code, "MAX_CODE_BYTES", 5)
    with pytest.raises(ConfigError, match="larger than"):
        code.hash_code(["pkg"])


def test_a_module_script_is_found_without_importing_it(tmp_path):
    tree(tmp_path, {"mypkg/__init__.py": b"raise SystemExit('imported!')", "mypkg/train.py": b"x = 1",
                    "runnable/__init__.py": b"", "runnable/__main__.py": b"m", "solo.py": b"s"})
    search = [str(tmp_path)]
    assert code.module_file("mypkg.train", search) == str(tmp_path / "mypkg" / "train.py")
    assert code.module_file("runnable", search) == str(tmp_path / "runnable" / "__main__.py")
    assert code.module_file("solo", search) == str(tmp_path / "solo.py")
    assert "mypkg" not in sys.modules
    for name, error in [("nosuch", "is not found"), ("mypkg", "has no __main__.py"), ("a b", "not a Python module")]:
        with pytest.raises(ConfigError, match=error):
            code.module_file(name, search)


def test_a_module_of_the_working_directory_is_found(tmp_path, monkeypatch):
    tree(tmp_path, {"cwd_trainer_for_test.py": b"t"})
    monkeypatch.chdir(tmp_path)
    assert os.path.samefile(code.script_file("cwd_trainer_for_test", module=True),
                            tmp_path / "cwd_trainer_for_test.py")


# -- the spec carries the digests, and they do not make it another job ----------------------------

def test_the_digests_travel_in_the_spec_and_do_not_make_it_differ():
    spec = JobSpec("j", "t.py", script_sha256=A, code_paths=("lib",), code_sha256=B)
    again = JobSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert (again.script_sha256, again.code_paths, again.code_sha256) == (A, ("lib",), B)
    other_host = dataclasses.replace(spec, script_sha256=B, code_sha256=A)
    assert other_host == spec  # a host with other code: refused by the code check, not as a conflict
    assert spec.describe_difference(other_host) == "no difference"
    assert dataclasses.replace(spec, code_paths=("lib", "more"), code_sha256=B) != spec  # a setting of the job


def test_a_spec_of_an_older_elasticctl_has_no_digests():
    spec = JobSpec.from_dict({"name": "j", "script": "t.py"})
    assert (spec.script_sha256, spec.code_paths, spec.code_sha256) == (None, (), None)


@pytest.mark.parametrize(("fields", "error"), [
    ({"script_sha256": "A" * 64}, "64 lowercase hex"),
    ({"script_sha256": "a" * 63}, "64 lowercase hex"),
    ({"script_sha256": "a" * 64 + "\n"}, "64 lowercase hex"),
    ({"script_sha256": 5}, "malformed"),
    ({"code_sha256": "g" * 64, "code_paths": ["x"]}, "64 lowercase hex"),
    ({"code_paths": ["x"]}, "come together"),
    ({"code_sha256": A}, "come together"),
    ({"code_paths": ["x\0y"], "code_sha256": A}, "must be a path"),
    ({"code_paths": [""], "code_sha256": A}, "must be a path"),
    ({"code_paths": "x", "code_sha256": A}, "malformed"),
    ({"code_paths": [f"p{i}" for i in range(65)], "code_sha256": A}, "at most 64"),
])
def test_digests_read_from_etcd_are_validated(fields, error):
    with pytest.raises(ConfigError, match=error):
        JobSpec.from_dict({"name": "j", "script": "t.py", **fields})


def test_up_records_the_digests_and_a_second_up_computes_the_same(tmp_path, monkeypatch):
    from elasticctl.cli.lifecycle import _with_code_digests

    tree(tmp_path, {"train.py": b"t", "lib/a.py": b"a", "lib/__pycache__/a.pyc": b"c"})
    monkeypatch.chdir(tmp_path)
    spec = _with_code_digests(JobSpec("j", "train.py"), "lib, train.py,lib")
    assert spec.script_sha256 == code.hash_file("train.py") and spec.code_paths == ("lib", "train.py")
    assert _with_code_digests(JobSpec("j", "train.py"), "lib,train.py") == spec
    assert _with_code_digests(JobSpec("j", "train.py"), None).code_sha256 is None
    for bad, error in [(" , ", "names no path"), ("nope", "does not exist")]:
        with pytest.raises(ConfigError, match=error):
            _with_code_digests(JobSpec("j", "train.py"), bad)


# -- the code check --------------------------------------------------------------------------------

@pytest.mark.parametrize(("args", "status", "needles"), [
    (dict(expected_script=None, found_script=None), PASS, ["records no digest"]),
    (dict(expected_script=A, found_script=A), PASS, ["script 't.py' (aaaaaaaaaaaa) as in the job's spec"]),
    (dict(expected_script=A, found_script=B), FAIL,
     ["the script 't.py' differs on host h1", "sha256 bbbbbbbbbbbb here, aaaaaaaaaaaa in the job's spec"]),
    (dict(expected_script=A, found_script=A, code_paths=("lib", "x.py"), expected_code=B, found_code=A), FAIL,
     ["the code under lib, x.py differs on host h1", "aaaaaaaaaaaa here, bbbbbbbbbbbb in"]),
    (dict(expected_script=A, found_script=A, code_paths=("lib",), expected_code=B, found_code=B), PASS,
     ["and code under lib (bbbbbbbbbbbb)"]),
    (dict(expected_script=A, found_script=None, error="The training script 't.py' is not a file on this host."),
     FAIL, ["cannot hash the job's code on host h1: The training script"]),
    (dict(expected_script="not hex", found_script=B), PASS, ["records no digest"]),
])
def test_code(args, status, needles):
    check = checks.decide_code("h1", "t.py", **args)
    assert check.status is status and check.name == "code", check
    for needle in needles:
        assert needle in check.detail, check
    if status is FAIL:
        assert "same code on every host" in check.fix


def test_the_code_check_hashes_this_hosts_files(tmp_path, monkeypatch):
    tree(tmp_path, {"t.py": b"one"})
    monkeypatch.chdir(tmp_path)
    spec = JobSpec("j", "t.py", script_sha256=code.hash_file("t.py"))
    assert gather.gather_code(spec, "h").status is PASS
    (tmp_path / "t.py").write_bytes(b"one\n# edited\n")
    check = gather.gather_code(spec, "h")
    assert check.status is FAIL and spec.script_sha256[:12] in check.detail, check
    (tmp_path / "t.py").unlink()
    check = gather.gather_code(spec, "h")
    assert check.status is FAIL and "cannot hash" in check.detail and "t.py" in check.detail, check


def test_a_refusal_names_the_check():
    report = doctor.Report((checks.decide_code("h1", "t.py", A, B),))
    sentence = doctor.refusal(report, "j")
    assert sentence.startswith("This host cannot join job 'j': check code: the script 't.py' differs on host h1")
    assert sentence.endswith("install the same code on every host (the job's script and its --code-hash "
                             "paths), then start this node again.")


# -- room for a checkpoint -------------------------------------------------------------------------

@pytest.mark.parametrize(("free", "newest", "status", "needle"), [
    (10 * GIB, None, PASS, "10.0 GiB free"),                       # no checkpoint yet: today's rule
    (10 * GIB, 0, PASS, "10.0 GiB free"),
    (10 * GIB, 1 * GIB, PASS, "room for 10 checkpoint(s)"),
    (5 * GIB, 1 * GIB, PASS, "room for 5 checkpoint(s)"),
    (5 * GIB - 1, 1 * GIB, WARN, "room for fewer than 5 more"),
    (2 * GIB, 1 * GIB, WARN, "has 2.0 GiB free and the job's newest checkpoint takes 1.0 GiB"),
    (2 * GIB - 1, 1 * GIB, FAIL, "no room for 2 more"),
    (0, 300 * MIB, FAIL, "has 0 B free and the job's newest checkpoint takes 300.0 MiB"),
    (None, 1 * GIB, PASS, "is writable"),                          # free space unknown
])
def test_checkpoint_room(free, newest, status, needle):
    check = checks.decide_checkpoint_dir("/ckpt", None, free, None, newest)
    assert check.status is status and needle in check.detail, check
    if status is not PASS:
        assert check.fix.startswith("Free space on the checkpoint storage: at least 2x")


def test_an_unwritable_directory_fails_before_its_room_is_counted():
    check = checks.decide_checkpoint_dir("/ckpt", "Permission denied", None, None, GIB)
    assert check.status is FAIL and "not writable" in check.detail


def test_the_newest_checkpoints_size_is_found_on_disk(tmp_path):
    assert gather.newest_checkpoint_bytes(str(tmp_path)) is None
    tree(tmp_path, {"step-00000010.pt": b"x" * 10, "step-00000010.pt.sha256": b"d",
                    "step-00000020.pt": b"x" * 20, "step-00000020.pt.sha256": b"d",
                    "step-00000030.pt": b"x" * 30,  # no digest: a write that did not finish
                    ".tmp-step-00000040": b"x" * 40, "other.bin": b"x" * 50})
    assert gather.newest_checkpoint_bytes(str(tmp_path)) == 20
    tree(tmp_path, {"step-00000025/shard-0.distcp": b"x" * 7, "step-00000025/.metadata": b"x" * 3})
    assert gather.newest_checkpoint_bytes(str(tmp_path)) == 10
    assert gather.newest_checkpoint_bytes(str(tmp_path / "missing")) is None


# -- the devices: the probe's answer (untrusted) and the verdict -----------------------------------

def probe_line(devices=(), collective=None, failure=None) -> str:
    data = {"devices": list(devices)}
    if collective is not None:
        data["collective"] = collective
    if failure is not None:
        data["failure"] = failure
    return json.dumps(data)


def test_the_probes_line_is_parsed():
    text = "a warning from torch\n" + probe_line(
        [{"index": 0, "name": "H100", "error": 1e-7}, {"index": 1, "name": "H100", "failure": "CUDA error"}],
        {"status": "pass", "detail": "NCCL all-reduce across 2 GPUs"}) + "\n"
    assert checks.parse_device_probe(text) == DeviceProbe(
        (DeviceResult(0, "H100", 1e-7), DeviceResult(1, "H100", None, "CUDA error")),
        None, "pass", "NCCL all-reduce across 2 GPUs")


@pytest.mark.parametrize(("text", "error"), [
    ("", "printed nothing"),
    ("Segmentation fault\n", "not its JSON line"),
    ("[1, 2]", "not an object"),
    (probe_line([{"index": -1, "error": 0.0}]), "index is malformed"),
    (probe_line([{"index": True, "error": 0.0}]), "index is malformed"),
    (probe_line([{"index": 0, "error": "0"}]), "difference is malformed"),
    ('{"devices": [{"index": 0, "error": NaN}]}', "difference is malformed"),
    (probe_line([{"index": 0, "error": -1.0}]), "difference is malformed"),
    (probe_line([{"index": 0}]), "neither a result nor a failure"),
    (probe_line([{"index": 0, "name": 7, "error": 0.0}]), "device name is not text"),
    (probe_line([{"index": i, "error": 0.0} for i in range(65)]), "device list is malformed"),
    (probe_line(collective={"status": "maybe"}), "collective result is malformed"),
    (probe_line(failure=["x"]), "failure is not text"),
])
def test_a_malformed_probe_answer_is_an_error_not_a_crash(text, error):
    with pytest.raises(ValueError, match=error):
        checks.parse_device_probe(text)


def test_control_characters_of_the_probe_are_escaped():
    probe = checks.parse_device_probe(probe_line([{"index": 0, "name": "evil\x1b[2J\nname", "error": 0.0}]))
    assert probe.devices[0].name.isprintable()


GOOD = DeviceResult(0, "H100", 2e-7)


@pytest.mark.parametrize(("visible", "probe", "error", "status", "needle"), [
    (0, None, None, PASS, "skipped: no GPU visible"),
    (1, DeviceProbe((GOOD,), collective_detail="one GPU: nothing to all-reduce with"), None, PASS,
     "1 GPU(s) (0: H100) compute a matmul as the CPU does (largest difference 2e-07); all-reduce not checked "
     "(one GPU: nothing to all-reduce with)"),
    (2, DeviceProbe((GOOD, DeviceResult(1, "H100", 0.0)), collective="pass"), None, PASS,
     "an all-reduce across them agrees"),
    (2, DeviceProbe((GOOD, DeviceResult(1, "H100", 0.5)), collective="pass"), None, FAIL,
     "GPU 1's matmul differs from the CPU's by 0.5 (above 0.001)"),
    (1, DeviceProbe((DeviceResult(0, "H100", None, "RuntimeError: CUDA error: ECC"),)), None, FAIL,
     "GPU 0 failed a matmul: RuntimeError: CUDA error: ECC"),
    (2, DeviceProbe((GOOD,)), None, FAIL, "torch sees 1 of the 2 visible GPU(s)"),
    (2, DeviceProbe((GOOD, DeviceResult(1, "H100", 0.0)), collective="fail", collective_detail="NCCL error"),
     None, FAIL, "an all-reduce across the GPUs failed: NCCL error"),
    (1, DeviceProbe(failure="torch 2.14.1 cannot use CUDA"), None, FAIL, "cannot be used: torch 2.14.1"),
    (1, None, "it did not finish within 8 s (a hung GPU or driver)", FAIL, "did not finish within 8 s"),
])
def test_devices(visible, probe, error, status, needle):
    check = checks.decide_devices(visible, probe, error)
    assert check.status is status and check.name == "devices" and needle in check.detail, check


def test_no_gpu_no_probe(monkeypatch):
    monkeypatch.setattr(gather, "run_bounded", lambda *a, **k: pytest.fail("the probe ran"))
    assert gather.gather_devices(0).detail == "skipped: no GPU visible"


def test_the_probe_runs_bounded_and_its_answer_is_read(monkeypatch):
    import subprocess

    def timeout(argv, timeout, merge_stderr):
        raise subprocess.TimeoutExpired(argv, timeout)

    monkeypatch.setattr(gather, "run_bounded", timeout)
    check = gather.gather_devices(2, 8.0)
    assert check.status is FAIL and "did not finish within 8 s" in check.detail
    monkeypatch.setattr(gather, "run_bounded", lambda *a, **k: (1, "", "ImportError: no torch\n"))
    check = gather.gather_devices(1)
    assert check.status is FAIL and "status 1 and it printed nothing (ImportError: no torch)" in check.detail, check
    line = probe_line([{"index": 0, "name": "A100", "error": 0.0}])
    monkeypatch.setattr(gather, "run_bounded", lambda *a, **k: (0, line, ""))
    assert gather.gather_devices(1).status is PASS


# -- the user's own checks -------------------------------------------------------------------------

@pytest.mark.parametrize(("returncode", "output", "error", "status", "needle"), [
    (0, "", None, PASS, "the check 'c' passed"),
    (0, "\n  all good \nmore", None, PASS, "passed: all good"),
    (1, "\nno GPU memory left\ndetails", None, FAIL, "exited with status 1: no GPU memory left"),
    (3, "", None, FAIL, "exited with status 3 and printed nothing"),
    (-9, "", None, FAIL, "exited with status -9"),
    (1, "bad\x1b[31m", None, FAIL, "bad\\x1b[31m"),
    (None, "", "did not finish within 10 s", FAIL, "the check 'c' did not finish within 10 s"),
])
def test_custom(returncode, output, error, status, needle):
    check = checks.decide_custom("c", returncode, output, error)
    assert check.status is status and check.name == "custom" and needle in check.detail, check


def test_a_custom_check_runs_without_a_shell(tmp_path):
    ok = gather.gather_custom(f'{sys.executable} -c "print(\'fine\')"')
    assert ok.status is PASS and ok.detail.endswith("passed: fine"), ok
    bad = gather.gather_custom(f'{sys.executable} -c "import sys; print(\'disk full\'); sys.exit(4)"')
    assert bad.status is FAIL and "exited with status 4: disk full" in bad.detail, bad
    assert "cannot be run" in gather.gather_custom(str(tmp_path / "missing")).detail
    assert "cannot be read as a command" in gather.gather_custom('"unclosed').detail
    # no shell: a ';' is an argument, not a second command
    echo = gather.gather_custom(f'{sys.executable} -c "import sys; print(sys.argv[1:])" ; rm -rf /')
    assert echo.status is PASS and "[';', 'rm', '-rf', '/']" in echo.detail, echo


def test_a_custom_check_that_hangs_is_killed_with_its_children(tmp_path):
    import psutil

    # The script and the child it leaves behind both carry a mark of this test's own on their
    # command line, so that what is left of either afterwards can be found among the machine's
    # processes. Whether the child was ever started (a loaded machine may take the whole second to
    # start Python) the answer is the same: nothing of the check outlives it.
    mark = str(tmp_path / "hang-mark")
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent(f"""
        import subprocess, sys, time
        subprocess.Popen([{sys.executable!r}, "-c", "import time; time.sleep(60)", {mark!r}])
        time.sleep(60)
    """))
    check = gather.gather_custom(f"{sys.executable} {script} {mark}", timeout=1.0)
    # Not finished after 60 s of sleep: the timeout ended it (a check that ran on would have passed)
    assert check.status is FAIL and "did not finish within 1 s" in check.detail, check

    def left_running() -> list[int]:
        found = []
        for process in psutil.process_iter():
            try:
                if mark in process.cmdline() and process.status() != psutil.STATUS_ZOMBIE:
                    found.append(process.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass  # ended meanwhile, or not ours
        return found

    # gather_custom kills the check's whole session and then waits for its output pipe to close,
    # that is for every holder of it to end: a child left running is a kill that missed it
    assert left_running() == []


def test_the_budget_bounds_the_custom_checks():
    assert "was not run" in gather.gather_custom("true", timeout=0).detail


# -- the switches --------------------------------------------------------------------------------

@pytest.fixture
def in_repository(monkeypatch):
    monkeypatch.chdir(ROOT)  # trainers/mlp.py, as the docs run it
    for name in [n for n in os.environ if n.startswith("ELASTICCTL_")]:
        monkeypatch.delenv(name)

def test_every_admission_check_is_named_once():
    assert len(set(doctor.ADMISSION_CHECKS)) == len(doctor.ADMISSION_CHECKS)
    assert {"code", "devices", "custom", "checkpoint-dir", "etcd"} <= set(doctor.ADMISSION_CHECKS)


@pytest.mark.parametrize("command", ["up", "join"])
def test_an_unknown_check_to_skip_is_a_usage_error_naming_the_checks(command, in_repository):
    args = [command, "--skip-check", "cod", "--dry-run"] + (["--nnodes", "1", "trainers/mlp.py"] if command == "up"
                                                           else [])
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert "'cod' is not an admission check; the checks are versions," in result.output
    assert "code, devices, custom" in result.output


def test_an_empty_custom_check_is_a_usage_error(in_repository):
    result = CliRunner().invoke(cli, ["up", "--check", " ", "--dry-run", "--nnodes", "1", "trainers/mlp.py"])
    assert result.exit_code == 2 and "this one is empty" in result.output, result.output


def test_a_missing_code_path_is_a_usage_error_of_up(in_repository):
    result = CliRunner().invoke(cli, ["up", "--code-hash", "no/such/dir", "--dry-run", "--nnodes", "1",
                                       "trainers/mlp.py"])
    assert result.exit_code == 2 and "The code path 'no/such/dir' does not exist" in result.output, result.output


def test_up_dry_run_with_the_switches_passes(in_repository):
    result = CliRunner().invoke(cli, ["up", "--code-hash", "trainers", "--skip-check", "code", "--skip-check",
                                       "devices", "--check", "true", "--dry-run", "--nnodes", "1",
                                       "trainers/mlp.py"])
    assert result.exit_code == 0, result.output


def run_quick(monkeypatch, **kwargs) -> doctor.Report:
    """run_checks with etcd and the host's facts out of the way: what the switches do to it."""
    monkeypatch.setattr(doctor, "gather_port", lambda: checks.passed("ports", "ok"))
    monkeypatch.setattr(doctor, "gather_shm", lambda: checks.Check("shm", WARN, "small", "Grow it."))
    monkeypatch.setattr(doctor.launcher, "visible_gpu_count", lambda: 0)
    return doctor.run_checks(settings=None, client=None, etcd_error=None, registry=None, checkpoint_dir=None,
                             local_addr="127.0.0.1", quick=True, **kwargs)


def test_a_skipped_check_does_not_run_and_does_not_count(tmp_path, monkeypatch):
    tree(tmp_path, {"t.py": b"here"})
    monkeypatch.chdir(tmp_path)
    spec = JobSpec("j", "t.py", script_sha256=A)
    monkeypatch.setattr(gather, "hash_file", lambda path: pytest.fail("hashed"))
    report = run_quick(monkeypatch, spec=spec, skip={"code", "shm", "custom"}, custom=("false",))
    by_name = {c.name: c for c in report.checks}
    assert by_name["code"].detail == "skipped: --skip-check code"
    assert by_name["shm"] == checks.Check("shm", PASS, "skipped: --skip-check shm")
    assert by_name["custom"].status is PASS and "skipped" in by_name["custom"].detail
    assert by_name["devices"].detail == "skipped: no GPU visible"


def test_the_code_and_custom_checks_refuse(tmp_path, monkeypatch):
    tree(tmp_path, {"t.py": b"here"})
    monkeypatch.chdir(tmp_path)
    report = run_quick(monkeypatch, spec=JobSpec("j", "t.py", script_sha256=A),
                       custom=(f"{sys.executable} -c 'print(1)'", f"{sys.executable} -c 'raise SystemExit(1)'"))
    assert [c.name for c in report.failed] == ["code", "custom"]
    assert report.failed[1].detail.endswith("exited with status 1 and printed nothing")


# -- the node_refused event ----------------------------------------------------------------------

def test_node_refused_is_an_event_kind_counted_and_shown():
    event = Event(time=1.0, kind=EventKind.NODE_REFUSED, node="h2",
                  reason="host h2: check code: This host cannot join job 'j': ...")
    raw = event.to_json()
    assert Event.from_json(raw.encode() if isinstance(raw, str) else raw) == event
    assert JobCounters().add(event).count(EventKind.NODE_REFUSED) == 1
    assert describe(event).startswith("host h2: check code:")


def test_a_refused_node_is_recorded_in_the_jobs_history(monkeypatch):
    from elasticctl.cli import lifecycle

    recorded = []

    class Log:
        def __init__(self, client, keys):
            pass

        def record(self, kind, node="", **fields):
            recorded.append((kind, node, fields["reason"]))

    monkeypatch.setattr("elasticctl.job.events.EventLog", Log)
    monkeypatch.setattr("socket.gethostname", lambda: "h2")
    lifecycle._record_refusal(None, type("R", (), {"keys": None})(), "n2", "code", "Refused.")
    assert recorded == [(EventKind.NODE_REFUSED, "n2", "host h2: check code: Refused.")]
