"""A sharded model's mesh is its generation's (issue 20): torch's DTensor caches key on DeviceMesh
equality, which ignores the process groups, and used to hand a re-wrapped module the equal mesh of
an earlier generation, whose group names no longer resolve ("Could not resolve the process group
registered under the name N") or resolve to another group. The check, table-driven; then two real
gloo workers that swap ranks between two generations of one mesh shape, with a refused layout
between them."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
import torch

from support.helpers import REPO

from elasticctl.train.shards import MeshError, ranks_along, stale_dims

WORKER = str(REPO / "tests" / "support" / "workers" / "mesh_generations.py")


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


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def generations(*flags: str) -> list[dict]:
    ports = [str(p) for p in free_ports(3)]
    workers = [subprocess.Popen([sys.executable, WORKER, str(w), *ports, *flags], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for w in (0, 1)]
    lines = []
    for worker in workers:
        out, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, err[-2000:]
        lines += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return lines


def test_workers_that_swap_ranks_train_on_their_own_generations_mesh():
    """A refused layout fails its generation on every worker, and leaves nothing the next one meets."""
    lines = generations()
    assert sorted((r["generation"], r["rank"], r.get("shard"), r.get("error")) for r in lines) == [
        (1, 0, 0, None), (1, 1, 1, None), (2, 0, None, "LayoutError"), (2, 1, None, "LayoutError"),
        (3, 0, 0, None), (3, 1, 1, None)], lines


def test_a_stale_mesh_fails_its_generation_cleanly():
    """Without emptying torch's caches the re-wrapped module would get generation 1's mesh: the guard
    refuses it with a MeshError (a generation that fails to form is formed again), never a
    traceback from torch's group lookup or a step on another group."""
    third = [r for r in generations("--keep-caches") if r["generation"] == 3]
    assert [r.get("error") for r in third] == ["MeshError", "MeshError"], third
    assert all("earlier generation" in r["message"] for r in third), third
