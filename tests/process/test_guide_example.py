"""The guide's example scripts run to their last step, every way their pages say.

docs/examples/train.py (the "Writing a trainer" page's first code block as written: its sampler
built at module level), docs/examples/train_sharded.py (its sharded block: HSDP over each
generation's mesh) and docs/examples/resumable_ddp.py (the porting page's script with a loop of
its own, restart mode).

Each run ends with a final checkpoint (the runtime writes one when training ends): its step is
the script's last, and its sampler's position tells at which world size the sampler dealt. With
two workers, 6 steps of 32 samples each at world 2 are 1.5 epochs of the 256 samples: epoch 1,
128 consumed. A sampler left at a world of one would have advanced 32 a step: epoch 0, 192.
"""

from __future__ import annotations

import sys

import pytest
import torch
from support.helpers import ELASTICCTL, REPO

pytestmark = pytest.mark.slow

EXAMPLE = str(REPO / "docs" / "examples" / "train.py")
SHARDED = str(REPO / "docs" / "examples" / "train_sharded.py")
RESUMABLE_DDP = str(REPO / "docs" / "examples" / "resumable_ddp.py")
STEPS = 6  # the examples' `steps`


def final_checkpoint(directory) -> dict:
    """What the run's final checkpoint says: step, world size, the sampler's position."""
    files = sorted(directory.glob("step-*.pt"))
    assert files, f"no checkpoint in {directory}"
    saved = torch.load(files[-1], weights_only=True)
    return {"step": saved["step"], "world_size": saved["world_size"], "sampler": saved["state"]["sampler"]}


def position(world: int) -> dict:
    consumed = STEPS * 32 * world
    return {"epoch": consumed // 256, "consumed": consumed % 256, "seed": 0, "dataset_size": 256}


def test_python_train_py_is_a_world_of_one(nodes, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    node = nodes("python", [sys.executable, EXAMPLE], env={"ELASTICCTL_CHECKPOINT_DIR": str(checkpoints)})
    assert node.wait(120) == 0, node.log()
    assert final_checkpoint(checkpoints) == {"step": STEPS, "world_size": 1, "sampler": position(1)}


@pytest.mark.parametrize("recovery", ["restart", "hot"])
def test_elasticctl_up(nodes, default_etcd, run_id, tmp_path, recovery):
    checkpoints = tmp_path / "checkpoints"
    node = nodes("up", [*ELASTICCTL, "up", "--etcd", default_etcd.endpoint, "--job", run_id, "--nnodes", "1",
                        "--nproc-per-node", "2", "--recovery", recovery, "--checkpoint-dir", str(checkpoints),
                        EXAMPLE])
    assert node.wait(180) == 0, node.log()
    assert "Traceback" not in node.log(), node.log()
    assert final_checkpoint(checkpoints) == {"step": STEPS, "world_size": 2, "sampler": position(2)}


def test_plain_torchrun_with_the_etcd3_rendezvous(nodes, default_etcd, run_id, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
               "--rdzv-backend=etcd3", f"--rdzv-endpoint={default_etcd.endpoint}", f"--rdzv-id={run_id}",
               "--rdzv-conf=last_call_timeout=1", "--max-restarts=0", "--monitor-interval=0.5",
               "--local-addr=127.0.0.1", EXAMPLE]
    node = nodes("torchrun", command, env={"ELASTICCTL_CHECKPOINT_DIR": str(checkpoints)})
    assert node.wait(180) == 0, node.log()
    assert "Traceback" not in node.log(), node.log()
    assert final_checkpoint(checkpoints) == {"step": STEPS, "world_size": 2, "sampler": position(2)}


def sharded_checkpoints(directory) -> list[str]:
    """The complete sharded checkpoints of a run (a step's directory appears only once whole)."""
    return sorted(path.name for path in directory.glob("step-*") if path.is_dir())


def test_python_train_sharded_py_is_a_world_of_one(nodes, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    node = nodes("python", [sys.executable, SHARDED], env={"ELASTICCTL_CHECKPOINT_DIR": str(checkpoints)})
    assert node.wait(120) == 0, node.log()
    assert sharded_checkpoints(checkpoints)[-1:] == [f"step-{STEPS:08d}"], node.log()


@pytest.mark.parametrize("recovery", ["restart", "hot"])
def test_train_sharded_py_under_elasticctl_up(nodes, default_etcd, run_id, tmp_path, recovery):
    checkpoints = tmp_path / "checkpoints"
    node = nodes("up", [*ELASTICCTL, "up", "--etcd", default_etcd.endpoint, "--job", run_id, "--nnodes", "1",
                        "--nproc-per-node", "2", "--recovery", recovery, "--checkpoint-dir", str(checkpoints),
                        SHARDED])
    assert node.wait(180) == 0, node.log()
    assert "Traceback" not in node.log(), node.log()
    assert sharded_checkpoints(checkpoints)[-1:] == [f"step-{STEPS:08d}"], node.log()


def test_python_resumable_ddp_py_is_a_world_of_one(nodes, tmp_path):
    """256 samples in batches of 32 are 8 steps an epoch at world 1, 2 epochs: 16 steps."""
    checkpoints = tmp_path / "checkpoints"
    node = nodes("python", [sys.executable, RESUMABLE_DDP, "--checkpoint-every", "4", "--checkpoint-dir",
                            str(checkpoints)])
    assert node.wait(120) == 0, node.log()
    assert final_checkpoint(checkpoints)["step"] == 16 and final_checkpoint(checkpoints)["world_size"] == 1


def test_resumable_ddp_py_under_elasticctl_up_and_again_resumes_where_it_ended(nodes, default_etcd, run_id,
                                                                               tmp_path):
    """At world 2 an epoch is 4 steps: 2 epochs are 8, checkpointed every 2. Started again, the
    script resumes at step 8, its epochs done: it trains no step and writes no checkpoint (one
    that started from 0 would write steps 2 to 8 again)."""
    checkpoints = tmp_path / "checkpoints"

    def run(name):
        node = nodes(name, [*ELASTICCTL, "up", "--etcd", default_etcd.endpoint, "--job", f"{run_id}-{name}",
                            "--nnodes", "1", "--nproc-per-node", "2", "--checkpoint-dir", str(checkpoints),
                            RESUMABLE_DDP, "--epochs", "2", "--checkpoint-every", "2"])
        assert node.wait(180) == 0, node.log()
        assert "Traceback" not in node.log(), node.log()
        return {path.name: path.stat().st_mtime_ns for path in checkpoints.glob("step-*.pt")}

    written = run("first")
    assert final_checkpoint(checkpoints)["step"] == 8 and final_checkpoint(checkpoints)["world_size"] == 2, written
    assert run("again") == written, "the second start wrote checkpoints: it did not resume at step 8"
