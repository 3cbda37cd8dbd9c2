"""The sampler the framework integrations give a training loader, whatever the framework.

:class:`DealtSampler` is a :class:`~elasticctl.train.sampler.ResumableSampler` that names the
samples of the batch just trained (the indices it dealt, first in first out: a loader that
prefetches has dealt more than was trained) and keeps its position when a framework sets the
epoch it is already in (Lightning and transformers set it at the start of every epoch, the one a
resume goes on with too). Each integration adds how its framework counts an epoch.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

from elasticctl.train.sampler import ResumableSampler


class DealtSampler(ResumableSampler):
    def __init__(self, dataset, *, shuffle: bool, seed: int, drop_last: bool) -> None:
        super().__init__(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self._dealt: collections.deque[int] = collections.deque()

    def __iter__(self) -> Iterator[int]:
        self._dealt.clear()  # a new pass: what an earlier iterator dealt (prefetched) is not trained
        for index in super().__iter__():
            self._dealt.append(index)
            yield index

    def trained(self, count: int) -> list[int]:
        """The indices of the ``count`` samples dealt first and not yet trained: those of the
        batch (or the step) just trained."""
        return [self._dealt.popleft() for _ in range(min(count, len(self._dealt)))]

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            super().set_epoch(epoch)
            self.started_epoch()

    def started_epoch(self) -> None:
        """Called when a new epoch starts at its top (a subclass resets its own count)."""
