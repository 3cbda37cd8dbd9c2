"""A sharded model's mesh is its generation's: torch's DTensor caches key on DeviceMesh
equality, which ignores the process groups, and used to hand a re-wrapped module the equal mesh of
an earlier generation, whose group names no longer resolve ("Could not resolve the process group
registered under the name N") or resolve to another group. The check, table-driven (the real gloo
workers are in tests/process/test_mesh_generations.py)."""

from __future__ import annotations

import pytest
import torch

from elasticctl.train.sharding.shards import MeshError, ranks_along, stale_dims

@pytest.mark.parametrize(("mesh", "rank", "along"), [
    ([[0, 1], [2, 3]], 0, [[0, 2], [0, 1]]),
    ([[0, 1], [2, 3]], 3, [[1, 3], [2, 3]]),
    ([[0, 2], [1, 3], [4, 5]], 1, [[0, 1, 4], [1, 3]]),  # a node's ranks need not be adjacent
    ([[0, 1]], 1, [[1], [0, 1]]),                         # one node: replicas of one
    ([0, 1, 2], 2, [[0, 1, 2]]),                          # FSDP over every worker
])
def test_ranks_along_each_dimension(mesh, rank, along):
    assert ranks_along(torch.tensor(mesh), rank) == along


@pytest.mark.parametrize(("mesh", "rank"), [([[0, 1], [2, 3]], 4), ([[0, 1], [1, 3]], 1)])
def test_a_rank_not_once_in_the_mesh_is_an_error(mesh, rank):
    with pytest.raises(MeshError, match=f"Rank {rank} is"):
        ranks_along(torch.tensor(mesh), rank)


@pytest.mark.parametrize(("expected", "resolved", "stale"), [
    ([[0, 2], [0, 1]], [[0, 2], [0, 1]], []),
    ([[0, 2], [0, 1]], [[0, 2], None], [1]),         # a name of an earlier generation: unresolvable
    ([[1, 3], [2, 3]], [[0, 2], [2, 3]], [0]),       # ... or another group of this one
    ([[0, 1, 2]], [None], [0]),
])
def test_stale_dims(expected, resolved, stale):
    assert stale_dims(expected, resolved) == stale
