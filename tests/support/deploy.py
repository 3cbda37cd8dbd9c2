"""The deployment recipes (Dockerfile, compose.yaml, k8s, Slurm) and readers of them."""

from __future__ import annotations

from pathlib import Path

import yaml
from support.helpers import REPO


ROOT = REPO
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
COMPOSE = ROOT / "compose.yaml"
K8S = ROOT / "deploy" / "k8s"
SBATCH = ROOT / "deploy" / "slurm" / "elasticctl.sbatch"


def option(args: list[str], name: str) -> str | None:
    """The value of `--name=value` or `--name value` among args, else None."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def script_of(args: list[str]) -> str:
    """The first argument that is a .py path: the training script of an `up` line."""
    return next(a for a in args if a.endswith(".py"))


def load_compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def trainer_services(compose: dict) -> dict[str, dict]:
    return {name: svc for name, svc in compose["services"].items() if (svc.get("command") or [None])[0] == "up"}


def k8s_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def k8s_objects(directory: Path) -> dict[tuple[str, str], dict]:
    """Every object under a kustomization's resources, keyed by (kind, name)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objects = {}
    for resource in kustomization.get("resources", []):
        target = directory / resource
        if target.is_dir():
            objects.update(k8s_objects(target))
        else:
            for doc in k8s_docs(target):
                objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def container(obj: dict, name: str) -> dict:
    return next(c for c in pod_spec(obj)["containers"] if c["name"] == name)
