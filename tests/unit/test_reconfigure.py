"""The pure choices of elasticctl.train.groups.reconfigure: whether a hot-mode worker reconfigures one
process group in place or builds one per generation, and what it takes from a peer as a handle.
What torch does underneath is pinned in tests/process/test_torch_reconfigure.py."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticctl.errors import ConfigError
from elasticctl.job.environment import REBUILD_GROUPS, rebuild_groups
from elasticctl.train.groups import reconfigure
from elasticctl.train.groups.reconfigure import (
    MAX_HANDLE_BYTES,
    GroupStrategy,
    checked_handle,
    group_strategy,
    is_collective_timeout,
    torch_can_reconfigure,
)

R, B = GroupStrategy.RECONFIGURE, GroupStrategy.REBUILD


@pytest.mark.parametrize(("backend", "torch_can", "sharded", "default_wrap", "forced", "kept", "expected", "why"), [
    ("gloo", True, False, True, False, False, R, "gloo"),
    ("cpu:gloo", True, False, True, False, False, R, "gloo"),
    ("gloo", False, False, True, False, False, B, "cannot reconfigure"),
    ("nccl", True, False, True, False, False, B, "not pinned"),
    ("cpu:gloo,cuda:nccl", True, False, True, False, False, B, "not pinned"),
    ("gloo", True, True, False, False, False, B, "its own mesh"),         # sharded=True
    ("gloo", True, True, False, False, True, R, "HSDP mesh, kept"),       # sharded="hsdp"
    ("gloo", False, True, False, False, True, B, "cannot reconfigure"),
    ("nccl", True, True, False, False, True, B, "not pinned"),
    ("gloo", True, True, False, True, True, B, "asked for"),
    ("gloo", True, False, False, False, False, B, "wraps the model itself"),
    ("gloo", True, False, True, True, False, B, "asked for"),
])
def test_which_workers_reconfigure(backend, torch_can, sharded, default_wrap, forced, kept, expected, why):
    choice = group_strategy(backend, torch_can, sharded=sharded, default_wrap=default_wrap, forced_rebuild=forced,
                            kept_mesh=kept)
    assert choice.strategy is expected and why in choice.why


@pytest.mark.parametrize(("message", "timed_out"), [
    ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 4000ms for recv operation "
     "to complete", True),
    ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:133] Timed out waiting 60000ms for send operation "
     "to complete", True),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41234", False),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:5555: Connection reset by peer",
     False),
    ("The sharded model's mesh does not name this generation's process groups", False),
    ("", False),
])
def test_a_collective_timeout_is_told_from_a_lost_peer(message, timed_out):
    assert is_collective_timeout(RuntimeError(message)) is timed_out


def test_this_torch_can_reconfigure():
    # The torch the project pins has it; a torch without it is refused nothing, it rebuilds.
    assert torch_can_reconfigure()


@pytest.mark.parametrize("handle", ["gloo:0:5:0:", "gloo:1:1099511627776:0:127.0.0.1:2379", "x" * MAX_HANDLE_BYTES])
def test_handles_as_torch_writes_them_are_taken(handle):
    assert checked_handle(handle) == handle


@pytest.mark.parametrize("handle", ["", "x" * (MAX_HANDLE_BYTES + 1), "gloo:0 5", "gloo:\n", "gl\u00f6o", None, b"gloo"])
def test_anything_else_is_refused(handle):
    with pytest.raises(ValueError):
        checked_handle(handle)


@given(st.text(max_size=64))
def test_any_text_is_a_handle_only_if_printable_ascii(text):
    try:
        assert checked_handle(text) == text
    except ValueError:
        assert not text or not all(0x21 <= ord(c) <= 0x7e for c in text)
    else:
        assert text and all(0x21 <= ord(c) <= 0x7e for c in text)


@pytest.mark.parametrize(("value", "expected"), [("", False), ("0", False), ("1", True)])
def test_rebuild_groups_reads_0_or_1(value, expected):
    assert rebuild_groups({REBUILD_GROUPS: value}) is expected


@pytest.mark.parametrize("value", ["yes", "2", " 1", "１"])
def test_rebuild_groups_refuses_anything_else_naming_it(value):
    with pytest.raises(ConfigError, match=REBUILD_GROUPS):
        rebuild_groups({REBUILD_GROUPS: value})


# -- a sharded model's mesh groups ---------------------------------------------------------------


@pytest.mark.parametrize(("rows", "rank", "replicate", "shard"), [
    ([[0, 1], [2, 3], [4, 5]], 0, (0, [0, 2, 4]), (0, [0, 1])),
    ([[0, 1], [2, 3], [4, 5]], 3, (1, [1, 3, 5]), (1, [2, 3])),
    ([[0, 1], [2, 3], [4, 5]], 5, (1, [1, 3, 5]), (2, [4, 5])),
    ([[2, 3], [0, 1]], 0, (0, [2, 0]), (1, [0, 1])),  # rows in node order, whatever their ranks
    ([[0], [1], [2]], 1, (0, [0, 1, 2]), (1, [1])),    # one worker per node: shard groups of one
    ([[0, 1, 2, 3]], 2, (2, [2]), (0, [0, 1, 2, 3])),  # one node: replicate groups of one
])
def test_mesh_group_members(rows, rank, replicate, shard):
    members = reconfigure.mesh_group_members(rows, rank)
    assert members == {reconfigure.MeshDim.REPLICATE: replicate, reconfigure.MeshDim.SHARD: shard}


@pytest.mark.parametrize(("rows", "rank"), [
    ([[0, 1], [2, 3]], 4),          # not in the mesh
    ([[0, 1], [1, 2]], 1),          # twice
    ([[0, 1], [2]], 0),             # ragged rows
])
def test_mesh_group_members_refuses_a_rank_not_once_in_even_rows(rows, rank):
    with pytest.raises(ValueError, match="not once in the mesh rows"):
        reconfigure.mesh_group_members(rows, rank)


def test_mesh_group_uuids_are_fresh_per_generation_and_group_and_never_a_generations_own():
    uuids = [reconfigure.mesh_group_uuid(generation, dim, index)
             for generation in range(50) for dim in reconfigure.MeshDim for index in range(8)]
    assert len(set(uuids)) == len(uuids)
    assert min(uuids) > 2**31  # a generation's number (the world group's uuid) stays far below
    assert max(uuids) < reconfigure._SOLO_UUIDS[0]  # and a worker's group of one far above


@pytest.mark.parametrize(("generation", "index"), [(-1, 0), (0, -1), (0, reconfigure.MAX_MESH_GROUPS), (1 << 40, 0)])
def test_mesh_group_uuid_refuses_what_it_cannot_number(generation, index):
    with pytest.raises(ValueError):
        reconfigure.mesh_group_uuid(generation, reconfigure.MeshDim.SHARD, index)
