"""The roster of a generation: each rank's node name, all-gathered over the generation's control
group when a watch first needs it. What a peer sends is untrusted: bytes that are no node name
leave the roster empty, and the watch that asked names no node in that generation."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from elasticctl.errors import ConfigError
from elasticctl.job.spec import validate_name

log = logging.getLogger(__name__)

NAME_BYTES = 64     # a node id is at most 63 bytes (job.spec.validate_name)


def encode_name(name: str) -> list[int]:
    raw = name.encode()[:NAME_BYTES]
    return list(raw) + [0] * (NAME_BYTES - len(raw))


def decode_name(raw: Sequence[int]) -> str:
    """A peer's node id from its bytes (untrusted): a ConfigError if it is not one."""
    text = bytes(b for b in raw if b).decode(errors="replace")
    return validate_name(text, "node id a peer sent")


def gather_node_names(node: str, world_size: int, group) -> list[str]:
    """Every rank's node name, in rank order, all-gathered over ``group`` (the control channel: CPU
    tensors). What a peer sent is untrusted: a name that is not one raises ConfigError."""
    name = torch.tensor(encode_name(node), dtype=torch.uint8)
    names = [torch.empty_like(name) for _ in range(world_size)]
    dist.all_gather(names, name, group=group)
    return [decode_name(n.tolist()) for n in names]


def rank_nodes_or_empty(node: str, group, control_group, worker: str, without: str) -> list[str]:
    """Every rank's node name (:func:`gather_node_names`), or [] when a peer sent bytes that are no
    name: they are untrusted, so the caller names no node in this generation (``without``: what
    that costs it, for the one warning)."""
    try:
        return gather_node_names(node, group.world_size, control_group)
    except ConfigError as exc:
        log.warning("[%s] %s in generation %d: %s", worker, without, group.number, exc)
        return []
