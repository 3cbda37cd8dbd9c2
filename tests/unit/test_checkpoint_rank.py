"""A Checkpointer a script builds before its process group exists (at module level, under
torchrun) writes on rank 0 only: its rank is the one torchrun handed the worker, which the group
will have. (A module of its own: test_checkpoint.py's process-group fixture outlives its tests.)"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from elasticctl.train.checkpoint import Checkpointer
from elasticctl.train.checkpoints.files import process_rank


@pytest.mark.parametrize(("group_rank", "environ", "rank"), [
    (None, {}, 0),               # python train.py: a world of one
    (None, {"RANK": "3"}, 3),    # built before init_process_group under torchrun: the rank to come
    (2, {"RANK": "3"}, 2),       # the group's, once there is one (hot mode renumbers generations)
    (0, {}, 0),
    (None, {"RANK": "x"}, 0),
    (None, {"RANK": "-1"}, 0),
])
def test_process_rank(group_rank, environ, rank):
    assert process_rank(group_rank, environ) == rank


def test_a_checkpointer_built_before_the_process_group_writes_only_on_rank_0(tmp_path, monkeypatch):
    assert not dist.is_initialized()
    monkeypatch.setenv("RANK", "1")
    assert not Checkpointer(tmp_path).is_writer
    monkeypatch.setenv("RANK", "0")
    assert Checkpointer(tmp_path).is_writer
