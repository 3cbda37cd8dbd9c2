"""The worker library in real torchrun processes (etcd3 rendezvous, CPU/gloo, loopback): the mlp trainer
loses a node, is told to leave, is killed mid-save, finds a corrupt checkpoint, and always resumes
from the newest complete checkpoint without repeating or skipping a sample of the epoch.

Layer tests/unit: no etcd, no processes. The other tests of this subject:
tests/contract/test_worker_progress.py, tests/process/test_worker.py.
"""

from __future__ import annotations

import pytest


pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("policy", "world", "expected"), [
    ("linear", 1, (0.1, 32, 1)),
    ("linear", 3, (pytest.approx(0.3), 32, 1)),
    ("constant-batch", 2, (0.1, 32, 1)),   # global 64 = 32 x 2
    ("constant-batch", 1, (0.1, 32, 2)),   # the lone survivor accumulates two micro-batches
    ("constant-batch", 3, (0.1, 22, 1)),   # 64 over 3 workers: rounded up to 66
])
def test_lr_policy_plans_lr_and_batching_for_the_world_size(policy, world, expected):
    from elasticctl.train.script import plan_batches

    plan = plan_batches(policy, base_lr=0.1, batch_size=32, world_size=world, global_batch=64)
    assert (plan.lr, plan.micro_batch, plan.accumulation) == expected
    if policy == "constant-batch":
        assert 64 <= plan.global_batch(world) < 64 + world
