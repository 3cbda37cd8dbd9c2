"""compose.yaml run for real: a Docker engine, images made without a registry, 3 trainer containers.

What a user of the local cluster does, checked from the trainers' records and `elasticctl status`:
world 3; `docker kill` of one -> the others go on at world 2 without spending a restart (hot mode:
in the same processes); `docker stop` of one -> it exits 0 (restart mode: after a final checkpoint
the other resumes from; hot mode: the state lives on in the other's process); starting both again
-> world 3; stopping the job -> every trainer exits 0 and the last step is in a final checkpoint; `down -v` leaves
no container, network or volume. Both Compose spellings run it when both are installed (v2
`docker compose`, v1 `docker-compose`).

Skipped, saying why, where no engine can be reached or started (`.ci/run` installs docker.io and
mmdebstrap). The first run on a machine builds the images (about three minutes); Docker keeps them.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

from support import docker
from support.helpers import REPO, read_records, wait_for

COMPOSE = REPO / "compose.yaml"
START_TIMEOUT = 240  # three containers import torch at once on a 2-core machine
CHANGE_TIMEOUT = 120


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    try:
        engine = docker.start_engine(tmp_path_factory.mktemp("dockerd"))
    except docker.Unavailable as reason:
        pytest.skip(str(reason))
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def torch_version(engine) -> str:
    try:
        docker.ensure_base_images(engine)
    except docker.Unavailable as reason:
        pytest.skip(str(reason))
    version = docker.image_torch_version()
    docker.build_image(engine, version)
    return version


def test_image_builds_from_a_wheelhouse_and_keeps_no_build_leftovers(engine, torch_version):
    details = docker.inspect(engine, docker.IMAGE)
    assert details["Config"]["User"] == "elasticctl"
    assert details["Config"]["Entrypoint"] == ["tini", "--", "elasticctl"]
    # As root, so that nothing is hidden by permissions; no network: the image needs none to start.
    probe = engine.run("run", "--rm", "--network", "none", "--user", "root", "--entrypoint", "sh", docker.IMAGE,
                       "-c", "elasticctl --version > /dev/null && python3 -c 'import torch; print(torch.__version__)'"
                       " && for p in /wheels /src /root/.cache/pip; do [ ! -e $p ] || echo leftover:$p; done")
    assert probe.stdout.split() == [torch_version], "the wheelhouse, the sources or pip's cache reached the image"
    print(f"image {docker.IMAGE}: {details['Size'] / 2**20:.0f} MiB with torch {torch_version}")


class Cluster:
    """One compose project: compose.yaml's own trainer command, plus a --record on the shared volume."""

    def __init__(self, engine: docker.Engine, compose: list[str], torch_version: str, recovery: str,
                 directory: Path) -> None:
        self.engine = engine
        self.project = f"elasticctl-test-{recovery}-{uuid.uuid4().hex[:6]}"
        services = yaml.safe_load(COMPOSE.read_text())["services"]
        # The job runs far longer than the test (compose.yaml's own --steps): the events end it.
        command = [*services["trainer"]["command"], "--record=/checkpoints/records.jsonl", "--log-every=0"]
        override = directory / "override.yaml"
        override.write_text(yaml.safe_dump({"services": {"trainer": {"command": command}}}))
        self.compose = [*compose, "-p", self.project, "-f", str(COMPOSE), "-f", str(override)]
        self.env = {**engine.env, **docker.image_variables(torch_version), "ELASTICCTL_RECOVERY": recovery}

    def __call__(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        result = subprocess.run([*self.compose, *args], env=self.env, cwd=REPO, capture_output=True, text=True,
                                timeout=timeout, check=False)
        assert result.returncode == 0, f"{' '.join(args)}: {result.stdout[-2000:]}{result.stderr[-2000:]}"
        return result

    def trainers(self) -> list[str]:
        return sorted(self("ps", "-q", "trainer").stdout.split())

    def records(self) -> list[dict]:
        volume = docker.inspect_volume(self.engine, f"{self.project}_checkpoints")
        return read_records(Path(volume["Mountpoint"]) / "records.jsonl")

    def steps_after(self, since: float) -> list[dict]:
        return [r for r in self.records() if "step" in r and "event" not in r and r["time"] > since]

    def world_of(self, hosts: set[str], world: int, since: float) -> list[dict] | None:
        """Step lines of ``world`` written after ``since`` by every one of ``hosts``, if all wrote one."""
        lines = [r for r in self.steps_after(since) if r["world_size"] == world and r["host"] in hosts]
        return lines if {r["host"] for r in lines} == hosts else None

    def status(self, container: str) -> dict:
        result = self.engine.run("exec", container, "elasticctl", "status", "--etcd", "etcd:2379", "--job", "demo",
                                 "--json")
        return json.loads(result.stdout)


def hostname(engine: docker.Engine, container: str) -> str:
    return docker.inspect(engine, container)["Config"]["Hostname"]


@pytest.mark.parametrize("recovery", ["restart", "hot"])
def test_compose_cluster_loses_a_node_then_one_leaves_then_both_return(engine, torch_version, recovery,
                                                                        tmp_path):
    # Both spellings when both exist: restart mode runs on the first, hot mode on the second.
    compose = engine.spellings[["restart", "hot"].index(recovery) % len(engine.spellings)]
    cluster = Cluster(engine, compose, torch_version, recovery, tmp_path)
    started = time.time()
    try:
        cluster("up", "-d", "--no-build", "--scale", "trainer=3")
        trainers = cluster.trainers()
        assert len(trainers) == 3
        hosts = {container: hostname(engine, container) for container in trainers}
        everyone = set(hosts.values())
        wait_for(lambda: cluster.world_of(everyone, 3, started), START_TIMEOUT, "world 3 in all three trainers")
        status = cluster.status(trainers[0])
        assert status["world_size"] == 3, status

        lost, leaver, stayer = trainers
        before = cluster.world_of({hosts[leaver], hosts[stayer]}, 3, started)
        killed = time.time()
        engine.run("kill", lost)
        after = wait_for(lambda: cluster.world_of({hosts[leaver], hosts[stayer]}, 2, killed), CHANGE_TIMEOUT,
                         "world 2 after docker kill")
        assert {r["restart"] for r in after} == {0}, "a lost peer spent one of the survivors' restarts"
        if recovery == "hot":  # survivors kept their worker processes
            assert {r["pid"] for r in after} <= {r["pid"] for r in before}

        stopped = time.time()
        engine.run("stop", "--time", "90", leaver, timeout=150)
        state = docker.wait_exited(engine, leaver, 150)
        assert state["ExitCode"] == 0, state
        alone = wait_for(lambda: cluster.world_of({hosts[stayer]}, 1, stopped), CHANGE_TIMEOUT,
                         "world 1 after docker stop")
        if recovery == "restart":  # every rank saves the same final checkpoint; the stayer resumes from it
            final = [r for r in cluster.records() if r.get("event") == "final_checkpoint" and r["time"] > stopped]
            assert final and min(r["step"] for r in alone) >= final[-1]["step"], final
            resumable = final[-1]["step"]
        else:  # the state lives on in the stayer's own process: no checkpoint needed, no step re-done
            assert {r["pid"] for r in alone} <= {r["pid"] for r in after}
            assert min(r["step"] for r in alone) > max(r["step"] for r in after if r["host"] == hosts[stayer])
            resumable = max(r["step"] for r in alone) + 1

        restarted = time.time()
        engine.run("start", lost, leaver)
        back = wait_for(lambda: cluster.world_of(everyone, 3, restarted), START_TIMEOUT, "world 3 after docker start")
        # Restart mode may re-do the steps since its newest checkpoint; hot mode re-does none.
        assert min(r["step"] for r in back) >= resumable, "the job went back after the rejoin"

        # The whole job stops (compose stop: SIGTERM to every trainer, not all at the same instant):
        # every trainer exits 0, and the last step trained is in a final checkpoint. (Hot mode: a
        # trainer whose SIGTERM comes first may leave alone, its state living on in the others;
        # the last to stop write the job's final checkpoint. Restart mode: every stop writes one.)
        ended = time.time()
        cluster("stop", "--timeout", "90", "trainer", timeout=300)
        assert [docker.inspect(engine, c)["State"]["ExitCode"] for c in trainers] == [0, 0, 0]
        final = [r for r in cluster.records() if r.get("event") == "final_checkpoint" and r["time"] > ended]
        last_trained = max(r["step"] for r in cluster.steps_after(restarted))
        assert final and max(r["step"] for r in final) == last_trained + 1, (last_trained, final)
    finally:
        down = subprocess.run([*cluster.compose, "down", "-v", "--remove-orphans", "--timeout", "30"],
                              env=cluster.env, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert down.returncode == 0, down.stderr[-2000:]
    assert docker.project_resources(engine, cluster.project) == {"containers": [], "networks": [], "volumes": []}
