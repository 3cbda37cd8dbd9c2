"""A generation's torch process group: built on a fresh store of its own, and torch's
default-group counter reset after a set-up that failed (hot recovery forms generation after
generation in one process; :mod:`elasticctl.train.membership` calls these)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from elasticctl.job.records import Round


def build_generation_group(generation: Round, rank: int, backend: str, timeout: datetime.timedelta,
                           device: torch.device):
    """The default process group of ``generation`` on a fresh store; returns the store.

    Every key lives under ``generation-<number>`` of that generation's own TCPStore (rank 0's
    port from the sealed record), so that nothing of an earlier attempt can meet it.
    """
    store = dist.TCPStore(generation.addrs[0], generation.master_port, world_size=generation.world_size,
                          is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    dist.init_process_group(backend, store=dist.PrefixStore(f"generation-{generation.number}", store),
                            rank=rank, world_size=generation.world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    return store


def reset_group_counter() -> None:
    """Bring torch's default-group counter back to zero after a failed ``init_process_group``.

    torch names the default group after a per-process counter and uses that name as the key
    prefix in the store; ``init_process_group`` raises the counter before it connects, and only
    ``destroy_process_group`` of a formed group resets it. A worker whose set-up failed would
    otherwise wait under ``<generation>/1/`` while its peers wait under ``<generation>/0/``, in
    every later generation. A group of one on a local store, formed and destroyed, resets it.
    """
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.destroy_process_group()
