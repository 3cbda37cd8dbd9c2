"""The runtime's one DDP communication hook, and the watches that look through it.

DDP calls a communication hook on each bucket of gradients as soon as this worker has computed it,
before the all-reduce and so before any wait for a peer: the one moment a worker's *own* gradients
can be seen. Two watches need that moment (the straggler clock: when this worker's own part of the
step ended; the non-finite check: whether its own gradients were finite before the all-reduce
spreads them), and DDP takes a single hook. So the runtime registers this one, which hands each
bucket's buffer to every observer in turn and then all-reduces it with torch's own
``allreduce_hook`` (the average DDP computes without a hook, over the group's live size at each
call: a group reconfigured in place is followed). An observer only reads the buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

BucketObserver = Callable[[torch.Tensor], None]  # called with a bucket's flat gradients before the all-reduce


def observing_allreduce_hook(observers: Sequence[BucketObserver]):
    """A DDP communication hook: each observer sees the bucket, then torch's ``allreduce_hook``."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    observers = tuple(observers)

    def hook(process_group, bucket):  # unannotated: DDP refuses any annotation but its own types
        buffer = bucket.buffer()
        for observe in observers:
            observe(buffer)
        return allreduce_hook(process_group, bucket)

    return hook


def observe_buckets(model: torch.nn.Module, observers: Sequence[BucketObserver | None]) -> torch.nn.Module:
    """``model``, with the hook registered if it is DDP and any observer is given (None: a watch
    that is off); a model that is not DDP is returned as it is."""
    present = [observe for observe in observers if observe is not None]
    if present and isinstance(model, DistributedDataParallel):
        model.register_comm_hook(None, observing_allreduce_hook(present))
    return model
