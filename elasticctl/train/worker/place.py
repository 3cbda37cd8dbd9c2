"""Where a worker runs: fixed for its life, decided once from its environment."""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch

from elasticctl.job.environment import WorkerEnvironment
from elasticctl.job.options import RecoveryMode
from elasticctl.train.script import local_device


@dataclasses.dataclass(frozen=True)
class WorkerPlace:
    """Where a worker runs: its name (``node.local_rank``), its device and its groups' backend and
    timeout."""

    worker: str
    node: str
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    pg_timeout: datetime.timedelta

    @property
    def transport(self) -> torch.device:
        """Where the tensors of the runtime's collectives on the training group live (the state
        sync and transfer, the final checkpoint's agreement): the GPU under NCCL, else the CPU."""
        return self.device if self.backend == "nccl" else torch.device("cpu")


def worker_place(environment: WorkerEnvironment, backend: str | None, pg_timeout: float | None) -> WorkerPlace:
    """This worker's place: its device from LOCAL_RANK (a GPU where there is one, with NCCL),
    its groups' timeout (hot mode: the node TTL, so that a frozen peer costs about the TTL)."""
    local_rank, device, default_backend = local_device()
    settings = environment.settings  # the worker settings, None outside elasticctl's handler
    hot = environment.recovery is RecoveryMode.HOT
    default_timeout = (settings.hot.node_ttl if hot else None) or 60.0
    node = environment.node or "local"
    return WorkerPlace(worker=f"{node}.{local_rank}", node=node, local_rank=local_rank,
                       local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), device=device,
                       backend=backend or default_backend,
                       pg_timeout=datetime.timedelta(seconds=pg_timeout or default_timeout))
