"""What a job is: the settings every node of it shares, validated into whole-sentence errors."""

from __future__ import annotations

import dataclasses
import re

from elasticctl.errors import ConfigError

_JOB_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def parse_nnodes(text: str) -> tuple[int, int]:
    """Parse ``"N"`` or ``"MIN:MAX"`` into (min, max)."""
    parts = str(text).split(":")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise ConfigError(f"The node count '{text}' must be N or MIN:MAX with whole numbers, e.g. 1:4.")
    low, high = int(parts[0]), int(parts[-1])
    if low < 1:
        raise ConfigError(f"The minimum number of nodes ({low}) in '{text}' must be at least 1.")
    if high < low:
        raise ConfigError(f"The maximum number of nodes ({high}) in '{text}' must not be below the minimum ({low}).")
    return low, high


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """Parse torchrun's ``k1=v1,k2=v2`` rendezvous options."""
    conf: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"The rendezvous option '{item}' must be of the form key=value.")
        conf[key.strip()] = value.strip()
    return conf


def validate_job_name(name: str) -> str:
    if not _JOB_NAME_RE.match(name):
        raise ConfigError(
            f"The job name '{name}' must be 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit."
        )
    return name


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """Everything a node needs to launch its part of the job; identical on every node."""

    name: str
    script: str
    script_args: tuple[str, ...] = ()
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: str = "1"
    max_restarts: int = 3
    rdzv_conf: tuple[tuple[str, str], ...] = ()
    checkpoint_dir: str | None = None
    module: bool = False

    def __post_init__(self) -> None:
        validate_job_name(self.name)
        if self.nproc_per_node != "auto" and not (self.nproc_per_node.isdigit() and int(self.nproc_per_node) > 0):
            raise ConfigError(
                f"The processes per node '{self.nproc_per_node}' must be a positive whole number or 'auto'."
            )
        if self.max_restarts < 0:
            raise ConfigError(f"The maximum number of restarts ({self.max_restarts}) must not be negative.")

    @property
    def nnodes(self) -> str:
        return str(self.min_nodes) if self.min_nodes == self.max_nodes else f"{self.min_nodes}:{self.max_nodes}"
