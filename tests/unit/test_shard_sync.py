"""Who sends which shard when a sharded (HSDP) generation forms (elasticctl.train.recovery.from_replicas.plan_shards),
and how a generation's workers are laid out as a mesh (elasticctl.train.sharding.shards.hsdp_layout), table-tested."""

from __future__ import annotations

import pytest

from elasticctl.train.recovery.from_replicas import (
    FromReplicas,
    ReplicaTransfer,
    plan_shards,
    unheld_shards,
)
from elasticctl.train.recovery.source import NothingToMove, Reports, trust
from elasticctl.train.sharding.shards import LayoutError, hsdp_layout

T, F = True, False


@pytest.mark.parametrize("steps, shards, survivors, plan, missing, refused", [
    # nobody holds state: no plan from the replicas (every member restores the newest checkpoint)
    ([-1, -1, -1, -1], [0, 1, 0, 1], [F, F, F, F], None, (), ()),
    # every replica of every shard at one step: nothing to send
    ([7, 7, 7, 7], [0, 1, 0, 1], [T, T, T, T], NothingToMove(), (), ()),
    # a node lost, the survivors at one step (3 nodes x 2 -> 2 nodes x 2): nothing to send
    ([9, 9, 9, 9], [0, 1, 0, 1], [T, T, T, T], NothingToMove(), (), ()),
    # a node joins: each of its workers gets its shard from the replicas of that shard index
    ([9, 9, 9, 9, -1, -1], [0, 1, 0, 1, 0, 1], [T, T, T, T, F, F],
     FromReplicas((ReplicaTransfer(0, (0, 2, 4), (0, 2)), ReplicaTransfer(1, (1, 3, 5), (1, 3))), 9), (), ()),
    # the step in flight applied on one node only: it sends both shards to the other node
    ([9, 9, 8, 8], [0, 1, 0, 1], [T, T, T, T],
     FromReplicas((ReplicaTransfer(0, (0, 2), (0,)), ReplicaTransfer(1, (1, 3), (1,))), 9), (), ()),
    # only shard 1 needs sending
    ([9, 9, 9, 8], [0, 1, 0, 1], [T, T, T, T], FromReplicas((ReplicaTransfer(1, (1, 3), (1,)),), 9), (), ()),
    # a survivor whose shard no longer fits (it reports -1) receives like a newcomer
    ([9, -1, 9, 9], [0, 1, 0, 1], [T, T, T, T], FromReplicas((ReplicaTransfer(1, (1, 3), (3,)),), 9), (), ()),
    # shard 1 has no holder at the newest step: no mixing of steps, the checkpoint instead
    ([9, 8, 9, 8], [0, 1, 0, 1], [T, T, T, T], None, (1,), ()),
    # a peer lost mid-step: shard 0's replicas applied step 9 on one node, shard 1's on none; the newest
    # step every shard has is 8, so the node a shard ahead receives it back at 8 (step 9 is trained again)
    ([9, 8, 8, 8], [0, 1, 0, 1], [T, T, T, T], FromReplicas((ReplicaTransfer(0, (0, 2), (2,)),), 8), (), ()),
    # ... and a newcomer gets every shard of that step
    ([9, 8, 8, 8, -1, -1], [0, 1, 0, 1, 0, 1], [T, T, T, T, F, F],
     FromReplicas((ReplicaTransfer(0, (0, 2, 4), (2,)), ReplicaTransfer(1, (1, 3, 5), (1, 3))), 8), (), ()),
    # every replica of shard 1 lost (FSDP without replicas after a resize): the checkpoint
    ([9, -1, -1], [0, 1, 2], [T, T, F], None, (1, 2), ()),
    # a newcomer claiming a far step is not a holder: the survivors' shards win
    ([9, 9, 50_000, 50_000], [0, 1, 0, 1], [T, T, F, F],
     FromReplicas((ReplicaTransfer(0, (0, 2), (0,)), ReplicaTransfer(1, (1, 3), (1,))), 9), (), ()),
    # a survivor far ahead of its peers is refused and receives its shard
    ([9, 9, 9, 50_000], [0, 1, 0, 1], [T, T, T, T],
     FromReplicas((ReplicaTransfer(1, (1, 3), (1,)),), 9), (), (3,)),
    # no survivor holds state: one holder per shard index sends
    ([-1, -1, 4, 4, 4, 4], [0, 1, 0, 1, 0, 1], [T, T, F, F, F, F],
     FromReplicas((ReplicaTransfer(0, (0, 2, 4), (2,)), ReplicaTransfer(1, (1, 3, 5), (3,))), 4), (), ()),
])
def test_plan_shards(steps, shards, survivors, plan, missing, refused):
    assert plan_shards(steps, shards, survivors) == plan
    assert unheld_shards(Reports(tuple(steps), tuple(survivors), tuple(shards))) == missing
    assert trust(steps, survivors).refused == refused


@pytest.mark.parametrize("members, world, local, layout", [
    # torchrun's ranks: node after node
    ((), 6, 2, [[0, 1], [2, 3], [4, 5]]),
    ((), 3, 1, [[0], [1], [2]]),
    # hot generations keep survivors' order and append newcomers: a row per node, its ranks ascending
    # (torch numbers a dimension's workers in rank order), rows in order of their first rank
    (("a.0", "a.1", "b.0", "b.1"), 4, 2, [[0, 1], [2, 3]]),
    (("b.1", "a.0", "b.0", "a.1"), 4, 2, [[0, 2], [1, 3]]),
    (("a.0", "a.1", "b.0", "b.1", "d.1", "d.0"), 6, 2, [[0, 1], [2, 3], [4, 5]]),
    (("a.0", "b.0", "b.1", "a.1"), 4, 2, [[0, 3], [1, 2]]),
    # node ids with dots
    (("n.1.x.0", "n.1.x.1"), 2, 2, [[0, 1]]),
])
def test_hsdp_layout(members, world, local, layout):
    assert hsdp_layout(members, world, local) == layout


@pytest.mark.parametrize("members, world, local, why", [
    ((), 5, 2, "not nodes of 2"),
    (("a.0", "a.1", "b.0"), 3, 2, "not nodes of 2"),
    (("a.0", "a.1", "b.0", "c.0"), 4, 2, "'b' has 1 of its 2 workers"),
    (("a.0", "a.1", "a.2", "b.0"), 4, 2, "'a' has 3 of its 2 workers"),
    (("a", "b"), 2, 1, "not named"),
    (("a.0",), 2, 1, "lists 1 workers"),
])
def test_hsdp_layout_refuses_a_generation_that_is_not_whole_nodes(members, world, local, why):
    with pytest.raises(LayoutError, match=why.replace("[", r"\[").replace("]", r"\]")):
        hsdp_layout(members, world, local)
