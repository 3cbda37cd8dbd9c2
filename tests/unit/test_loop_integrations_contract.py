"""What the hot-mode loop integrations rely on in Lightning Fabric and accelerate, pinned in this
process: each generation's Fabric or Accelerator, made after the runtime formed the
generation's default process group, wraps the model in DDP on that group, with that
generation's ranks and size, although torchrun's RANK and WORLD_SIZE say otherwise; a second
generation in the same process gets its own, not the first one's.

Layer tests/unit: no etcd, no processes (a gloo group of one on a HashStore stands for each
generation's). Skipped, saying so, without the framework. The other tests of this subject:
tests/process/test_frameworks.py (each example loop through a kill and a join in hot mode).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elasticctl.errors import ConfigError
from elasticctl.integrations.loops import unwrapped
from elasticctl.train.group import Group


def generation(number: int) -> Group:
    """A generation's default group, as the runtime forms it (here: a world of one)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return Group(number=number, rank=0, world_size=1, local_rank=0, device=torch.device("cpu"),
                 model=torch.nn.Linear(2, 1))


@pytest.fixture
def torchrun_says_otherwise(monkeypatch):
    # the world the workers first started in (torchrun's), not the generation's
    for name, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}.items():
        monkeypatch.setenv(name, value)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_runtime_leaves_the_model_unwrapped_for_the_framework():
    model = torch.nn.Linear(2, 1)
    assert unwrapped(model, None) is model


def test_each_generations_fabric_wraps_in_ddp_on_that_generations_group(torchrun_says_otherwise):
    pytest.importorskip("lightning", reason="Lightning is not installed: pip install 'elasticctl[lightning]'")
    from elasticctl.integrations.fabric import Fabric

    model = torch.nn.Linear(2, 1)
    for number in (1, 2):
        group = generation(number)
        fabric = Fabric(group)
        assert (fabric.world_size, fabric.global_rank, fabric.local_rank) == (1, 0, 0)  # not torchrun's 4 and 3
        wrapped = fabric.setup(model)
        ddp = wrapped._forward_module  # Fabric's module around the strategy's DDP
        assert isinstance(ddp, DistributedDataParallel) and ddp.process_group is dist.group.WORLD
        fabric.backward(wrapped(torch.ones(3, 2)).sum())  # DDP's all-reduce on this generation's group
        assert model.weight.grad is not None
        model.zero_grad()
        del wrapped, ddp, fabric
        dist.destroy_process_group()


def test_each_generations_accelerator_sees_that_generations_world(torchrun_says_otherwise):
    pytest.importorskip("accelerate", reason="accelerate is not installed: pip install 'elasticctl[huggingface]'")
    from accelerate.state import PartialState

    from elasticctl.integrations.accelerate import Accelerator

    model = torch.nn.Linear(2, 1)
    for number in (1, 2):
        group = generation(number)
        if number == 2:  # what the last generation's accelerate read, had it been a world of 5
            PartialState._shared_state.update(num_processes=5, process_index=4)
        accelerator = Accelerator(group)
        # accelerate's process-wide state was read again, from this generation's group
        assert (accelerator.num_processes, accelerator.process_index) == (1, 0)
        assert accelerator.state.distributed_type.value == "MULTI_CPU"
        prepared = accelerator.prepare(model)
        assert isinstance(prepared, DistributedDataParallel) and prepared.process_group is dist.group.WORLD
        accelerator.backward(prepared(torch.ones(3, 2)).sum())
        assert model.weight.grad is not None
        model.zero_grad()
        del prepared, accelerator
        dist.destroy_process_group()


@pytest.mark.parametrize("framework", ["fabric", "accelerate"])
def test_a_framework_made_without_the_generation_is_named(framework):
    pytest.importorskip("lightning" if framework == "fabric" else "accelerate")
    if framework == "fabric":
        from elasticctl.integrations.fabric import Fabric as Made
    else:
        from elasticctl.integrations.accelerate import Accelerator as Made
    with pytest.raises(ConfigError, match=r"not a str\.$"):
        Made("cpu")
