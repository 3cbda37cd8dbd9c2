"""A distributed sampler that resumes mid-epoch, even after the world size changed.

torch's ``DistributedSampler`` deals the epoch's permutation to ranks as
``indices[rank::world]`` and always starts at the top of the epoch, so a job
that restarts mid-epoch trains the first part of the epoch again, and one that
restarts at another world size deals a different split altogether.

Here the epoch is one global stream: the permutation of ``seed + epoch`` (the
same one ``DistributedSampler`` draws). Every step consumes a contiguous block
of it, ``world_size * batch_size`` positions, dealt round-robin to the ranks.
The training loop reports each step with :meth:`ResumableSampler.advance`, so
the number of positions consumed — the only state worth saving — is one global
count that means the same thing at every world size. A sampler built at any
world size and loaded with that count deals exactly the positions not yet
trained.

Tail padding: when the positions left in an epoch do not divide evenly by the
world size, each rank is topped up to the same length with positions from the
start of the remainder (as ``DistributedSampler`` does), so the last step of an
epoch can train up to ``world_size - 1`` samples twice. With ``drop_last=True``
those trailing samples are dropped instead. Nothing else repeats or is skipped.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import DistributedSampler


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` with a global, world-size-independent position in the epoch.

    Call :meth:`advance` after every trained batch with that batch's per-rank
    size (the same on every rank); save :meth:`state_dict` in checkpoints; call
    :meth:`load_state_dict` before iterating to resume. :meth:`set_epoch` starts
    an epoch from its top.
    """

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=drop_last)
        self.dataset_size = len(dataset)
        self.consumed = 0  # positions of this epoch's permutation already trained, by all ranks

    def permutation(self) -> list[int]:
        """The epoch's global order of dataset indices."""
        if not self.shuffle:
            return list(range(self.dataset_size))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_size, generator=generator).tolist()

    @property
    def remaining(self) -> int:
        return self.dataset_size - self.consumed

    def __len__(self) -> int:
        if self.drop_last:
            return self.remaining // self.num_replicas
        return math.ceil(self.remaining / self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        rest = self.permutation()[self.consumed:]
        per_rank = len(self)
        total = per_rank * self.num_replicas
        if total > len(rest):  # pad from the start of the remainder, as DistributedSampler does
            rest += (rest * math.ceil(total / max(len(rest), 1)))[: total - len(rest)]
        # Round-robin keeps each step a contiguous block of the stream: after k
        # batches of b per rank, exactly positions [0, k*b*world) are consumed.
        return iter(rest[self.rank:total:self.num_replicas])

    def advance(self, batch_size: int) -> None:
        """Record that every rank trained one more batch of ``batch_size`` samples."""
        self.consumed = min(self.dataset_size, self.consumed + batch_size * self.num_replicas)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.consumed = 0

    @property
    def epoch_done(self) -> bool:
        return len(self) == 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed,
                "dataset_size": self.dataset_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("dataset_size", self.dataset_size) != self.dataset_size:
            raise ValueError(
                f"The checkpointed sampler covered {state['dataset_size']} samples, "
                f"but the dataset now has {self.dataset_size}."
            )
        self.epoch = int(state["epoch"])
        self.seed = int(state.get("seed", self.seed))
        self.consumed = int(state["consumed"])
