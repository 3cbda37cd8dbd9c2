"""Static checks of the deployment recipes: Dockerfile, compose.yaml, deploy/k8s, deploy/slurm.

No container engine or cluster runs here, so these tests check what the recipes rely on:
the structure the tools accept (`docker-compose config`, `kubectl kustomize` where
installed) and the fields the guide's walk-throughs (docs/operations.md) depend on. The Slurm
script is run for real against stub `srun`/`scontrol`/`scancel`/`elasticctl` commands.

Layer tests/unit: no etcd, no processes. The other tests of this subject:
tests/process/test_deploy_tools.py, tests/infra/test_slurm.py (the Slurm script on a real Slurm).
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import sys
from pathlib import Path

import click
import kubernetes_validate
import pytest
import yaml
from support.deploy import (
    COMPOSE,
    DOCKERFILE,
    K8S,
    ROOT,
    SBATCH,
    container,
    k8s_docs,
    k8s_objects,
    load_compose,
    option,
    pod_spec,
    script_of,
    trainer_services,
)


RECIPES = [DOCKERFILE, COMPOSE, SBATCH, *sorted(K8S.rglob("*.yaml"))]
OFFICIAL_ETCD_IMAGES = ("gcr.io/etcd-development/etcd:", "quay.io/coreos/etcd:")


# --- helpers -------------------------------------------------------------------------------


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    instructions, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # comment lines inside a continued instruction are ignored by Docker too
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        keyword, _, args = full.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    assert not pending, "the Dockerfile ends inside a continued instruction"
    return instructions


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes; a dir pattern covers its files."""
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if pattern.startswith("**/"):
            hit = any(fnmatch.fnmatchcase(p, pattern[3:]) for p in parts)
        else:
            hit = any(fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes)
        if hit:
            excluded = not negate
    return excluded


def seconds(value) -> float:
    """Compose durations ("90s", "1m30s") or plain numbers, in seconds."""
    if isinstance(value, (int, float)):
        return float(value)
    total = 0.0
    for amount, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", value):
        total += float(amount) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}[unit]
    return total


def size_bytes(value) -> int:
    if isinstance(value, int):
        return value
    amount, unit = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(value).lower()).groups()
    return int(amount) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[unit]


def env_var(cont: dict, name: str) -> dict:
    return next(e for e in cont.get("env", []) if e["name"] == name)


# --- Dockerfile ----------------------------------------------------------------------------


def test_dockerfile_base_is_a_build_argument_and_torch_matches_the_ci_pin():
    instructions = dockerfile_instructions(DOCKERFILE.read_text())
    froms = [args.split() for kw, args in instructions if kw == "FROM"]
    # Two stages on one base: the build stage makes the virtualenv, the final one receives only it.
    assert [f[0] for f in froms] == ["${BASE}", "${BASE}"] and froms[0][1:] == ["AS", "build"], froms
    first_from = next(i for i, (kw, _) in enumerate(instructions) if kw == "FROM")
    base_args = [args for kw, args in instructions[:first_from] if kw == "ARG" and args.startswith("BASE=")]
    assert base_args and "slim" in base_args[0], "the default base must be a slim CPU Python image"
    final_stage = instructions[max(i for i, (kw, _) in enumerate(instructions) if kw == "FROM"):]
    from_build = [a for kw, a in final_stage if kw == "COPY" and a.startswith("--from=")]
    assert from_build == ["--from=build /opt/elasticctl /opt/elasticctl"], "only the virtualenv reaches the image"
    assert not any(kw == "COPY" and "wheelhouse" in a for kw, a in final_stage), "wheels stay in the build stage"

    args = dict(a.split("=", 1) for kw, a in instructions if kw == "ARG" and "=" in a)
    assert args["TORCH_INDEX"].endswith("/whl/cpu"), "CPU torch by default"
    ci_pin = re.search(r"torch==([\w.+]+)", (ROOT / ".ci" / "run").read_text()).group(1)
    assert args["TORCH_VERSION"] == ci_pin, "the image should run the torch the tests ran"
    runs = " ".join(a for kw, a in instructions if kw == "RUN")
    assert 'torch==${TORCH_VERSION}' in runs and '--index-url "${TORCH_INDEX}"' in runs
    # The air-gapped path: WHEELS_ONLY=1 turns every index off for both installs.
    assert args["WHEELS_ONLY"] == "0" and runs.count('if [ "${WHEELS_ONLY}" = 1 ]; then export PIP_NO_INDEX=1; fi') == 2


def test_dockerfile_runs_as_non_root_with_healthcheck_and_elasticctl_entrypoint():
    instructions = dockerfile_instructions(DOCKERFILE.read_text())
    users = [a for kw, a in instructions if kw == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    last_user = max(i for i, (kw, _) in enumerate(instructions) if kw == "USER")
    assert not any(kw == "RUN" for kw, _ in instructions[last_user:]), "RUN after USER would run unprivileged by surprise"

    health = [a for kw, a in instructions if kw == "HEALTHCHECK"]
    assert len(health) == 1 and " CMD " in f" {health[0]} " and "elasticctl status" in health[0]
    # Shell form: the check expands the container's ELASTICCTL_ETCD / ELASTICCTL_JOB itself.
    assert not health[0].split("CMD", 1)[1].strip().startswith("[")

    entrypoints = [a for kw, a in instructions if kw == "ENTRYPOINT"]
    assert len(entrypoints) == 1
    entrypoint = json.loads(entrypoints[0])  # exec form, so SIGTERM reaches the process
    assert entrypoint[-1] == "elasticctl"


def test_dockerfile_copies_only_what_exists_and_is_not_dockerignored():
    instructions = dockerfile_instructions(DOCKERFILE.read_text())
    patterns = [
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = []
    for kw, args in instructions:
        if kw in ("COPY", "ADD"):
            if args.startswith("--from="):
                continue  # a path in an earlier stage, not in the build context
            words = [w for w in shlex.split(args) if not w.startswith("--")]
            sources += words[:-1]
    assert "trainers/" in sources and "elasticctl/" in sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: no such path in the build context"
        assert not dockerignore_excludes(source.rstrip("/"), patterns), f".dockerignore drops {source}"
    # The package build reads README.md and LICENSE (pyproject's readme and license file): they
    # must reach the context.
    assert "README.md" in sources and "LICENSE" in sources
    # And the matcher itself must bite, or the checks above prove nothing.
    assert dockerignore_excludes(".git/config", patterns)
    assert dockerignore_excludes("elasticctl/__pycache__/cli.cpython-311.pyc", patterns)


def test_compose_etcd_is_official_v3_health_checked_on_a_volume_and_not_published():
    compose = load_compose()
    etcd = compose["services"]["etcd"]
    # Selectable (ETCD_IMAGE: one made by deploy/images/etcd-image.sh), the official one by default.
    selectable = re.fullmatch(r"\$\{ETCD_IMAGE:-(.+)\}", etcd["image"])
    assert selectable, etcd["image"]
    default = selectable.group(1)
    assert default.startswith(OFFICIAL_ETCD_IMAGES)
    version = re.search(r":v?(\d+)\.(\d+)", default).groups()
    assert tuple(map(int, version)) >= (3, 5), "etcd 3.5+: v2 API off unless asked for"
    test = etcd["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1].endswith("etcdctl") and test[-2:] == ["endpoint", "health"]
    data_dir = option(etcd["command"], "--data-dir")
    volumes = [v.split(":") for v in etcd["volumes"]]
    assert any(target == data_dir and source in compose["volumes"] for source, target, *_ in volumes)
    assert "ports" not in etcd, "never publish etcd: its writers can run code in every trainer"


def test_compose_trainers_share_checkpoints_shm_restart_and_grace():
    compose = load_compose()
    trainers = trainer_services(compose)
    assert {"trainer", "trainer-gpu"} <= set(trainers)
    jobs = set()
    for name, service in trainers.items():
        command = service["command"]
        assert option(command, "--etcd") == "etcd:2379", name
        low, high = map(int, option(command, "--nnodes").split(":"))
        assert low >= 1 and high >= 3, f"{name}: --scale {name}=3 must fit in --nnodes"
        checkpoint_dir = option(command, "--checkpoint-dir")
        mounts = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}
        assert any(checkpoint_dir == m or checkpoint_dir.startswith(m + "/") for m in mounts), name
        assert all(source in compose["volumes"] for source in mounts.values()), "named volumes, shared by replicas"
        assert (ROOT / script_of(command)).is_file(), f"{name}: the script must be in trainers/ (copied into the image)"
        assert size_bytes(service["shm_size"]) >= 2**30, "DataLoader workers need more than Docker's 64 MB"
        assert service["restart"].startswith("on-failure")
        assert seconds(service["stop_grace_period"]) >= 60, "time for the final checkpoint"
        assert service["build"]["dockerfile"] == "deploy/Dockerfile"
        # The variables that pick images without a registry default to the Dockerfile's own defaults.
        defaults = dict(a.split("=", 1) for kw, a in dockerfile_instructions(DOCKERFILE.read_text())
                        if kw == "ARG" and "=" in a)
        for arg, variable in (("BASE", "BASE_IMAGE"), ("TORCH_VERSION", "TORCH_VERSION"), ("WHEELS_ONLY", "WHEELS_ONLY")):
            assert service["build"]["args"][arg] == f"${{{variable}:-{defaults[arg]}}}", (name, arg)
        assert "container_name" not in service, "a fixed container name forbids --scale"
        env = service["environment"]
        assert env["ELASTICCTL_ETCD"] == option(command, "--etcd") and env["ELASTICCTL_JOB"] == option(command, "--job")
        jobs.add(option(command, "--job"))
    assert len(jobs) == len(trainers), "CPU and GPU services differ in spec, so they need different job names"


def test_compose_gpu_profile_reserves_nvidia_devices():
    compose = load_compose()
    gpu = [s for s in compose["services"].values() if "gpu" in s.get("profiles", [])]
    assert len(gpu) == 1 and "profiles" not in compose["services"]["trainer"]
    service = gpu[0]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert option(service["command"], "--nproc-per-node") == "auto"
    assert "cu" in service["build"]["args"]["TORCH_INDEX"].rsplit("/", 1)[-1]


def _strings(node):
    """Every key and scalar of a parsed YAML tree, as text."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield str(key)
            yield from _strings(value)
    elif isinstance(node, list):
        for item in node:
            yield from _strings(item)
    elif node is not None:
        yield str(node)


def test_no_recipe_turns_on_the_etcd_v2_api():
    """What the recipes execute (not their comments) never enables etcd's v2 API."""
    for path in RECIPES:
        if path.suffix == ".yaml":
            texts = [s for doc in yaml.safe_load_all(path.read_text()) for s in _strings(doc)]
        else:
            texts = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
        assert texts, path
        for text in texts:
            assert not re.search(r"enable[-_]v2", text, flags=re.IGNORECASE), f"{path}: {text}"


# --- Kubernetes ----------------------------------------------------------------------------


def kustomization_dirs() -> list[Path]:
    return sorted(p.parent for p in K8S.rglob("kustomization.yaml"))


def test_k8s_yaml_parses_and_kustomizations_reference_every_file():
    dirs = kustomization_dirs()
    assert {K8S, K8S / "base", K8S / "gpu"} <= set(dirs)
    for path in K8S.rglob("*.yaml"):
        for doc in k8s_docs(path):
            assert doc.get("apiVersion") and doc.get("kind"), path
    for directory in dirs:
        kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
        referenced = set()
        for resource in kustomization.get("resources", []):
            assert (directory / resource).exists(), f"{directory}: missing resource {resource}"
            referenced.add((directory / resource).resolve())
        for patch in kustomization.get("patches", []):
            if "path" in patch:
                assert (directory / patch["path"]).is_file(), f"{directory}: missing patch {patch['path']}"
                referenced.add((directory / patch["path"]).resolve())
        for path in directory.glob("*.yaml"):
            if path.name != "kustomization.yaml":
                assert path.resolve() in referenced, f"{path} is not used by {directory}/kustomization.yaml"


def test_k8s_etcd_statefulset_service_and_probes():
    objects = k8s_objects(K8S)
    service, etcd = objects[("Service", "etcd")], objects[("StatefulSet", "etcd")]
    assert etcd["spec"]["serviceName"] == "etcd" and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= etcd["spec"]["template"]["metadata"]["labels"].items()
    cont = container(etcd, "etcd")
    assert cont["image"].startswith(OFFICIAL_ETCD_IMAGES)
    assert pod_spec(etcd)["enableServiceLinks"] is False, "ETCD_* service variables would configure etcd"
    data_dir = option(cont["args"], "--data-dir")
    assert any(data_dir.startswith(m["mountPath"]) for m in cont["volumeMounts"])
    assert etcd["spec"]["volumeClaimTemplates"], "etcd data must outlive the pod"
    metrics = option(cont["args"], "--listen-metrics-urls")
    ports = {p["name"]: p["containerPort"] for p in cont["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        get = cont[probe]["httpGet"]
        assert get["path"].startswith("/health")
        assert metrics.endswith(f":{ports[get['port']]}"), "probes must hit the port etcd serves /health on"


def test_k8s_trainer_is_scalable_with_grace_pod_ip_pvc_shm_and_readiness():
    objects = k8s_objects(K8S)
    trainer = objects[("Job", "trainer")]
    spec = pod_spec(trainer)
    # An elastic Indexed Job resizes by changing both counts together, within --nnodes MIN:MAX.
    nodes = trainer["spec"]["completions"]
    assert isinstance(nodes, int) and trainer["spec"]["parallelism"] == nodes
    low, high = map(int, option(container(trainer, "trainer")["args"], "--nnodes").split(":"))
    assert low <= nodes <= high
    assert spec["terminationGracePeriodSeconds"] >= 60
    assert spec["securityContext"]["runAsNonRoot"] is True and "fsGroup" in spec["securityContext"]
    cont = container(trainer, "trainer")
    args = cont["args"]
    assert args[0] == "up"
    assert env_var(cont, "POD_IP")["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert option(args, "--local-addr") == "$(POD_IP)"
    host, port = option(args, "--etcd").split(":")
    assert ("Service", host) in objects
    assert int(port) in [p["port"] for p in objects[("Service", host)]["spec"]["ports"]]
    assert (ROOT / script_of(args)).is_file()
    assert "readinessProbe" in cont and "elasticctl" in cont["readinessProbe"]["exec"]["command"]
    assert cont["resources"]["requests"]["cpu"] and cont["resources"]["requests"]["memory"]
    assert "cpu" not in cont["resources"].get("limits", {}), "CPU throttling starves rendezvous heartbeats"
    # Secrets come from a Secret, never from args (visible in `ps` and the manifest).
    assert env_var(cont, "ELASTICCTL_ETCD_PASSWORD")["valueFrom"]["secretKeyRef"]["optional"] is True
    assert not any("password" in a for a in args)

    mounts = {m["name"]: m["mountPath"] for m in cont["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    checkpoint_dir = option(args, "--checkpoint-dir")
    claim = next(
        volumes[name]["persistentVolumeClaim"]["claimName"]
        for name, path in mounts.items() if checkpoint_dir.startswith(path) and "persistentVolumeClaim" in volumes[name]
    )
    pvc = objects[("PersistentVolumeClaim", claim)]
    assert "ReadWriteMany" in pvc["spec"]["accessModes"], "every trainer pod, on any node, mounts it"
    shm = next(name for name, path in mounts.items() if path == "/dev/shm")
    assert volumes[shm]["emptyDir"]["medium"] == "Memory"


# The oldest Kubernetes the trainer Job is written for (backoffLimitPerIndex is GA from 1.33), and
# the newest whose schemas the kubernetes-validate package ships.
K8S_VERSIONS = ("1.33", kubernetes_validate.latest_version())


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", sorted(p.relative_to(K8S).as_posix() for p in K8S.rglob("*.yaml")
                                        if p.name != "kustomization.yaml"))
def test_k8s_manifests_match_the_kubernetes_schemas(path, version):
    """Strict: a misspelt or misplaced field fails, as `kubectl apply --validate=strict` would.
    (tests/process/test_deploy_tools.py validates what kustomize renders from them too.)"""
    for doc in k8s_docs(K8S / path):
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path}: {doc['kind']}/{doc['metadata']['name']} at {'.'.join(map(str, exc.path))}: "
                        f"{exc.message}")


def job_controller_verdict(job: dict, exit_code: int, conditions: tuple[str, ...] = ()) -> str:
    """What the Job controller does with a pod of ``job`` whose trainer exited with ``exit_code``:
    its podFailurePolicy read as Kubernetes reads it (the first matching rule wins; no match
    counts against the index's retries; a pod that exited 0 Succeeded and is never judged)."""
    if exit_code == 0:
        return "index complete"
    for rule in job["spec"]["podFailurePolicy"]["rules"]:
        codes = rule.get("onExitCodes")
        if codes is not None:
            if codes.get("containerName", "trainer") != "trainer":
                continue
            listed = exit_code in codes["values"]
            if listed == (codes["operator"] == "In"):
                return rule["action"]
        elif any(c["type"] in conditions and c.get("status", "True") == "True" for c in rule["onPodConditions"]):
            return rule["action"]
    return "Count"


@pytest.mark.parametrize(("what", "exit_code", "conditions", "verdict"), [
    # elasticctl/node.py: a finished job, `down`, `leave` and SIGTERM all end the node with 0.
    ("training finished or elasticctl down", 0, (), "index complete"),
    ("elasticctl leave", 0, (), "index complete"),
    ("drained or evicted, left within the grace period", 0, ("DisruptionTarget",), "index complete"),
    # click's usage errors (elasticctl.cli.main keeps their code): every pod would fail alike.
    ("usage error", click.UsageError("").exit_code, (), "FailJob"),
    ("its workers failed past --max-restarts, or etcd out of reach", 1, (), "Count"),
    ("OOM-killed", 137, (), "Count"),
    ("its node lost, preempted, or killed past the grace period", 137, ("DisruptionTarget",), "Ignore"),
])
def test_k8s_trainer_job_never_restarts_a_node_that_finished_or_left(what, exit_code, conditions, verdict):
    trainer = k8s_objects(K8S)[("Job", "trainer")]
    assert job_controller_verdict(trainer, exit_code, conditions) == verdict, what


def test_k8s_trainer_job_retries_a_failed_index_alone_and_replaces_only_stopped_pods():
    trainer = k8s_objects(K8S)[("Job", "trainer")]
    spec = trainer["spec"]
    # Indexed, with retries per index: one node that keeps failing does not end the others.
    assert spec["completionMode"] == "Indexed" and spec["backoffLimitPerIndex"] >= 1
    assert spec.get("maxFailedIndexes") is None, "a node failed for good leaves the others training"
    # A replacement only once the old pod stopped: never more pods than --nnodes MAX.
    assert spec["podReplacementPolicy"] == "Failed"
    # The kubelet restarting the container in place would bypass the failure policy.
    assert pod_spec(trainer)["restartPolicy"] == "Never"
    assert ("Deployment", "trainer") not in k8s_objects(K8S), "a Deployment restarts a pod that exited 0"


def test_k8s_etcd_network_policy_admits_the_trainer_pods():
    objects = k8s_objects(K8S)
    policy = objects[("NetworkPolicy", "etcd")]
    etcd_labels = objects[("StatefulSet", "etcd")]["spec"]["template"]["metadata"]["labels"]
    trainer = objects[("Job", "trainer")]
    trainer_labels = trainer["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= etcd_labels.items()
    client_rules = [r for r in policy["spec"]["ingress"] if {"port": 2379} in r.get("ports", [])]
    assert any(
        peer["podSelector"]["matchLabels"].items() <= trainer_labels.items()
        for rule in client_rules for peer in rule.get("from", [])
    ), "the policy would cut the trainers off from etcd"


def test_k8s_gpu_variant_requests_nvidia_gpus():
    patch = k8s_docs(K8S / "gpu" / "trainer-gpu.yaml")[0]
    resources = container(patch, "trainer")["resources"]
    assert resources["limits"]["nvidia.com/gpu"] >= 1
    assert resources["requests"].get("nvidia.com/gpu", resources["limits"]["nvidia.com/gpu"]) == resources["limits"]["nvidia.com/gpu"]
    base = yaml.safe_dump(k8s_objects(K8S / "base"))
    assert "nvidia.com/gpu" not in base, "the CPU base must schedule on nodes without GPUs"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
