"""A sharded model's mesh is its generation's, with two real gloo worker processes that
swap ranks between two generations of one mesh shape, with a refused layout between them (the
check itself is table-tested in tests/unit/test_mesh_generations.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from support.helpers import REPO

WORKER = str(REPO / "tests" / "support" / "workers" / "mesh_generations.py")


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
