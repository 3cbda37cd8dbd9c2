"""ResumableSampler arithmetic: one global stream per epoch, resumable at any world size."""

from __future__ import annotations

from collections import Counter

import pytest
from torch.utils.data import DistributedSampler

from elasticctl.train.sampler import ResumableSampler


def samplers(size: int, world: int, state: dict | None = None, **options) -> list[ResumableSampler]:
    group = [ResumableSampler(range(size), num_replicas=world, rank=r, seed=7, **options) for r in range(world)]
    for sampler in group:
        if state is not None:
            sampler.load_state_dict(state)
    return group


def train(group: list[ResumableSampler], batch: int, steps: int | None = None) -> list[list[int]]:
    """Play ``steps`` steps (default: to the end of the epoch); return each step's indices over all ranks."""
    streams = [list(iter(s)) for s in group]
    trained, step = [], 0
    while (steps is None or step < steps) and step * batch < len(streams[0]):
        chunks = [stream[step * batch:(step + 1) * batch] for stream in streams]
        trained.append([i for chunk in chunks for i in chunk])
        for sampler in group:
            sampler.advance(len(chunks[0]))
        step += 1
    return trained


def test_one_epoch_covers_the_permutation_of_distributed_sampler():
    group = samplers(100, 4)
    seen = [i for step in train(group, batch=5) for i in step]
    assert sorted(seen) == list(range(100))
    torch_sampler = DistributedSampler(range(100), num_replicas=1, rank=0, seed=7)
    assert group[0].permutation() == list(torch_sampler)  # the same order torch would draw
    assert group[0].epoch_done


def test_each_step_consumes_a_contiguous_block_of_the_stream():
    group = samplers(60, 3)
    order = group[0].permutation()
    for k, step in enumerate(train(group, batch=4)):
        assert sorted(step) == sorted(order[k * 12:(k + 1) * 12])
    assert group[0].consumed == 60


@pytest.mark.parametrize(("size", "world_before", "world_after", "batch_before", "batch_after", "steps"), [
    (100, 4, 3, 5, 5, 2),   # shrink
    (100, 2, 5, 8, 3, 3),   # grow, other batch size
    (97, 3, 2, 4, 6, 5),    # size divisible by neither world
    (64, 1, 4, 16, 16, 4),  # checkpoint exactly at the end of the epoch
])
def test_resume_at_another_world_size_trains_every_sample_once(
        size, world_before, world_after, batch_before, batch_after, steps):
    before = samplers(size, world_before)
    first = train(before, batch_before, steps)
    state = before[0].state_dict()
    assert state["consumed"] == min(size, steps * batch_before * world_before)

    after = samplers(size, world_after, state)
    second = train(after, batch_after)
    seen = Counter(i for step in first + second for i in step)
    assert set(seen) == set(range(size)), "a sample was skipped"
    repeated = {i: n for i, n in seen.items() if n > 1}
    # Only the documented tail padding repeats, and only in the epoch's last step.
    assert sum(n - 1 for n in repeated.values()) < world_after
    assert all(i in second[-1] for i in repeated)


def test_drop_last_repeats_nothing_and_drops_at_most_world_minus_one():
    group = samplers(103, 4, drop_last=True)
    seen = [i for step in train(group, batch=5) for i in step]
    assert len(seen) == len(set(seen)) == 100


def test_shuffle_is_deterministic_per_epoch_and_differs_between_epochs():
    a, b = samplers(50, 1)[0], samplers(50, 1)[0]
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first and sorted(a) == sorted(first)


def test_set_epoch_restarts_the_count():
    group = samplers(40, 2)
    train(group, batch=4, steps=3)
    group[0].set_epoch(1)
    assert group[0].consumed == 0 and len(group[0]) == 20


def test_loading_a_state_of_another_dataset_size_is_refused():
    state = samplers(40, 2)[0].state_dict()
    with pytest.raises(ValueError, match="40 samples"):
        samplers(50, 2, state)
