"""Moving a training state between the members of a generation: tensor by tensor, in bounded buckets.

When a generation forms and its members' steps differ, the members that hold the newest state
(:mod:`elasticctl.train.recovery.from_replicas`: its ``sources``, the lead first) send it to the
others, never as one whole-state blob:

1. The lead describes its state (:func:`describe`, in the one description format of
   :mod:`elasticctl.train.state_transfer.description`): its ``state_dict`` with each tensor replaced by ``None``,
   each tensor listed with its path, dtype and shape, and the lead's bucket size. The
   description (step, fields, the optimizer's hyperparameters, the sampler's position:
   everything but the tensors' values) is broadcast to every member and read with
   ``weights_only=True`` (:func:`parse_description`): a peer can send wrong numbers, never code.
2. Every other member checks the description against its own state before anything is copied
   (:func:`elasticctl.train.state_transfer.description.check_description`, pure): another sender must hold
   exactly these tensors; a receiver's model must have exactly these tensors, shapes and dtypes,
   and whatever else it lacks (a joiner's fresh optimizer has no state yet) it allocates, up to
   ``ALLOCATION_FACTOR`` times its model's bytes. What does not fit is a :class:`StateError`
   naming it, raised on that member only (its peers are told, and carry on without it).
3. The members tell each other whether they are ready (an all-gather of one flag). The tensors
   then go in buckets of at most ``bucket_bytes`` (:func:`elasticctl.train.state_transfer.buckets.plan_buckets`:
   a tensor of 1 MiB or more alone, smaller ones packed),
   dealt round-robin over the senders that are ready, point to point from a bucket's owner to
   each receiver, so that a holder never receives what it already holds and the senders send at
   the same time, several buckets in flight. A bucket that is one piece of one tensor goes out of,
   and comes into, that tensor itself; a bucket of several small tensors is packed into one flat
   buffer. A sender holds at most one bucket besides its state, a receiver one per sender.
4. A receiver loads the state dict rebuilt from the description and its own tensors, now filled
   (``load_state_dict`` of a tensor onto itself copies nothing).

The members are those of the current process group, or of any group the caller names: a sharded
state (:mod:`elasticctl.train.sharding.shards`) moves each shard index over the mesh's replicate group, as
local shards (the state dict of :class:`elasticctl.train.sharding.shards.LocalShards`), all groups at once.

Limits: a tensor that is not contiguous (state tensors are, in practice) is copied whole on the
sender for each of its buckets, and received into a new tensor that ``load_state_dict`` copies
in. Several senders are only ever members that trained together at one step (replicas, bit-identical),
so which of them sends a bucket does not matter; a tensor the script keeps per rank in ``fields``
comes from one of them, as it came from the one sender before.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from elasticctl.train.state_transfer.buckets import Bucket, bucket_owners, plan_buckets
from elasticctl.train.state_transfer.description import (
    DESCRIPTION_MAX_BYTES,
    DTYPE_NAMES,
    DTYPES,
    MAX_BUCKET_BYTES,
    MIN_BUCKET_BYTES,
    Own,
    TensorSpec,
    allocation_limit,
    check_description,
    describe_state,
    flatten,
    read_description,
    rebuild,
)
from elasticctl.train.state import State, StateError

DEFAULT_BUCKET_BYTES = 64 * 2**20
# Tensors from this size travel alone, out of and into themselves: packing them would cost a copy
# on each side for no fewer messages worth counting (a message costs tens of microseconds).
PACK_BELOW_BYTES = 2**20
WINDOW = 16  # buckets in flight on one member (sends or receives posted, not yet waited for)

# The ready flags of step 3.
REFUSED, SENDS, RECEIVES = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Transferred:
    """What one transfer moved (for the log)."""

    senders: tuple[int, ...]
    buckets: int
    nbytes: int
    seconds: float




# -- the transfer's description (pure: elasticctl.train.state_transfer.description's one format) -------------

def describe(state_dict: dict[str, Any], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
             ) -> tuple[bytes, list[TensorSpec], list[torch.Tensor]]:
    """The description blob of ``state_dict`` (with the lead's bucket size, which every member
    then uses), its tensors' specs and the tensors themselves."""
    skeleton, found = flatten(state_dict)
    specs, tensors = [], []
    for path, tensor in found:
        if tensor.dtype not in DTYPE_NAMES:
            raise StateError(f"The state's tensor '{'.'.join(map(str, path))}' has dtype {tensor.dtype}, "
                             "which a hot recovery cannot send.")
        specs.append(TensorSpec(path, DTYPE_NAMES[tensor.dtype], tuple(tensor.shape), tensor.device.type == "cpu"))
        tensors.append(tensor)
    return describe_state(skeleton, specs, bucket_bytes=bucket_bytes), specs, tensors


def parse_description(blob: bytes) -> tuple[dict[str, Any], list[TensorSpec], int]:
    """The skeleton, tensor specs and bucket size of a peer's transfer description; StateError if it is
    not one (no bucket size, or sections the transfer does not move)."""
    description = read_description(blob, "the state description received")
    if description.bucket_bytes is None:
        raise StateError("The state description received has a bucket size out of bounds (None).")
    if description.sharded or description.values:
        raise StateError("The state description received carries sections a state transfer does not take.")
    return description.state, description.tensors, description.bucket_bytes



def check_bucket_bytes(bucket_bytes: int) -> int:
    if not MIN_BUCKET_BYTES <= bucket_bytes <= MAX_BUCKET_BYTES:
        raise ValueError(f"The state transfer's bucket size ({bucket_bytes} bytes) must be between "
                         f"{MIN_BUCKET_BYTES} and {MAX_BUCKET_BYTES}.")
    return bucket_bytes


# -- the transfer (I/O over the generation's process group) ----------------------------------

def transfer_state(state: State | Any, rank: int, sources: Sequence[int], *, device: torch.device,
                   transport: torch.device, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                   group: dist.ProcessGroup | None = None) -> Transferred:
    """Bring every member of ``group`` (default: the current process group) to the state of
    ``sources`` (the lead first); ``rank`` and ``sources`` are ranks in ``group``.

    Every member calls it with the same ``sources``; the lead's ``bucket_bytes`` is everyone's.
    ``state``: a :class:`State`, or a view of one with its ``state_dict``, ``load_state_dict``,
    ``objects`` and ``optimizer`` (a sharded state's local shards: elasticctl.train.sharding.shards).
    ``device``: where this member's new tensors go; ``transport``: where buckets travel from
    (CPU for gloo, the GPU for NCCL). Raises StateError on a member whose state the description
    does not fit (the others carry on without it)."""
    began = time.perf_counter()
    lead = sources[0]
    world = dist.get_world_size(group)
    if rank == lead:
        blob, specs, mine = describe(state.state_dict(), bucket_bytes)
    else:
        blob = b""
    size = torch.tensor([len(blob)], dtype=torch.int64, device=transport)
    dist.broadcast(size, group=group, group_src=lead)
    if rank != lead and not 0 < int(size.item()) <= DESCRIPTION_MAX_BYTES:
        raise StateError(f"The state description received claims {int(size.item())} bytes: refused.")
    buffer = (torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(transport) if rank == lead
              else torch.empty(int(size.item()), dtype=torch.uint8, device=transport))
    dist.broadcast(buffer, group=group, group_src=lead)

    refusal: StateError | None = None
    if rank == lead:
        flag = SENDS
    else:
        try:
            skeleton, specs, bucket_bytes = parse_description(buffer.cpu().numpy().tobytes())
            flag, mine = _take(state, skeleton, specs, device, sender=rank in sources)
        except StateError as exc:
            flag, refusal = REFUSED, exc
    del buffer
    flags = [torch.zeros(1, dtype=torch.int64, device=transport) for _ in range(world)]
    dist.all_gather(flags, torch.tensor([flag], dtype=torch.int64, device=transport), group=group)
    flags = [int(f.item()) for f in flags]
    senders = [lead] + [r for r in sources[1:] if flags[r] == SENDS]
    receivers = [r for r in range(world) if flags[r] == RECEIVES]
    if refusal is not None:
        raise refusal
    buckets = plan_buckets([(s.dtype, s.numel, s.itemsize) for s in specs], bucket_bytes, PACK_BELOW_BYTES)
    owners = bucket_owners(len(buckets), senders)
    if receivers:
        _move(buckets, owners, len(senders), mine, specs, rank, receivers, transport, group)
    if flag == RECEIVES:
        filled = {spec.path: tensor for spec, tensor in zip(specs, mine, strict=True)}
        state.load_state_dict(rebuild(skeleton, filled))
    return Transferred(tuple(senders), len(buckets), sum(s.nbytes for s in specs), time.perf_counter() - began)


def _take(state: State | Any, skeleton: dict[str, Any], specs: list[TensorSpec], device: torch.device,
          sender: bool) -> tuple[int, list[torch.Tensor]]:
    """This member's tensor for each spec (its own, or allocated), and whether it sends or receives."""
    _, found = flatten(state.state_dict())
    own_tensors = {path: tensor for path, tensor in found}
    own = {path: Own(DTYPE_NAMES.get(t.dtype, str(t.dtype)), tuple(t.shape), t.is_contiguous())
           for path, t in own_tensors.items()}
    optimizer = state.optimizer
    groups = ([len(g["params"]) for g in optimizer.state_dict()["param_groups"]]
              if isinstance(optimizer, torch.optim.Optimizer) else None)
    checks = dict(objects=state.objects().keys(), own_param_groups=groups, allocation_limit=allocation_limit(own))
    if sender:
        try:
            check_description(skeleton, specs, own, sender=True, **checks)
            return SENDS, [own_tensors[spec.path] for spec in specs]
        except StateError:
            pass  # its state is not the lead's after all: it receives it like the others
    reuse = check_description(skeleton, specs, own, sender=False, **checks)
    tensors = [own_tensors[spec.path] if in_place else
               torch.empty(spec.shape, dtype=DTYPES[spec.dtype], device="cpu" if spec.on_cpu else device)
               for spec, in_place in zip(specs, reuse, strict=True)]
    return RECEIVES, tensors


def _move(buckets: list[Bucket], owners: list[int], senders: int, tensors: list[torch.Tensor],
          specs: list[TensorSpec], rank: int, receivers: list[int], transport: torch.device,
          group: dist.ProcessGroup | None = None) -> None:
    """The buckets, point to point from each one's owner to every receiver, up to WINDOW of them in
    flight on each member: a bucket that lives in its tensor costs no memory, so a joiner's
    receives need not wait for each other; a packed one takes a buffer, at most one on a sender
    (its state + one bucket) and one per sender on a receiver.

    Every member posts its buckets in index order and only ever waits for its oldest one, so
    the lowest bucket not yet through is always posted on both of its sides: no deadlock."""
    receiving = rank in receivers
    most_buffers = senders if receiving else 1
    in_flight: collections.deque = collections.deque()  # (bucket, works, its tensor, is a buffer)
    buffers = 0

    def complete_oldest() -> None:
        nonlocal buffers
        bucket, works, payload, is_buffer = in_flight.popleft()
        for work in works:
            work.wait()
        if is_buffer:
            if receiving:
                _unpack(bucket, payload, tensors, specs)
            buffers -= 1

    for index, (owner, bucket) in enumerate(zip(owners, buckets, strict=True)):
        if rank != owner and not receiving:
            continue
        view = _single_view(bucket, tensors, transport)
        while in_flight and (len(in_flight) >= WINDOW or (view is None and buffers >= most_buffers)):
            complete_oldest()
        if rank == owner:
            payload = view if view is not None else _pack(bucket, tensors, transport)
            works = [dist.isend(payload, group=group, tag=index, group_dst=receiver) for receiver in receivers]
        else:
            payload = view if view is not None else torch.empty(bucket.nbytes, dtype=torch.uint8, device=transport)
            works = [dist.irecv(payload, group=group, tag=index, group_src=owner)]
        buffers += view is None
        in_flight.append((bucket, works, payload, view is None))
    while in_flight:
        complete_oldest()


def _single_view(bucket: Bucket, tensors: list[torch.Tensor], transport: torch.device) -> torch.Tensor | None:
    """The bytes of a one-piece bucket inside its tensor, if they can travel from there."""
    if len(bucket.pieces) != 1:
        return None
    piece = bucket.pieces[0]
    tensor = tensors[piece.tensor]
    if not tensor.is_contiguous() or tensor.device != transport:
        return None
    return tensor.view(-1)[piece.start:piece.start + piece.count].view(torch.uint8)


def _pack(bucket: Bucket, tensors: list[torch.Tensor], transport: torch.device) -> torch.Tensor:
    # reshape copies only a tensor that is not contiguous (state tensors are, in practice)
    parts = [tensors[p.tensor].reshape(-1)[p.start:p.start + p.count].to(transport) for p in bucket.pieces]
    return torch.cat(parts).view(torch.uint8)


def _unpack(bucket: Bucket, packed: torch.Tensor, tensors: list[torch.Tensor], specs: list[TensorSpec]) -> None:
    offset = 0
    for piece in bucket.pieces:
        length = piece.count * specs[piece.tensor].itemsize
        source = packed[offset:offset + length].view(DTYPES[bucket.dtype])
        tensors[piece.tensor].view(-1)[piece.start:piece.start + piece.count].copy_(source)
        offset += length
