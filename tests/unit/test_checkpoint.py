"""Checkpointer in one process: round trip, keep-N, async snapshots, atomicity, fallback on corruption.

Layer tests/unit: no etcd, no processes. The other tests of this subject:
tests/process/test_checkpoint_sigkill.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random

import pytest
import torch
from support.checkpoints import CreatesAFile, make_state, sharded_state, write_manifest
from torch import nn

from elasticctl.train import checkpoint
from elasticctl.train.checkpoints import sharded as sharded_checkpoint
from elasticctl.train.checkpoint import (
    Checkpointer,
    CheckpointError,
    ShardedCheckpointer,
    check_directory,
)
from elasticctl.errors import ConfigError


def test_round_trip_restores_everything_and_the_random_streams(tmp_path):
    saved = make_state()
    ckpt = Checkpointer(tmp_path, keep=2)
    ckpt.save(7, epoch=3, extra={"note": "x"}, **saved)
    expected_rand, expected_py = torch.rand(3), random.random()

    fresh = make_state(seed=1)
    restored = Checkpointer(tmp_path).restore(**fresh)
    assert (restored.step, restored.epoch, restored.extra, restored.world_size) == (7, 3, {"note": "x"}, 1)
    for a, b in zip(saved["model"].parameters(), fresh["model"].parameters()):
        assert torch.equal(a, b)
    assert fresh["optimizer"].state_dict()["state"][0]["exp_avg"].equal(saved["optimizer"].state_dict()["state"][0]["exp_avg"])
    assert fresh["scheduler"].last_epoch == 1 and fresh["optimizer"].param_groups[0]["lr"] == pytest.approx(0.005)
    assert fresh["sampler"].consumed == 30
    assert torch.equal(torch.rand(3), expected_rand) and random.random() == expected_py


def test_keeps_the_newest_n(tmp_path):
    state = make_state()
    ckpt = Checkpointer(tmp_path, keep=3)
    for step in range(1, 7):
        ckpt.save(step, **state)
    assert [s for s, _ in ckpt.checkpoints()] == [6, 5, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"step-{s:08d}.pt{suffix}" for s in (4, 5, 6) for suffix in ("", ".sha256"))


def test_async_save_writes_the_snapshot_taken_at_save_time(tmp_path):
    model = nn.Linear(512, 512)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = Checkpointer(tmp_path, async_save=True)
    ckpt.save(1, model=model)
    with torch.no_grad():  # training goes on while the background thread writes
        model.weight.add_(1.0)
    ckpt.save(2, model=model)  # waits for save 1: at most one write in flight
    assert [s for s, _ in ckpt.checkpoints()][-1] == 1
    ckpt.close()
    assert not ckpt.saving and ckpt.last_step == 2
    first = ckpt.read(tmp_path / "step-00000001.pt")["state"]["model"]
    assert torch.equal(first["weight"], at_save["weight"])
    assert torch.equal(ckpt.read(tmp_path / "step-00000002.pt")["state"]["model"]["weight"], at_save["weight"] + 1)


def test_a_failed_background_write_is_reported(tmp_path):
    directory = tmp_path / "ckpt"
    ckpt = Checkpointer(directory, async_save=True)
    directory.rmdir()  # the storage went away
    ckpt.save(1, model=nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match="step 1"):
        ckpt.wait()


@pytest.mark.parametrize("damage", ["truncate", "flip-a-byte", "garbage", "empty", "no-digest"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, caplog, damage):
    state = make_state()
    ckpt = Checkpointer(tmp_path, keep=3)
    ckpt.save(1, **state)
    ckpt.save(2, **state)
    newest = tmp_path / "step-00000002.pt"
    data = newest.read_bytes()
    if damage == "truncate":
        newest.write_bytes(data[: len(data) // 2])
    elif damage == "flip-a-byte":  # inside tensor data, which torch's zip reader does not check
        at = data.find(state["model"][0].weight.detach().numpy().tobytes())
        assert at > 0
        newest.write_bytes(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:])
    elif damage == "garbage":
        newest.write_bytes(os.urandom(len(data)))
    elif damage == "empty":
        newest.write_bytes(b"")
    else:
        (tmp_path / "step-00000002.pt.sha256").unlink()
    with caplog.at_level(logging.WARNING, logger="elasticctl.train.checkpoint"):
        restored = Checkpointer(tmp_path).restore(**make_state(seed=1))
    assert restored.step == 1
    # what the framework integrations resume from (verified without loading the tensors): the same
    assert Checkpointer(tmp_path).newest() == tmp_path / "step-00000001.pt"
    if damage != "no-digest":  # without its digest the file never counted as a checkpoint
        assert "Skipping checkpoint" in caplog.text and "step-00000002.pt" in caplog.text


def test_no_checkpoint_means_nothing_restored(tmp_path):
    assert Checkpointer(tmp_path).restore(**make_state()) is None


def test_temp_files_are_ignored_and_only_stale_ones_removed(tmp_path):
    Checkpointer(tmp_path).save(3, model=nn.Linear(2, 2))
    killed, in_progress = tmp_path / ".tmp-step-00000004.pt.123", tmp_path / ".tmp-step-00000005.pt.456"
    killed.write_bytes(b"partial")
    in_progress.write_bytes(b"partial")
    os.utime(killed, (0, 0))
    ckpt = Checkpointer(tmp_path)
    assert list(tmp_path.glob(".tmp-*")) == [in_progress]
    assert ckpt.restore(model=nn.Linear(2, 2)).step == 3


def test_a_checkpoint_of_another_model_is_a_one_sentence_error(tmp_path):
    Checkpointer(tmp_path).save(1, model=nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match=r"'model' state .* does not fit this run"):
        Checkpointer(tmp_path).restore(model=nn.Linear(3, 2))


def test_bad_directory_and_keep_are_one_sentence_errors(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(ConfigError, match=f"'{a_file / 'sub'}' cannot be created"):
        check_directory(a_file / "sub", writable=True)
    with pytest.raises(ConfigError, match="cannot be created"):
        check_directory(a_file, writable=False)
    with pytest.raises(ConfigError, match=r"keep \(0\)"):
        Checkpointer(tmp_path, keep=0)


def plant(directory, name: str, data: bytes) -> None:
    """A file with a correct digest next to it, as someone with write access could leave it."""
    (directory / name).write_bytes(data)
    (directory / f"{name}.sha256").write_text(hashlib.sha256(data).hexdigest())


def plant_unloadable_checkpoints(directory, marker) -> list[str]:
    """Three files named like newer checkpoints, each with a correct digest, none loadable."""
    evil_zip, not_ours = directory / "evil.zip", directory / "not-ours.zip"
    torch.save({"format": checkpoint.FORMAT, "step": 99999993, "x": CreatesAFile(marker)}, evil_zip)
    torch.save({"format": "someone-elses-format", "step": 99999992}, not_ours)
    names = ["step-99999993.pt", "step-99999992.pt", "step-99999991.pt"]
    plant(directory, names[0], evil_zip.read_bytes())  # the right format; weights_only refuses it
    plant(directory, names[1], not_ours.read_bytes())  # loads, but is not an elasticctl checkpoint
    plant(directory, names[2], pickle.dumps(CreatesAFile(marker)))  # a bare pickle
    evil_zip.unlink()
    not_ours.unlink()
    return names


def test_keep_n_counts_only_loadable_checkpoints_so_planted_files_never_evict_real_ones(
        tmp_path, caplog):
    directory, marker = tmp_path / "ckpt", tmp_path / "code-ran"
    directory.mkdir()
    planted = plant_unloadable_checkpoints(directory, marker)
    state = make_state()
    ckpt = Checkpointer(directory, keep=3)
    with caplog.at_level(logging.WARNING, logger="elasticctl.train.checkpoint"):
        for step in (10, 20, 30):
            ckpt.save(step, **state)
        restored = Checkpointer(directory).restore(**make_state(seed=1))
    assert not marker.exists()
    real = [f"step-{s:08d}.pt" for s in (10, 20, 30)]
    assert all((directory / name).exists() and (directory / f"{name}.sha256").exists()
               for name in real)
    assert all((directory / name).exists() for name in planted)  # left alone, not silently deleted
    assert restored.step == 30
    for name in planted:  # named once by the pruning (not once per save), then skipped by the load
        assert sum(name in r.getMessage() and "not counted towards keep=3" in r.getMessage()
                   for r in caplog.records) == 1


def test_pruning_reads_each_file_once_and_still_keeps_the_newest_n(tmp_path, monkeypatch):
    plant_unloadable_checkpoints(tmp_path, tmp_path / "code-ran")
    read = []
    digest = checkpoint.file_digest
    monkeypatch.setattr(checkpoint, "file_digest",
                        lambda path: read.append(path.name) or digest(path))
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in range(1, 6):
        ckpt.save(step, model=nn.Linear(2, 2))
    assert sorted(read) == ["step-99999991.pt", "step-99999992.pt", "step-99999993.pt"]
    assert [s for s, _ in ckpt.checkpoints() if s < 1000] == [5, 4]


def test_sharded_round_trip_writes_a_manifest_and_keeps_the_newest_n(tmp_path, process_group):
    model, optimizer = sharded_state(0)
    ckpt = ShardedCheckpointer(tmp_path, keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, model, optimizer, extra={"epoch": step})
    assert [s for s, _ in ckpt.checkpoints()] == [3, 2]
    manifest = json.loads((tmp_path / "step-00000003" / sharded_checkpoint.MANIFEST).read_text())
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "extra.json"}
    fresh, fresh_optimizer = sharded_state(1)
    assert ShardedCheckpointer(tmp_path).restore(fresh, fresh_optimizer) == {"step": 3, "epoch": 3}
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("manifest", ["stale", "recomputed"])
def test_a_planted_dcp_metadata_never_runs_and_restore_falls_back(
        tmp_path, process_group, caplog, manifest):
    marker = tmp_path / "code-ran"
    directory = tmp_path / "ckpt"
    model, optimizer = sharded_state(0)
    ckpt = ShardedCheckpointer(directory, keep=3)
    ckpt.save(1, model, optimizer, extra={"epoch": 1})
    ckpt.save(2, model, optimizer, extra={"epoch": 2})
    for step, expected in ((2, {"step": 1, "epoch": 1}), (1, None)):
        tampered = directory / f"step-{step:08d}"
        (tampered / ".metadata").write_bytes(pickle.dumps(CreatesAFile(marker)))
        if manifest == "recomputed":
            write_manifest(tampered)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="elasticctl.train.checkpoint"):
            restored = ShardedCheckpointer(directory).restore(*sharded_state(1))
        assert not marker.exists()
        assert restored == expected
        reason = "does not match" if manifest == "stale" else "io.open"
        assert any(str(tampered) in r.getMessage() and reason in r.getMessage()
                   for r in caplog.records)
    assert ShardedCheckpointer(directory).checkpoints() == []


def test_dcp_metadata_swapped_after_verification_is_still_refused_by_the_reader(
        tmp_path, process_group, monkeypatch):
    marker = tmp_path / "code-ran"
    model, optimizer = sharded_state(0)
    ShardedCheckpointer(tmp_path / "ckpt", keep=3).save(1, model, optimizer)
    verify = sharded_checkpoint._verify_sharded

    def verify_then_swap(directory, digests=None):  # the file changes between check and use
        extra = verify(directory, digests)
        (directory / ".metadata").write_bytes(pickle.dumps(CreatesAFile(marker)))
        return extra

    monkeypatch.setattr(sharded_checkpoint, "_verify_sharded", verify_then_swap)
    with pytest.raises(CheckpointError, match=r"step-00000001' failed on rank 0: .*io\.open"):
        ShardedCheckpointer(tmp_path / "ckpt").restore(*sharded_state(1))
    assert not marker.exists()


def test_non_tensor_values_in_shards_load_weights_only(tmp_path, process_group):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    marker = tmp_path / "code-ran"
    model, optimizer = sharded_state(0)
    directory = tmp_path / "ckpt"
    ShardedCheckpointer(directory).save(1, model, optimizer, extra={"epoch": 1})
    # Rewrite the shards with a hyperparameter that runs code when unpickled unrestricted.
    model_state, optim_state = get_state_dict(model, optimizer)
    optim_state["param_groups"][0]["lr"] = CreatesAFile(marker)
    planted = directory / "step-00000001"
    for path in planted.iterdir():
        path.unlink()
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(planted))
    (planted / "extra.json").write_text(json.dumps({"step": 1}))
    write_manifest(planted)
    with pytest.raises(CheckpointError,
                       match=r"'optim.param_groups.0.lr' .* weights_only=True: .*io\.open"):
        ShardedCheckpointer(directory).restore(*sharded_state(1))
    assert not marker.exists()


def test_a_sharded_save_killed_before_its_rename_leaves_nothing_the_next_save_keeps(
        tmp_path, process_group):
    leftover = tmp_path / ".tmp-step-00000002"
    leftover.mkdir()
    for name in ("manifest.json", ".tmp-manifest.json.123", "__9_0.distcp"):
        (leftover / name).write_text("from a killed save")
    ckpt = ShardedCheckpointer(tmp_path)
    ckpt.save(2, *sharded_state(0))
    assert ckpt.checkpoints() == [(2, tmp_path / "step-00000002")]
    assert sorted(p.name for p in (tmp_path / "step-00000002").iterdir()) == [
        ".metadata", "__0_0.distcp", "extra.json", "manifest.json"]
