"""The bundled trainers as users run them: cifar10 (FakeData) at world 2 under torchrun, resnet on a
tiny ImageFolder, and one-sentence errors for bad flags."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest
from support.helpers import MLP, REPO, read_records, torchrun_command, wait_for

pytestmark = pytest.mark.slow

CIFAR10 = str(REPO / "trainers" / "cifar10.py")
RESNET = str(REPO / "trainers" / "resnet.py")


def trainer_command(endpoint: str, run_id: str, script: str, args: list[str], nproc: int = 1) -> list[str]:
    command = torchrun_command(endpoint, run_id, "1", args)
    command[command.index(MLP)] = script
    command[command.index("--nproc-per-node=1")] = f"--nproc-per-node={nproc}"
    return command


def events(records: list[dict], name: str) -> list[dict]:
    return [r for r in records if r.get("event") == name]


def test_cifar10_fake_data_trains_two_epochs_at_world_2_and_resumes(default_etcd, run_id, nodes, tmp_path):
    record, ckpt = tmp_path / "record.jsonl", tmp_path / "ckpt"
    args = ["--fake-data", "--fake-size", "256", "--batch-size", "16", "--workers", "0",
            "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3", "--record", str(record)]
    first = nodes("first", trainer_command(default_etcd.endpoint, run_id, CIFAR10, [*args, "--epochs", "2"], nproc=2))
    assert first.wait(180) == 0, first.log()
    epochs = events(read_records(record), "epoch")
    assert [(e["epoch"], e["step"], e["world_size"]) for e in epochs] == [(0, 8, 2), (1, 16, 2)]  # 256/(16*2)
    assert all(0.0 <= e["test_accuracy"] <= 1.0 and e["train_loss"] > 0 for e in epochs)
    assert "test accuracy" in first.log()

    second = nodes("second", trainer_command(default_etcd.endpoint, f"{run_id}-2", CIFAR10, [*args, "--epochs", "3"]))
    assert second.wait(180) == 0, second.log()
    records = read_records(record)
    (resume,) = events(records, "resume")
    assert (resume["step"], resume["epoch"], resume["consumed"], resume["world_size"]) == (16, 2, 0, 1)
    assert [(e["epoch"], e["step"]) for e in events(records, "epoch")][2:] == [(2, 32)]  # 256/16 steps at world 1


def test_cifar10_under_hot_recovery_keeps_the_survivor_training_in_its_process(default_etcd, run_id, nodes,
                                                                                tmp_path):
    from test_orchestrator import Job

    record = tmp_path / "record.jsonl"
    args = [CIFAR10, "--fake-data", "--fake-size", "256", "--batch-size", "8", "--workers", "0", "--epochs", "4",
            "--checkpoint-every", "4"]
    job = Job(nodes, default_etcd, run_id, tmp_path, nnodes="1:2",
              extra=["--recovery", "hot", "--node-ttl", "3", "--checkpoint-dir", str(tmp_path / "ckpt")], train=args)
    started = {"a": job.up("a")}
    wait_for(lambda: events(read_records(record), "start"), 180, "a's worker training")
    started["b"] = job.join("b")
    wait_for(lambda: any(e["world_size"] == 2 for e in events(read_records(record), "epoch")), 180, "an epoch at world 2")
    survivor = next(p for p in psutil.Process(started["a"].process.pid).children(recursive=True)
                    if CIFAR10 in p.cmdline() and not p.children())  # the worker, not torchrun
    started["b"].kill()
    assert started["a"].wait(300) == 0, started["a"].log()
    records = read_records(record)
    assert [e["epoch"] for e in events(records, "epoch")] == [0, 1, 2, 3]  # each once, in order
    (done,) = events(records, "done")
    assert (done["epoch"], done["world_size"], done["pid"]) == (4, 1, survivor.pid), done
    assert not events(records, "resume"), "the survivor never went back to a checkpoint"


def test_resnet18_trains_on_an_image_folder_and_resumes(tmp_path):
    from PIL import Image

    for split in ("train", "val"):
        for label in ("cat", "dog"):
            folder = tmp_path / "images" / split / label
            folder.mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (40, 40), (60 * i, 100 if label == "cat" else 200, 0)).save(folder / f"{i}.png")
    record, ckpt = tmp_path / "record.jsonl", tmp_path / "ckpt"
    args = [sys.executable, RESNET, "--data-dir", str(tmp_path / "images"), "--arch", "resnet18",
            "--image-size", "32", "--batch-size", "4", "--workers", "0", "--checkpoint-dir", str(ckpt),
            "--record", str(record)]
    subprocess.run([*args, "--epochs", "1"], check=True, timeout=180, capture_output=True)
    subprocess.run([*args, "--epochs", "2"], check=True, timeout=180, capture_output=True)
    records = read_records(record)
    assert [e["epoch"] for e in events(records, "epoch")] == [0, 1]
    assert events(records, "resume")[0]["step"] == 2  # 8 images / batch 4


@pytest.mark.parametrize(("script", "args", "message"), [
    (MLP, ["--keep", "0"], "--keep (0) must be at least 1"),
    (MLP, ["--exit-ranks", "x"], "--exit-ranks (x) must be comma-separated integers"),
    (MLP, ["--lr-policy", "cubic"], "invalid choice: 'cubic'"),
    (MLP, ["--checkpoint-dir", "/dev/null/ckpt"], "The checkpoint directory '/dev/null/ckpt' cannot be created"),
    (CIFAR10, ["--fake-data", "--epochs", "0"], "--epochs (0) must be at least 1"),
    (RESNET, ["--data-dir", "/nonexistent-images"], "The image folder '/nonexistent-images/train' cannot be read"),
])
def test_bad_values_are_one_sentence_errors(script, args, message, tmp_path):
    result = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=120, check=False,
                            cwd=tmp_path)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr
