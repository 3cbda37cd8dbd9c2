"""One generation of workers as the training function sees it (:class:`Group`).

Its own module, below the runtime and the modules the runtime uses (the membership, the sharded
model), so that they can name it without importing the runtime.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class Group:
    """One generation as the training function sees it."""

    number: int
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    model: torch.nn.Module  # the state's model, wrapped in DDP over this generation's group (or sharded)
    members: tuple[str, ...] = ()  # hot mode: the workers <node>.<local rank> in rank order
    local_world_size: int = 1  # workers per node (LOCAL_WORLD_SIZE): an HSDP mesh's shard count
    shard: int | None = None  # run(..., sharded=True): the index of the shard this worker holds
    # The collectives' timeout (the node TTL unless pg_timeout says otherwise): the groups of a mesh
    # built for this generation take it too, else a frozen peer stalls them for torch's 30 minutes.
    timeout: datetime.timedelta | None = None
    # run(..., sharded="hsdp") where groups are reconfigured in place: the worker's two mesh groups
    # (elasticctl.train.groups.reconfigure.MeshGroups), kept for its whole life; hsdp_mesh makes its mesh of them.
    mesh_groups: Any = None
