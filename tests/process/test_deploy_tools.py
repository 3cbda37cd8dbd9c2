"""Static checks of the deployment recipes: Dockerfile, compose.yaml, deploy/k8s, deploy/slurm.

No container engine or cluster runs here, so these tests check what the recipes rely on:
the structure the tools accept (`docker-compose config`, `kubectl kustomize` where
installed) and the fields the guide's walk-throughs (docs/operations.md) depend on. The Slurm
script is run for real against stub `srun`/`scontrol`/`scancel`/`elasticctl` commands.

Layer tests/process: real processes (elasticctl, torchrun, workers, tools). The other tests of this
subject: tests/unit/test_deploy.py, and tests/infra/test_slurm.py (the Slurm script on a real Slurm).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from support.deploy import (
    COMPOSE,
    K8S,
    ROOT,
    SBATCH,
    container,
    k8s_objects,
    load_compose,
    option,
    script_of,
    trainer_services,
)


# --- compose.yaml --------------------------------------------------------------------------


def docker_compose() -> str:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (.ci/run installs Debian's docker-compose)")
    return binary


@pytest.mark.parametrize("profile", [None, "gpu"])
def test_compose_file_passes_docker_compose_config(profile):
    command = [docker_compose(), "--project-directory", str(ROOT), "-f", str(COMPOSE)]
    if profile:
        command += ["--profile", profile]
    result = subprocess.run([*command, "config"], check=False, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    # What the tool resolved (anchors merged, defaults filled) keeps what the recipes rely on.
    for name, service in trainer_services(resolved).items():
        assert service["depends_on"]["etcd"]["condition"] == "service_healthy", name
        # docker-compose 1.x prints short syntax, Compose v2 long syntax.
        mounts = [v if isinstance(v, dict) else dict(zip(("source", "target"), v.split(":"))) for v in service["volumes"]]
        assert any(m.get("source") == "checkpoints" and m.get("target") == "/checkpoints" for m in mounts), name
    gpu = resolved["services"]["trainer-gpu"]
    device = gpu["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]


@pytest.mark.parametrize("variant", ["", "gpu"])
def test_k8s_kustomize_renders(variant):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize` render not checked")
    result = subprocess.run([kubectl, "kustomize", str(K8S / variant)], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    rendered = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(result.stdout) if d}
    # What kustomize makes of the manifests (labels added, images set, patches applied) is what
    # the cluster gets: every object must fit the schemas of a current Kubernetes, strictly.
    version = kubernetes_validate.latest_version()
    for (kind, name), obj in rendered.items():
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{kind}/{name} at {'.'.join(map(str, exc.path))}: {exc.message} (Kubernetes {version})")
    cont = container(rendered[("Job", "trainer")], "trainer")
    args = cont["args"]
    if variant == "gpu":
        assert cont["resources"]["limits"]["nvidia.com/gpu"] >= 1
        assert cont["image"].endswith(":cuda")
        # The inserted flag must land before the script, or it would go to the script.
        assert option(args[: args.index(script_of(args))], "--nproc-per-node") == "auto"
    else:
        assert "nvidia.com/gpu" not in json.dumps(cont) and cont["image"].endswith(":cpu")


# --- the recipes against the CLI ----------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "elasticctl.cli", *args], check=False, capture_output=True, text=True, timeout=60, cwd=ROOT,
    )


def recipe_up_lines() -> dict[str, list[str]]:
    """Every `elasticctl up` line the recipes run, with deploy-time values filled in."""
    lines = {f"compose:{name}": svc["command"][1:] for name, svc in trainer_services(load_compose()).items()}
    trainer = k8s_objects(K8S)[("Job", "trainer")]
    k8s_args = [a.replace("$(POD_IP)", "127.0.0.1") for a in container(trainer, "trainer")["args"][1:]]
    lines["k8s"] = k8s_args
    lines["k8s-gpu"] = ["--nproc-per-node=auto", *k8s_args]
    return lines


@pytest.mark.parametrize("recipe", sorted(recipe_up_lines()))
def test_recipe_up_lines_are_accepted_by_the_cli(recipe):
    args = recipe_up_lines()[recipe]
    result = _cli("up", "--dry-run", *args)
    assert result.returncode == 0, result.stderr
    assert f"--rdzv-endpoint={option(args, '--etcd')}" in result.stdout
    assert f"--rdzv-id={option(args, '--job')}" in result.stdout
    assert f"--nnodes={option(args, '--nnodes')}" in result.stdout


def test_a_usage_error_exits_with_the_code_the_k8s_job_fails_at_once_for():
    """The Job's podFailurePolicy fails the whole job on exit code 2 and retries any other failure:
    `up` must exit 2 for a flag value it refuses (here a recovery mode it does not have)."""
    trainer = k8s_objects(K8S)[("Job", "trainer")]
    fail_job = [rule["onExitCodes"]["values"] for rule in trainer["spec"]["podFailurePolicy"]["rules"]
                if rule["action"] == "FailJob"]
    assert fail_job == [[2]]
    args = recipe_up_lines()["k8s"]
    result = _cli("up", "--dry-run", "--recovery=sideways", *args)
    assert result.returncode == 2, result.stderr
    assert "sideways" in result.stderr and "Traceback" not in result.stderr


def test_health_checks_call_status_with_flags_it_has():
    help_text = _cli("status", "--help")
    assert help_text.returncode == 0, help_text.stderr
    probe = container(k8s_objects(K8S)[("Job", "trainer")], "trainer")["readinessProbe"]["exec"]["command"]
    for flag in [a.split("=")[0] for a in probe[2:]] + ["--etcd", "--job"]:
        assert flag in help_text.stdout, f"`elasticctl status` has no {flag}"


# --- Slurm ---------------------------------------------------------------------------------


def test_sbatch_script_syntax_and_directives():
    result = subprocess.run(["bash", "-n", str(SBATCH)], check=False, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    text = SBATCH.read_text()
    header = text.split("\nset ", 1)[0]  # Slurm reads #SBATCH only before the first command
    directives = re.findall(r"^#SBATCH\s+(\S+)", header, flags=re.MULTILINE)
    assert "--requeue" in directives
    assert "--no-kill" in directives, "a node Slurm sets DOWN must not requeue or kill the whole job"
    signal_directive = next(d for d in directives if d.startswith("--signal="))
    match = re.fullmatch(r"--signal=(B:)?(USR1|USR2)@(\d+)", signal_directive)
    # Not TERM: Slurm sends SIGTERM on scancel and at the time limit too, and a cancelled job
    # must not requeue itself.
    assert match and match.group(1) == "B:", "the batch shell must get a warning of its own, to forward it and requeue"
    assert int(match.group(3)) >= 60, "leave time for the final checkpoint"
    assert re.search(r"^\s*trap on_warning " + match.group(2), text, flags=re.MULTILINE), "the warning signal must be trapped"
    assert re.search(r"^\s*trap on_term TERM", text, flags=re.MULTILINE), "SIGTERM must stop the tasks too"
    assert "elasticctl etcd" in text and re.search(r"^\s*srun\b", text, flags=re.MULTILINE)


STUBS = {
    "scontrol": """#!/usr/bin/env bash
if [ "$1 $2" = "show hostnames" ]; then printf 'node1\\nnode2\\n'; exit 0; fi
echo "scontrol $*" >> "$STUB_LOG"
""",
    "scancel": """#!/usr/bin/env bash
echo "scancel $*" >> "$STUB_LOG"
kill -TERM "$(cat "$STUB_STATE/up.pid")"
""",
    # One node's worth: run the task command locally, as srun would on node1.
    "srun": """#!/usr/bin/env bash
echo "srun $*" >> "$STUB_LOG"
while [ "${1#--}" != "$1" ]; do shift; done
SLURMD_NODENAME=node1 exec "$@"
""",
    "elasticctl": """#!/usr/bin/env bash
case "$1" in
etcd)
    echo "etcd is serving at http://node1:2379 (pid $$); Ctrl-C stops it." >&2
    trap 'echo "etcd stopped" >> "$STUB_LOG"; kill $sleeper; exit 0' TERM
    sleep 60 & sleeper=$!; wait $sleeper ;;
up)
    echo "up secret=${#ELASTICCTL_RDZV_SECRET} $*" >> "$STUB_LOG"
    echo $$ > "$STUB_STATE/up.pid"
    [ "$STUB_UP" = finish ] && exit 0
    trap 'echo "up got TERM" >> "$STUB_LOG"; kill $sleeper; exit 0' TERM
    sleep 60 & sleeper=$!; wait $sleeper ;;
esac
""",
}


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    for name, body in STUBS.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "STUB_LOG": str(state / "log"), "STUB_STATE": str(state), "TMPDIR": str(tmp_path),
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "demo", "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_CPUS_PER_TASK": "8",
    }
    env.pop("ELASTICCTL_RDZV_SECRET", None)
    return env, state


def _log(state: Path) -> list[str]:
    path = state / "log"
    return path.read_text().splitlines() if path.exists() else []


def test_sbatch_runs_etcd_then_up_on_every_node_and_cleans_up(fake_slurm, tmp_path):
    env, state = fake_slurm
    env["STUB_UP"] = "finish"
    result = subprocess.run(
        ["bash", str(SBATCH), "trainers/mlp.py", "--steps", "5"], env=env, check=False, capture_output=True, text=True, timeout=30,
    )
    assert result.returncode == 0, result.stderr
    log = _log(state)
    srun = next(line for line in log if line.startswith("srun "))
    assert "--ntasks-per-node=1" in srun and "--no-kill" in srun
    up = shlex.split(next(line for line in log if line.startswith("up ")))
    assert up[1] == "secret=64", "a per-job rendezvous secret reaches every task"
    args = up[3:]
    assert option(args, "--local-addr") == "node1"
    port = 20000 + (4242 % 10000) * 2
    assert option(args, "--etcd") == f"node1:{port}" and option(args, "--job") == "demo"
    assert option(args, "--nnodes") == "1:2"
    assert option(args, "--checkpoint-dir") == str(ROOT / "checkpoints" / "demo")
    assert args[-3:] == ["trainers/mlp.py", "--steps", "5"]
    assert "etcd stopped" in log and not any(line.startswith("scontrol requeue") for line in log)
    assert not list(tmp_path.glob("elasticctl-etcd-*")), "the etcd data directory is removed"


def _signal_once_up_runs(env: dict, state: Path, sig: int) -> tuple[subprocess.Popen, str]:
    script = subprocess.Popen(["bash", str(SBATCH)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not (state / "up.pid").exists():
            assert script.poll() is None, script.communicate()[1]
            assert time.monotonic() < deadline, "elasticctl up never started"
            time.sleep(0.05)
        script.send_signal(sig)
        _, stderr = script.communicate(timeout=20)
    finally:
        if script.poll() is None:
            script.kill()
            script.wait()
    return script, stderr


def test_sbatch_warning_signal_stops_tasks_gracefully_then_requeues(fake_slurm):
    env, state = fake_slurm
    script, stderr = _signal_once_up_runs(env, state, signal.SIGUSR1)  # what --signal=B:USR1@120 does
    assert script.returncode == 0, stderr
    log = _log(state)
    assert "scancel --signal=TERM 4242" in log, "tasks get SIGTERM through scancel, not by cancelling the step"
    order = [line for line in log if line in ("up got TERM", "etcd stopped", "scontrol requeue 4242")]
    assert order == ["up got TERM", "etcd stopped", "scontrol requeue 4242"], log


def test_sbatch_sigterm_stops_tasks_and_never_requeues(fake_slurm):
    env, state = fake_slurm
    _, stderr = _signal_once_up_runs(env, state, signal.SIGTERM)  # what scancel and the time limit send
    log = _log(state)
    assert "up got TERM" in log and "etcd stopped" in log, stderr
    assert not any(line.startswith("scontrol requeue") for line in log), "a cancelled job must stay cancelled"
