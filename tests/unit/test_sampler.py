"""ResumableSampler arithmetic: one global stream per epoch, resumable at any world size."""

from __future__ import annotations

from collections import Counter

import pytest
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from elasticctl.errors import ConfigError
from elasticctl.train.sampler import ResumableSampler, sampler_world


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


# -- world size and rank: given, bound by the runtime, or the generation's --------------------------

@pytest.mark.parametrize(("given", "group", "expected"), [
    ((None, None), None, (1, 0)),     # python train.py, or built before any group: a world of one
    ((None, None), (4, 3), (4, 3)),   # the default process group's, while one is up
    ((2, 1), None, (2, 1)),           # given (or bound by the runtime) before any group
    ((2, 1), (4, 3), (2, 1)),         # given wins over the group
    ((3, None), (4, 2), (3, 2)),      # each unset value on its own, as torch's sampler does
    ((None, 0), (4, 2), (4, 0)),
    ((5, None), None, (5, 0)),
])
def test_sampler_world_takes_what_was_given_then_the_group_then_a_world_of_one(given, group, expected):
    assert sampler_world(*given, group) == expected


@pytest.mark.parametrize(("given", "group", "needle"), [
    ((0, None), None, r"world size \(0\) must be at least 1"),
    ((2, 2), None, r"rank \(2\) must be between 0 and 1"),
    ((None, -1), None, r"rank \(-1\) must be between 0 and 0"),
    ((3, None), (4, 3), r"rank \(3\) must be between 0 and 2"),
])
def test_sampler_world_names_a_value_outside_the_world(given, group, needle):
    with pytest.raises(ConfigError, match=needle):
        sampler_world(*given, group)


def test_a_sampler_built_outside_any_process_group_is_a_world_of_one():
    assert not dist.is_initialized()
    sampler = ResumableSampler(range(12), seed=7)  # torch's own would raise here
    assert (sampler.num_replicas, sampler.rank) == (1, 0)
    assert sorted(sampler) == list(range(12)) and len(sampler) == 12


def test_a_bad_rank_given_is_refused_where_the_sampler_is_built():
    with pytest.raises(ValueError, match=r"rank \(4\) must be between 0 and 1"):
        ResumableSampler(range(12), num_replicas=2, rank=4)


@pytest.mark.parametrize(("world", "rank"), [(1, 0), (3, 0), (3, 2), (4, 1)])
def test_binding_a_generation_deals_from_the_same_position(world, rank):
    # The runtime binds each generation's world to the sampler the script built: the epoch's
    # position (its state) stays, only the deal of what is left changes.
    built = ResumableSampler(range(30), seed=7)
    built.load_state_dict({"epoch": 2, "consumed": 9, "seed": 7, "dataset_size": 30})
    state = built.state_dict()
    built.num_replicas, built.rank = world, rank
    assert built.state_dict() == state
    given = samplers(30, world, state)[rank]
    assert (built.num_replicas, built.rank) == (world, rank)
    assert list(built) == list(given) and len(built) == len(given)


@pytest.mark.parametrize(("size", "world", "batch", "drop_last"), [(10, 3, 2, False), (10, 3, 2, True), (7, 2, 4, False)])
def test_upcoming_step_names_the_samples_every_rank_trains_next(size, world, batch, drop_last):
    # what the sample ledger records per step, before the step advances the position
    group = samplers(size, world, drop_last=drop_last)
    for _ in range(4):
        streams = [list(iter(s)) for s in group]
        expected = sorted(i for stream in streams for i in stream[:batch])
        assert all(sorted(s.upcoming_step(batch)) == expected for s in group)
        if not streams[0]:
            break
        for sampler in group:
            sampler.advance(min(batch, len(streams[0])))
