"""The roster of a generation: each rank's node name, all-gathered over the generation's control
group once, when a watch first needs it (every rank runs the same watches at the same
boundaries, so the first to ask is the same on every rank), and shared by the watches after that.
What a peer sends is untrusted: bytes that are no node name leave the roster empty, and each
watch that asks names no node in that generation, saying so once."""

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


class Roster:
    """Worker ``worker`` (of node ``node``)'s roster, one per generation."""

    def __init__(self, node: str, worker: str) -> None:
        self.node = node
        self.worker = worker
        self._gathered: tuple[int, list[str] | ConfigError] | None = None  # (generation, names or why none)

    def forget(self) -> None:
        """A new generation: its roster is gathered anew."""
        self._gathered = None

    def nodes(self, group, control_group, without: str) -> list[str]:
        """Every rank's node name in ``group``'s generation, or [] when a peer sent bytes that are no
        name (``without``: what that costs the asking watch, for its warning)."""
        if self._gathered is None or self._gathered[0] != group.number:
            try:
                found: list[str] | ConfigError = gather_node_names(self.node, group.world_size, control_group)
            except ConfigError as exc:
                found = exc
            self._gathered = (group.number, found)
        found = self._gathered[1]
        if isinstance(found, ConfigError):
            log.warning("[%s] %s in generation %d: %s", self.worker, without, group.number, found)
            return []
        return found
