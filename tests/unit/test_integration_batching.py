"""The batch policy of the framework integrations (elasticctl/integrations/batching.py): what one
start at a world size trains with, the line it prints, and what a checkpoint's saved scale and
global batch may be.

Layer tests/unit: no etcd, no processes, no framework. The other tests of this subject:
tests/unit/test_lightning_contract.py and tests/unit/test_huggingface_contract.py (each Trainer
applying it), tests/process/test_frameworks.py (through a kill and a join).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from elasticctl.errors import ConfigError
from elasticctl.integrations import batching


@pytest.mark.parametrize(("policy", "world", "global_batch", "expected"), [
    # policy, world, global batch asked: (micro-batch, accumulation, LR scale, global batch made)
    ("framework", 1, None, (8, 2, 1.0, 16)),
    ("framework", 3, None, (8, 2, 1.0, 48)),        # the framework's: the global batch follows the world
    ("linear", 1, None, (8, 2, 1.0, 16)),
    ("linear", 4, None, (8, 2, 4.0, 64)),           # the LR follows it too
    ("constant-batch", 2, 32, (8, 2, 1.0, 32)),     # 32 = 8 x 2 x 2, as configured
    ("constant-batch", 1, 32, (8, 4, 1.0, 32)),     # the lone survivor accumulates twice as much
    ("constant-batch", 4, 32, (8, 1, 1.0, 32)),
    ("constant-batch", 3, 32, (6, 2, 1.0, 36)),     # 32 over 3: rounded up to 36
    ("constant-batch", 64, 32, (1, 1, 1.0, 64)),    # more workers than samples: one each
    ("constant-batch", 2, None, (8, 2, 1.0, 32)),   # none asked: what this (first) start makes
])
def test_a_policy_plans_each_worlds_batching(policy, world, global_batch, expected):
    plan = batching.plan(policy, world_size=world, batch_size=8, accumulation=2, global_batch=global_batch)
    assert (plan.micro_batch, plan.accumulation, plan.lr_scale, plan.global_batch) == expected
    assert plan.asked == (global_batch or 32 if policy == "constant-batch" else None)


@pytest.mark.parametrize(("policy", "world", "global_batch", "line"), [
    ("framework", 2, None, "batch policy 'framework': global batch 32 (8 per worker x 2 accumulated x 2 workers), "
                           "the learning rate as configured"),
    ("linear", 3, None, "batch policy 'linear': global batch 48 (8 per worker x 2 accumulated x 3 workers), "
                        "the learning rate x3 (the configured one is one worker's)"),
    ("constant-batch", 3, 32, "batch policy 'constant-batch': global batch 36 (6 per worker x 2 accumulated x "
                              "3 workers, 32 asked: rounded up to what 3 workers make), the learning rate as configured"),
    ("constant-batch", 1, 32, "batch policy 'constant-batch': global batch 32 (8 per worker x 4 accumulated x "
                              "1 worker), the learning rate as configured"),
])
def test_the_line_printed_once_per_start_says_what_was_chosen(policy, world, global_batch, line):
    plan = batching.plan(policy, world_size=world, batch_size=8, accumulation=2, global_batch=global_batch)
    assert plan.describe() == line


@pytest.mark.parametrize(("policy", "global_batch", "named"), [
    ("sqrt", None, "'sqrt'"),
    ("", None, "''"),
    ("constant-batch", 0, "(0)"),
    ("constant-batch", 2.5, "(2.5)"),
    ("constant-batch", True, "(True)"),
    ("linear", 64, "(64)"),          # a global batch only constant-batch holds
    ("framework", 64, "(64)"),
])
def test_a_bad_policy_or_global_batch_is_named_in_one_sentence(policy, global_batch, named):
    with pytest.raises(ConfigError) as refused:
        batching.check_policy(policy, global_batch)
    message = str(refused.value)
    assert named in message and message.endswith(".") and "\n" not in message


@pytest.mark.parametrize(("world", "batch_size", "accumulation"), [(0, 8, 1), (2, 0, 1), (2, 8, 0)])
def test_a_world_or_batch_that_trains_nothing_is_refused(world, batch_size, accumulation):
    with pytest.raises(ConfigError, match="trains nothing"):
        batching.plan("framework", world_size=world, batch_size=batch_size, accumulation=accumulation,
                      global_batch=None)


def test_rescale_moves_each_groups_rate_and_each_schedulers_base_rates():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD([{"params": [model.weight], "lr": 0.1}, {"params": [model.bias], "lr": 0.2}])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    batching.rescale_lr([optimizer], [scheduler], 3.0)
    assert [g["lr"] for g in optimizer.param_groups] == [pytest.approx(0.3), pytest.approx(0.6)]
    assert [g["initial_lr"] for g in optimizer.param_groups] == [pytest.approx(0.3), pytest.approx(0.6)]
    optimizer.step()
    scheduler.step()  # a scheduler sets the rate from its base rates: they moved too
    assert [g["lr"] for g in optimizer.param_groups] == [pytest.approx(0.3), pytest.approx(0.6)]


@given(st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True), st.text(max_size=4),
                 st.lists(st.integers(), max_size=2)))
def test_a_saved_scale_or_global_batch_read_back_is_taken_or_refused(value):
    for read, kind in ((batching.saved_scale, float), (batching.saved_global_batch, int)):
        try:
            taken = read(value)
        except ValueError as exc:
            assert repr(value)[:20] in str(exc) or "is not" in str(exc)
            continue
        assert taken is None and read is batching.saved_global_batch and value is None \
            or isinstance(taken, kind) and taken > 0
