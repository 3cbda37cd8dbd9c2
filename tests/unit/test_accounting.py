"""bench.accounting on made-up records: what passes, and each way a record fails."""

from __future__ import annotations

import pytest

from bench.accounting import AccountingError, check_replicas, check_samples


def mlp_lines(generation, step, epoch, consumed, world, per_rank, t, params="p"):
    """One application of a step as mlp.py --record-params writes it: a line per rank."""
    return [{"step": step, "generation": generation, "epoch": epoch, "world_size": world, "consumed": consumed,
             "indices": list(range(per_rank)), "time": t + rank / 100, "params": f"{params}{step}"}
            for rank in range(world)]


def epoch_of(size=20, world=2, per_rank=4, first_step=0, epoch=0, generation=1, t0=0.0):
    lines, consumed, step = [], 0, first_step
    while consumed < size:
        rank_share = min(per_rank, -(-(size - consumed) // world))  # the sampler's padded tail
        consumed = min(size, consumed + rank_share * world)
        lines += mlp_lines(generation, step, epoch, consumed, world, rank_share, t0 + step)
        step += 1
    return lines, step


def test_a_clean_record_with_a_padded_tail_passes():
    first, step = epoch_of(size=21, world=2)  # 21 = 2 x (4 + 4 + 2) + 1: the last step pads one sample
    second, _ = epoch_of(size=21, world=2, first_step=step, epoch=1, t0=100)
    lines = first + second
    check_replicas(lines, across_generations=True)
    result = check_samples(lines, dataset_size=21)
    assert (result.steps, result.redone, result.epochs_completed) == (2 * step, 0, 1)


def test_a_step_redone_by_a_later_generation_counts_once_in_the_lineage():
    lines, _ = epoch_of(size=32, world=2)
    # generation 2 re-did step 2 (its first application failed on some worker)
    redo = [dict(r, generation=2, time=r["time"] + 50) for r in lines if r["step"] == 2]
    result = check_samples(lines + redo, dataset_size=32)
    assert result.redone == 1


def test_a_lost_span_a_twice_trained_span_and_a_short_epoch_fail():
    lines, step = epoch_of(size=32, world=2)
    gap = [r for r in lines if r["step"] != 1]
    with pytest.raises(AccountingError, match="step numbers missing"):
        check_samples(gap)
    shifted = [dict(r, consumed=r["consumed"] + 2) if r["step"] == 1 else r for r in lines]
    with pytest.raises(AccountingError, match="step 0 ends at position 8, step 1 starts at 10"):
        check_samples(shifted)
    short = [r for r in lines if r["step"] != step - 1]
    later, _ = epoch_of(size=32, world=2, first_step=step - 1, epoch=1, t0=100)
    with pytest.raises(AccountingError, match="epoch 0 ended at position 24 of 32"):
        check_samples(short + later, dataset_size=32)


def test_diverged_replicas_fail():
    lines, _ = epoch_of(size=16, world=2)
    lines[-1] = dict(lines[-1], params="other")
    with pytest.raises(AccountingError, match="replicas diverged"):
        check_replicas(lines)
    redone = dict(lines[0], generation=2, params="different")
    check_replicas([*lines[:-1], redone])  # another generation: only the cross-generation check sees it
    with pytest.raises(AccountingError, match=r"replicas diverged at 1 step: \[0\]"):
        check_replicas([*lines[:-1], redone], across_generations=True)
