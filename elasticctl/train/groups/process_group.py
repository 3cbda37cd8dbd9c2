"""A generation's torch process groups: the training group, built on a fresh store of its own;
the group the runtime's own per-step collectives run on (:func:`control_channel`, a pure
decision, and :func:`build_control_group`); and torch's default-group counter reset after a
set-up that failed (hot recovery forms generation after generation in one process; the
runtime calls these as it forms each one). Where the worker keeps one group for its life,
:func:`reconfigure_generation_group` re-forms it over each generation instead
(:mod:`elasticctl.train.groups.reconfigure`)."""

from __future__ import annotations

import datetime
import enum
import logging
import socket
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from elasticctl.job.records import Round
from elasticctl.train import entry as worker_entry
from elasticctl.train.groups.reconfigure import ReconfigurableGroup, handles_of, mesh_handles_of

log = logging.getLogger(__name__)


def build_generation_group(generation: Round, rank: int, backend: str, timeout: datetime.timedelta,
                           device: torch.device):
    """The default process group of ``generation`` on a fresh store; returns the store.

    Every key lives under ``generation-<number>`` of that generation's own TCPStore (rank 0's
    port from the sealed record), so that nothing of an earlier attempt can meet it.
    """
    store = generation_store(generation, rank, timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"generation-{generation.number}", store),
                            rank=rank, world_size=generation.world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    worker_entry.note_joined()
    return store


def reconfigure_generation_group(group: ReconfigurableGroup | None, generation: Round, rank: int, backend: str,
                                 timeout: datetime.timedelta, *, mesh_rows: list[list[int]] | None = None
                                 ) -> tuple[ReconfigurableGroup, dist.TCPStore]:
    """This worker's one group (made now if it has none) re-formed in place over ``generation``;
    returns it and the generation's store, kept alive with it. ``mesh_rows``: the generation's HSDP
    layout (elasticctl.train.sharding.shards.hsdp_layout), over which the group's two mesh groups are
    re-formed too (made with it, if it is made now)."""
    store = generation_store(generation, rank, timeout)
    if group is None:
        group = ReconfigurableGroup(backend, timeout, with_mesh=mesh_rows is not None)
    prefixed = dist.PrefixStore(f"generation-{generation.number}", store)
    group.reconfigure(generation.number, handles_of(prefixed, rank, generation.world_size, group.handle), prefixed)
    if mesh_rows is not None and group.mesh_groups is not None:
        mesh = group.mesh_groups
        mesh.reconfigure(generation.number, mesh_rows, rank,
                         mesh_handles_of(prefixed, rank, generation.world_size, mesh.handles()), prefixed)
    worker_entry.note_joined()
    return group, store


def generation_store(generation: Round, rank: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """``generation``'s own store: a TCPStore on its rank 0's port from the sealed record.

    Every member learns the generation at the same moment, so a member often reaches the store
    before rank 0 listens. A TCPStore client refused then sleeps a backoff of its own (0.3 s, then
    0.4 s more, measured with torch 2.14), which every re-formation paid once in two: a member
    other than rank 0 first waits, polling, until the port listens (:func:`wait_until_listening`)."""
    host, port = generation.addrs[0], generation.master_port
    if rank != 0 and not wait_until_listening(host, port, timeout.total_seconds()):
        raise TimeoutError(f"The store of generation {generation.number} at {host}:{port} (its rank 0) did not "
                           f"listen within {timeout.total_seconds():g} s.")
    return dist.TCPStore(host, port, world_size=generation.world_size, is_master=rank == 0, timeout=timeout,
                         wait_for_workers=False)


LISTEN_POLL_S = 0.002  # a refused connect on a live host costs microseconds: poll briskly


def wait_until_listening(host: str, port: int, timeout: float, *, clock: Callable[[], float] = time.monotonic,
                         sleep: Callable[[float], object] = time.sleep,
                         connect: Callable[..., socket.socket] = socket.create_connection) -> bool:
    """Whether something accepts connections at ``host:port`` within ``timeout`` seconds (polled;
    each attempt bounded by what is left, so an unreachable host costs at most ``timeout``).
    ``clock``, ``sleep`` and ``connect`` are injectable so that a test can check that bound on a
    clock of its own."""
    deadline = clock() + timeout
    while True:
        left = deadline - clock()
        try:
            with connect((host, port), timeout=max(0.05, min(1.0, left))):
                return True
        except OSError:
            if left <= 0:
                return False
            sleep(LISTEN_POLL_S)


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


class ControlChannel(enum.Enum):
    """Which group carries the runtime's own collectives of every step boundary (the two flags,
    the straggler exchange), always on CPU tensors."""

    TRAINING_GROUP = "the training group"    # its backend runs CPU tensors on gloo: no second group
    GLOO_SIDE_GROUP = "a gloo side group"    # a CPU gloo group over the same ranks, one per generation


def control_channel(backend: str) -> ControlChannel:
    """Where the boundary flags and the straggler exchange go, for a training group on ``backend``
    (as ``init_process_group`` takes it: ``"nccl"``, ``"gloo"``, ``"cpu:gloo,cuda:nccl"``...).

    Why not the training group whatever it is: on NCCL its tensors live on the GPU, and reading
    a flag there (``.tolist()``) waits for the device to finish the step's queued work, every
    step, for elasticctl's sake alone. CPU tensors on gloo are read without touching the device,
    and gloo runs an asynchronous collective on threads of its own, so the hot-mode flags still
    travel while the next step computes. A training group whose CPU backend already is gloo
    carries them at no extra cost, whatever device the model is on (the flags are CPU tensors
    either way); any other backend gets a gloo side group. Only gloo is trusted for this: MPI
    or UCC carry CPU tensors too, but how an asynchronous collective progresses there depends
    on the build.
    """
    cpu_backend = dist.BackendConfig(backend).get_device_backend_map().get("cpu")
    return ControlChannel.TRAINING_GROUP if cpu_backend == dist.Backend.GLOO else ControlChannel.GLOO_SIDE_GROUP


def build_control_group(backend: str, timeout: datetime.timedelta):
    """The current generation's group for the runtime's boundary collectives: a CPU gloo group over
    every rank of the training group just formed (a collective: every rank calls it, right after
    that group), or None where :func:`control_channel` keeps them on the training group (torch's
    ``group=None``). Destroying the training group (``destroy_process_group()``) takes it down too.
    """
    if control_channel(backend) is ControlChannel.TRAINING_GROUP:
        return None
    return dist.new_group(backend=dist.Backend.GLOO, timeout=timeout, group_desc="elasticctl boundary")
