"""Who sends the state when a generation forms (elasticctl.train.recovery: whom the members believe,
the replicas' plan for a replicated state), and in which buckets (elasticctl.train.state_transfer.buckets), table-tested."""

from __future__ import annotations

import pytest

from elasticctl.train.state_transfer.buckets import Bucket, Piece, bucket_owners, plan_buckets
from elasticctl.train.recovery.from_replicas import FromReplicas, ReplicaTransfer, plan_whole_state
from elasticctl.train.recovery.source import NothingToMove, previous_members, trust

T, F = True, False


def whole(step: int, world: int, *sources: int) -> FromReplicas:
    """The whole state of ``step`` from ``sources`` (the lead first) to every other member of ``world``."""
    return FromReplicas((ReplicaTransfer(None, tuple(range(world)), sources),), step)


@pytest.mark.parametrize("steps, survivors, plan, refused", [
    # nobody holds state: no plan from the replicas (every member restores the newest checkpoint)
    ([-1, -1], [F, F], None, ()),
    # everyone at one step: nothing to send
    ([7, 7, 7], [T, T, T], NothingToMove(), ()),
    # a newcomer (-1) gets the survivors' state, from every survivor at the best step, the lowest rank leading
    ([7, 7, -1], [T, T, F], whole(7, 3, 0, 1), ()),
    ([-1, 7, 7, 7], [F, T, T, T], whole(7, 4, 1, 2, 3), ()),
    # the step in flight: only the survivor that applied it sends it
    ([7, 8, -1], [T, T, F], whole(8, 3, 1), ()),
    ([8, 7, 8, -1], [T, T, T, F], whole(8, 4, 0, 2), ()),
    # an admitted newcomer claims step 50,000: the survivors' state wins
    ([100, 100, 50_000], [T, T, F], whole(100, 3, 0, 1), ()),
    ([100, 50_000], [T, F], whole(100, 2, 0), ()),
    # a newcomer at the survivors' step is not a sender: its word is not checked
    ([100, 100, 100, -1], [T, T, F, F], whole(100, 4, 0, 1), ()),
    # a member of the previous generation far ahead of its peers is not believed
    ([100, 100, 50_000], [T, T, T], whole(100, 3, 0, 1), (2,)),
    ([50_000, 100], [T, T], whole(100, 2, 1), (0,)),
    # no survivor holds state (every worker of the last generation was lost): one holder sends,
    # since holders that did not train together need not be identical
    ([-1, 40, 40], [T, F, F], whole(40, 3, 1), ()),
    ([-1, 40], [F, F], whole(40, 2, 1), ()),
])
def test_plan_whole_state(steps, survivors, plan, refused):
    assert plan_whole_state(steps, survivors) == plan
    assert trust(steps, survivors).refused == refused


@pytest.mark.parametrize("in_sync, generation, previous", [
    # the job's start: nobody was in sync anywhere
    ([-1, -1, -1], 1, [F, F, F]),
    # survivors of generation 4 and a newcomer
    ([4, 4, -1], 5, [T, T, F]),
    # a node frozen through generation 5 (it last synced in 4) returns to 6: the one that trained on
    # alone in 5 is the previous generation; the frozen one is a newcomer
    ([5, 4], 6, [T, F]),
    ([4, 5], 6, [F, T]),
    # a survivor sealed out of generation 5 (a spare took the place at once) rejoins in 6: it last synced in 4
    ([5, 4, 5], 6, [T, F, T]),
    # generation 5 formed but never synced (it failed to form): who last synced in 4 trained together
    ([4, 4, -1], 6, [T, T, F]),
    # a report of this generation or a later one cannot be true: it counts as none
    ([4, 6, 4], 6, [T, F, T]),
    ([4, 99, -1], 6, [T, F, F]),
    ([-7, 3], 6, [F, T]),
])
def test_previous_members(in_sync, generation, previous):
    assert previous_members(in_sync, generation) == previous


def test_a_frozen_node_that_returns_does_not_roll_the_job_back():
    """Nodes a and c train together to step 1387 in generation 4; c is frozen, a trains alone in 5 to
    step 1560; in 6 they are together again: a's steps are kept, c receives them."""
    steps, in_sync = [1560, 1387], [5, 4]
    assert plan_whole_state(steps, previous_members(in_sync, 6)) == whole(1560, 2, 0)


def test_the_lead_sender_is_the_first_source():
    (transfer,) = plan_whole_state([-1, 7, 7, 7], [F, T, T, T]).transfers
    assert transfer.sources[0] == 1 and transfer.members == (0, 1, 2, 3)




@pytest.mark.parametrize("tensors, bucket_bytes, pack_below, buckets", [
    # nothing to send
    ([], 64, None, []),
    ([("float32", 0, 4)], 64, None, []),
    # small tensors of one dtype share a bucket
    ([("float32", 4, 4), ("float32", 4, 4)], 64, None, [Bucket("float32", (Piece(0, 0, 4), Piece(1, 0, 4)), 32)]),
    # per dtype: a float64 between two small float32 tensors does not split them
    ([("float32", 4, 4), ("float64", 2, 8), ("float32", 1, 4)], 64, None,
     [Bucket("float32", (Piece(0, 0, 4), Piece(2, 0, 1)), 20), Bucket("float64", (Piece(1, 0, 2),), 16)]),
    # a small tensor that would overflow the open bucket closes it
    ([("float32", 10, 4), ("float32", 10, 4)], 64, None,
     [Bucket("float32", (Piece(0, 0, 10),), 40), Bucket("float32", (Piece(1, 0, 10),), 40)]),
    # exactly full
    ([("float32", 8, 4), ("float32", 8, 4)], 64, None, [Bucket("float32", (Piece(0, 0, 8), Piece(1, 0, 8)), 64)]),
    # a tensor of a whole bucket or more travels alone, in bucket-sized pieces, the last one short
    ([("float32", 40, 4), ("float32", 2, 4)], 64, None,
     [Bucket("float32", (Piece(0, 0, 16),), 64), Bucket("float32", (Piece(0, 16, 16),), 64),
      Bucket("float32", (Piece(0, 32, 8),), 32), Bucket("float32", (Piece(1, 0, 2),), 8)]),
    ([("float32", 2, 4), ("float32", 16, 4), ("float32", 1, 4)], 64, None,
     [Bucket("float32", (Piece(1, 0, 16),), 64), Bucket("float32", (Piece(0, 0, 2), Piece(2, 0, 1)), 12)]),
    # pack_below: tensors from that size travel alone, the small ones around them are packed
    ([("float32", 1, 4), ("float32", 8, 4), ("float32", 2, 4), ("float32", 4, 4)], 64, 16,
     [Bucket("float32", (Piece(1, 0, 8),), 32), Bucket("float32", (Piece(3, 0, 4),), 16),
      Bucket("float32", (Piece(0, 0, 1), Piece(2, 0, 2)), 12)]),
    # a bucket smaller than one element still carries one
    ([("float64", 2, 8)], 4, None, [Bucket("float64", (Piece(0, 0, 1),), 8), Bucket("float64", (Piece(0, 1, 1),), 8)]),
    # empty tensors between others get no piece
    ([("float32", 1, 4), ("float32", 0, 4), ("float32", 1, 4)], 64, None,
     [Bucket("float32", (Piece(0, 0, 1), Piece(2, 0, 1)), 8)]),
])
def test_plan_buckets(tensors, bucket_bytes, pack_below, buckets):
    assert plan_buckets(tensors, bucket_bytes, pack_below) == buckets


@pytest.mark.parametrize("pack_below", [None, 1, 16, 10_000])
@pytest.mark.parametrize("counts", [[0], [1], [7, 3], [100, 1, 50, 0, 33], [5] * 40])
@pytest.mark.parametrize("bucket_bytes", [4, 12, 64, 1000])
def test_every_element_travels_once_in_order_and_no_bucket_is_too_large(counts, bucket_bytes, pack_below):
    buckets = plan_buckets([("float32", count, 4) for count in counts], bucket_bytes, pack_below)
    covered = [(p.tensor, p.start, p.count) for b in buckets for p in b.pieces]
    expected_position = {}
    for tensor, start, count in covered:
        assert start == expected_position.get(tensor, 0) and count > 0
        expected_position[tensor] = start + count
    assert expected_position == {i: c for i, c in enumerate(counts) if c}
    assert all(b.nbytes == 4 * sum(p.count for p in b.pieces) <= max(bucket_bytes, 4) for b in buckets)


@pytest.mark.parametrize("buckets, senders, owners", [
    (0, [0], []),
    (3, [0], [0, 0, 0]),
    (5, [0, 1], [0, 1, 0, 1, 0]),
    (4, [2, 0, 3], [2, 0, 3, 2]),
])
def test_bucket_owners_round_robin_from_the_lead(buckets, senders, owners):
    assert bucket_owners(buckets, senders) == owners


def test_bucket_owners_need_a_sender():
    with pytest.raises(ValueError, match="at least one sender"):
        bucket_owners(3, [])
