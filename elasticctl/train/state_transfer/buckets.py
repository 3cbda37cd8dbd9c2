"""The buckets a state transfer's tensors travel in: a pure decision over the tensors' sizes.

When a generation's members move a state between them (:mod:`elasticctl.train.state_transfer.transfer`: the
replicas' transfer, :mod:`elasticctl.train.recovery.from_replicas`), its tensors go in buckets of a
bounded size (:func:`plan_buckets`), dealt round-robin over the senders, the lead first
(:func:`bucket_owners`), so that a joiner's receive is spread over the survivors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + count)`` of tensor number ``tensor`` (in the flattened state)."""

    tensor: int
    start: int
    count: int


@dataclasses.dataclass(frozen=True)
class Bucket:
    """What one message carries: pieces of tensors of one dtype, at most the bucket size in bytes."""

    dtype: str
    pieces: tuple[Piece, ...]
    nbytes: int


def plan_buckets(tensors: Sequence[tuple[str, int, int]], bucket_bytes: int,
                 pack_below: int | None = None) -> list[Bucket]:
    """The buckets that carry ``tensors`` (each ``(dtype, element count, bytes per element)``, in the
    order both sides agree on), each at most ``bucket_bytes`` (at least one element).

    A tensor of at least ``pack_below`` bytes (default: the bucket size) travels alone, cut into
    bucket-sized pieces if it is larger: such buckets go out of and into the tensors themselves,
    with no copy on either side. Smaller tensors are packed, per dtype, into shared buckets (one
    copy on each side, but one message for many tensors); a packed bucket is closed when the next
    small tensor of its dtype would overflow it, and the ones still open come last. Empty tensors
    carry nothing and get no piece."""
    pack_below = bucket_bytes if pack_below is None else min(pack_below, bucket_bytes)
    buckets: list[Bucket] = []
    packing: dict[str, tuple[list[Piece], int]] = {}  # per dtype: the open bucket's pieces and bytes

    def close(dtype: str) -> None:
        pieces, used = packing.pop(dtype)
        buckets.append(Bucket(dtype, tuple(pieces), used))

    for index, (dtype, count, itemsize) in enumerate(tensors):
        nbytes = count * itemsize
        if count == 0:
            continue
        if nbytes >= pack_below:
            per_bucket = max(1, bucket_bytes // itemsize)
            for start in range(0, count, per_bucket):
                piece = Piece(index, start, min(per_bucket, count - start))
                buckets.append(Bucket(dtype, (piece,), piece.count * itemsize))
            continue
        if dtype in packing and packing[dtype][1] + nbytes > bucket_bytes:
            close(dtype)
        pieces, used = packing.get(dtype, ([], 0))
        packing[dtype] = ([*pieces, Piece(index, 0, count)], used + nbytes)
    for dtype in list(packing):
        close(dtype)
    return buckets


def bucket_owners(buckets: int, senders: Sequence[int]) -> list[int]:
    """Which sender sends each of ``buckets`` buckets: round-robin, the lead first."""
    if not senders:
        raise ValueError("A transfer needs at least one sender.")
    return [senders[index % len(senders)] for index in range(buckets)]
