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

World size and rank: a script builds its sampler wherever it likes, at module level too, before
any process group exists (torch's ``DistributedSampler(dataset)`` raises there). Those it was
not given are the generation's it serves: the runtime binds each generation's (setting
``num_replicas`` and ``rank``, which moves nothing in the epoch); until then, or without the
runtime, the default process group's while one is up, else a world of one
(:func:`sampler_world`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from elasticctl.errors import ConfigError


def sampler_world(num_replicas: int | None, rank: int | None,
                  group: tuple[int, int] | None) -> tuple[int, int]:
    """The (world size, rank) a sampler deals for.

    ``num_replicas``, ``rank``: what it was given or bound to (None: not set); ``group``: the
    default process group's (world size, rank) while one is up, else None. Each unset value comes
    from the group, else from a world of one (a script run as ``python train.py``, or a sampler
    used before its run formed a group). Raises :class:`ConfigError` for a world below one or a
    rank outside it.
    """
    world = num_replicas if num_replicas is not None else group[0] if group is not None else 1
    own = rank if rank is not None else group[1] if group is not None else 0
    if world < 1:
        raise ConfigError(f"The sampler's world size ({world}) must be at least 1.")
    if not 0 <= own < world:
        raise ConfigError(f"The sampler's rank ({own}) must be between 0 and {world - 1}, "
                          f"its world size less one.")
    return world, own


def _default_group() -> tuple[int, int] | None:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return None


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` with a global, world-size-independent position in the epoch.

    Call :meth:`advance` after every trained batch with that batch's per-rank
    size (the same on every rank); save :meth:`state_dict` in checkpoints; call
    :meth:`load_state_dict` before iterating to resume. :meth:`set_epoch` starts
    an epoch from its top.

    ``num_replicas`` and ``rank`` are read where they are used, not fixed when it is built:
    unset, they follow the generation it serves (module docstring, :func:`sampler_world`).
    Setting them (the runtime does, each generation) binds them.
    """

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        sampler_world(num_replicas, rank, None if num_replicas is not None and rank is not None
                      else _default_group())  # a bad value is named now, where the script gave it
        # torch's __init__ would ask the default process group for what was not given, and raise
        # when there is none yet: it gets a world of one, replaced at once by the values given
        # (num_samples and total_size, which it derives from them, are not used here).
        super().__init__(dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self._num_replicas, self._rank = num_replicas, rank
        self.dataset_size = len(dataset)
        self.consumed = 0  # positions of this epoch's permutation already trained, by all ranks

    @property
    def num_replicas(self) -> int:
        return sampler_world(self._num_replicas, self._rank, _default_group())[0]

    @num_replicas.setter
    def num_replicas(self, value: int) -> None:
        self._num_replicas = value

    @property
    def rank(self) -> int:
        return sampler_world(self._num_replicas, self._rank, _default_group())[1]

    @rank.setter
    def rank(self, value: int) -> None:
        self._rank = value

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
        return self.per_rank()

    def per_rank(self) -> int:
        """Positions this rank has left to deal in the epoch (what ``len`` is, unless a subclass
        counts more)."""
        if self.drop_last:
            return self.remaining // self.num_replicas
        return math.ceil(self.remaining / self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        return iter(self._deal())

    def upcoming_step(self, count: int) -> list[int]:
        """The indices of the samples the next step trains on every rank, ``count`` each, from
        where the epoch is (an audit's record: a step any rank committed trained all of them, its
        gradients averaged over every rank's)."""
        world, _ = sampler_world(self._num_replicas, self._rank, _default_group())
        return self._stream(world)[:count * world]

    def _deal(self) -> list[int]:
        world, rank = sampler_world(self._num_replicas, self._rank, _default_group())
        # Round-robin keeps each step a contiguous block of the stream: after k
        # batches of b per rank, exactly positions [0, k*b*world) are consumed.
        return self._stream(world)[rank::world]

    def _stream(self, world: int) -> list[int]:
        """The rest of the epoch's order, padded to whole rounds of the world as DistributedSampler pads."""
        rest = self.permutation()[self.consumed:]
        total = self.per_rank() * world
        if total > len(rest):  # pad from the start of the remainder
            rest += (rest * math.ceil(total / max(len(rest), 1)))[: total - len(rest)]
        return rest[:total]

    def advance(self, batch_size: int) -> None:
        """Record that every rank trained one more batch of ``batch_size`` samples."""
        self.consumed = min(self.dataset_size, self.consumed + batch_size * self.num_replicas)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.consumed = 0

    @property
    def epoch_done(self) -> bool:
        return self.per_rank() == 0

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
