"""What elasticctl's Lightning ``Trainer`` relies on in Lightning, pinned, and its sampler's rules.

elasticctl/integrations/lightning.py puts its sampler where Lightning would put its
``DistributedSampler`` (the data connector's ``_prepare_dataloader``, then Lightning's
``_update_dataloader``), carries the sampler's position in a callback's ``state_dict``, and
counts an epoch's batches as Lightning's loop does after a resume. A Lightning release that
changes any of that fails here, in a world of one in this process, before a job trains a sample
twice.

Layer tests/unit: no etcd, no processes. Skipped, saying so, without Lightning. The other tests
of this subject: tests/process/test_frameworks.py (a job through a kill and a join).
"""

from __future__ import annotations

import logging
import os
import signal

import pytest

pytest.importorskip("lightning", reason="Lightning is not installed: pip install 'elasticctl[lightning]'")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from elasticctl.errors import ConfigError  # noqa: E402
from elasticctl.integrations.lightning import STATE_KEY, EpochSampler, Trainer  # noqa: E402

SAMPLES, BATCH = 48, 4


class Seen(pl.LightningModule):
    """A linear model that remembers the sample indices of every batch it trained."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        index, y = batch
        self.seen.append(index.long().tolist())
        return nn.functional.mse_loss(self.layer(index.float().unsqueeze(1)), y.unsqueeze(1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def loader(**kwargs) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(SAMPLES), torch.zeros(SAMPLES)), batch_size=BATCH, shuffle=True,
                      **kwargs)


def trainer(directory, **kwargs) -> Trainer:
    return Trainer(checkpoint_dir=str(directory), accelerator="cpu", enable_progress_bar=False, logger=False,
                   enable_model_summary=False, default_root_dir=str(directory / "lightning"), **kwargs)


@pytest.fixture(autouse=True)
def quiet():
    """Quiet for this file's tests only: a level left behind would hide other tests' log records."""
    theirs = logging.getLogger("lightning.pytorch")
    level = theirs.level
    theirs.setLevel(logging.ERROR)
    yield
    theirs.setLevel(level)


def test_the_training_loader_deals_from_the_elastic_sampler_and_its_batches_are_the_ones_trained(tmp_path):
    run = trainer(tmp_path, max_steps=5, checkpoint_every=0)
    model = Seen()
    run.fit(model, loader())
    sampler = run.train_dataloader.sampler
    assert isinstance(sampler, EpochSampler)  # Lightning's _prepare_dataloader and _update_dataloader
    assert run.train_dataloader.batch_size == BATCH  # the user's loader, its sampler replaced
    permutation = sampler.permutation()
    assert model.seen == [permutation[i * BATCH:(i + 1) * BATCH] for i in range(5)]
    assert sampler.consumed == 5 * BATCH


def test_a_fit_resumes_from_the_newest_checkpoint_at_the_sample_it_stopped_at(tmp_path):
    first = trainer(tmp_path, max_steps=4, checkpoint_every=3)
    first.fit(Seen(), loader())
    assert sorted(p.name for p in tmp_path.glob("step-*.pt")) == ["step-00000003.pt", "step-00000004.pt"]
    (tmp_path / "step-00000004.pt.sha256").unlink()  # as if killed before the end: step 3 is the newest
    assert not (tmp_path / "lightning").exists()  # no second copy from Lightning's default ModelCheckpoint

    model = Seen()
    second = trainer(tmp_path, max_epochs=1, checkpoint_every=0)
    second.fit(model, loader())  # no ckpt_path: the newest checkpoint, step 3
    permutation = second.train_dataloader.sampler.permutation()
    # Lightning restored the callback's state (the position) before it asked for the loader,
    # and its loop, counting on from 3 batches, ends the epoch where the sampler runs out: the
    # 36 samples after the 3rd batch, each once (fewer batches before than after the resume, so
    # a length without them would end the epoch 3 batches early).
    assert [i for batch in model.seen for i in batch] == permutation[3 * BATCH:]
    assert second.global_step == SAMPLES // BATCH


def test_the_position_is_a_callback_state_in_lightnings_checkpoint(tmp_path):
    trainer(tmp_path, max_steps=3, checkpoint_every=0).fit(Seen(), loader())  # the one as training ends
    saved = torch.load(tmp_path / "step-00000003.pt", weights_only=True)
    state = saved["state"]["lightning"]["callbacks"][STATE_KEY]
    assert state == {"sampler": {"epoch": 0, "consumed": 3 * BATCH, "seed": 0, "dataset_size": SAMPLES},
                     "batches_in_epoch": 3, "global_batch": None, "lr_scale": 1.0}


class Rates(Seen):
    """Seen, with a learning rate to watch (and a scheduler that steps it by its base rate)."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)}


def test_constant_batch_accumulates_to_the_global_batch_in_micro_batches_and_keeps_it(tmp_path, capsys):
    # global 6 from batches of at most 4 in a world of one: two micro-batches of 3 per step
    # (the checkpoint of step 4 is a periodic one: written mid-epoch, as a kill finds them)
    run = trainer(tmp_path, max_steps=4, checkpoint_every=4, batch_policy="constant-batch", global_batch=6)
    model = Seen()
    run.fit(model, loader())
    assert run.accumulate_grad_batches == 2
    assert [len(batch) for batch in model.seen] == [3] * 8
    permutation = run.train_dataloader.sampler.permutation()
    assert [i for batch in model.seen for i in batch] == permutation[:24]
    assert ("batch policy 'constant-batch': global batch 6 (3 per worker x 2 accumulated x 1 worker), "
            "the learning rate as configured") in capsys.readouterr().out
    saved = torch.load(tmp_path / "step-00000004.pt", weights_only=True)["state"]["lightning"]
    assert saved["callbacks"][STATE_KEY]["global_batch"] == 6
    # resumed without a global batch: the one kept, with the position in micro-batches of 3
    model = Seen()
    again = trainer(tmp_path, max_steps=6, checkpoint_every=0, batch_policy="constant-batch")
    again.fit(model, loader())
    assert [i for batch in model.seen for i in batch] == permutation[24:36]


def test_linear_scales_the_rate_by_the_world_and_a_resume_moves_a_saved_scale_to_this_one(tmp_path, capsys):
    first = trainer(tmp_path, max_steps=2, checkpoint_every=0, batch_policy="linear")
    first.fit(Rates(), loader())
    assert "the learning rate as configured" in capsys.readouterr().out  # x1 at a world of one
    # as if saved at a world of 4: its rates (and the scheduler's base rates) are x4
    path = tmp_path / "step-00000002.pt"
    saved = torch.load(path, weights_only=True)["state"]
    lightning = saved["lightning"]
    lightning["callbacks"][STATE_KEY]["lr_scale"] = 4.0
    for group in lightning["optimizer_states"][0]["param_groups"]:
        group["lr"], group["initial_lr"] = 0.4, 0.4
    lightning["lr_schedulers"][0]["base_lrs"] = [0.4]
    first._elastic_io.checkpointer.save(2, 0, lightning=lightning, blocking=True)
    again = trainer(tmp_path, max_steps=3, checkpoint_every=0, batch_policy="linear")
    again.fit(Rates(), loader())
    assert again.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1)
    assert again.lr_scheduler_configs[0].scheduler.base_lrs == [pytest.approx(0.1)]


@pytest.mark.parametrize("arguments, named", [
    ({"batch_policy": "square-root"}, "'square-root'"),
    ({"batch_policy": "framework", "global_batch": 64}, "(64)"),
    ({"batch_policy": "constant-batch", "global_batch": -1}, "(-1)"),
])
def test_a_bad_batch_policy_is_refused_in_one_sentence_naming_it(arguments, named):
    with pytest.raises(ConfigError, match=r"^[^\n]*\.$") as refused:
        Trainer(**arguments)
    assert named in str(refused.value)


def test_a_bad_checkpoint_interval_or_keep_is_named():
    with pytest.raises(ConfigError, match=r"checkpoint_every \(-1\)"):
        Trainer(checkpoint_every=-1)
    with pytest.raises(ConfigError, match=r"keep \(0\)"):
        Trainer(keep=0)


# -- the sampler's rules ------------------------------------------------------------------

def epoch_sampler() -> EpochSampler:
    return EpochSampler(range(SAMPLES), batch_size=BATCH, shuffle=True, seed=0, drop_last=False)


@pytest.mark.parametrize("consumed, batches_before, world, length", [
    (0, 0, 1, SAMPLES),                  # a fresh epoch: every sample
    (24, 6, 1, 6 * BATCH + 24),          # resumed after 6 batches: those counted, 24 samples left
    (24, 3, 2, 3 * BATCH + 12),          # at world 2 the 24 left are 12 a rank
    (SAMPLES, 12, 1, 12 * BATCH),        # resumed at the epoch's end: nothing left to deal
])
def test_the_length_counts_the_batches_lightning_counted_before_a_resume(consumed, batches_before, world, length):
    sampler = epoch_sampler()
    sampler.num_replicas, sampler.rank = world, 0
    sampler.consumed, sampler.batches_before = consumed, batches_before
    assert len(sampler) == length
    assert len(list(sampler)) == length - batches_before * BATCH  # it deals only what is left


def test_trained_names_the_first_indices_dealt_and_not_yet_trained():
    sampler = epoch_sampler()
    dealt = iter(sampler)
    first = [next(dealt) for _ in range(2 * BATCH)]  # a batch trained, one prefetched
    assert sampler.trained(BATCH) == first[:BATCH]
    assert sampler.trained(BATCH) == first[BATCH:]
    assert sampler.trained(BATCH) == []
    iter(sampler).__next__()  # a new pass forgets what the last one dealt
    assert len(sampler.trained(BATCH)) == 1


def test_setting_the_epoch_it_is_in_keeps_its_position_and_another_starts_at_the_top():
    sampler = epoch_sampler()
    sampler.consumed, sampler.batches_before = 24, 6
    sampler.set_epoch(0)
    assert (sampler.epoch, sampler.consumed, sampler.batches_before) == (0, 24, 6)
    sampler.set_epoch(1)
    assert (sampler.epoch, sampler.consumed, sampler.batches_before) == (1, 0, 0)


@pytest.mark.parametrize("every", [SAMPLES // BATCH, 0])  # saved at the epoch's last batch, or as training ended
def test_a_checkpoint_at_an_epochs_end_resumes_at_the_top_of_the_next_epoch(tmp_path, every):
    trainer(tmp_path, max_epochs=1, checkpoint_every=every).fit(Seen(), loader())
    assert [p.name for p in tmp_path.glob("step-*.pt")] == ["step-00000012.pt"]
    model = Seen()
    second = trainer(tmp_path, max_epochs=2, checkpoint_every=0)
    second.fit(model, loader())
    sampler = second.train_dataloader.sampler
    assert sampler.epoch == 1
    assert [i for batch in model.seen for i in batch] == sampler.permutation()  # all of epoch 1, once
    assert second.global_step == 2 * SAMPLES // BATCH


class SignalAt(pl.Callback):
    """Sends this process SIGTERM after batch ``at`` of the first epoch (as `elasticctl leave` does)."""

    def __init__(self, at: int):
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_stops_at_the_end_of_the_optimizer_step_with_a_checkpoint_and_exit_0(tmp_path):
    # Two micro-batches a step: the signal after the first of step 2 is acted on after its second.
    handler_before = signal.getsignal(signal.SIGTERM)
    run = trainer(tmp_path, max_epochs=1, checkpoint_every=0, accumulate_grad_batches=2, callbacks=[SignalAt(2)])
    with pytest.raises(SystemExit) as stopped:
        run.fit(Seen(), loader())
    assert stopped.value.code == 0
    assert [p.name for p in tmp_path.glob("step-*.pt")] == ["step-00000002.pt"]
    saved = torch.load(tmp_path / "step-00000002.pt", weights_only=True)["state"]["lightning"]
    assert saved["callbacks"][STATE_KEY]["sampler"]["consumed"] == 4 * BATCH  # both steps' micro-batches
    assert signal.getsignal(signal.SIGTERM) is handler_before  # this process's own handler is back


# -- the position read back from a checkpoint: untrusted ------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from elasticctl.integrations.lightning import position  # noqa: E402
from elasticctl.train.checkpoint import CheckpointError  # noqa: E402

VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True), st.text(max_size=5),
                   st.lists(st.integers(), max_size=2))


@settings(max_examples=300, deadline=None)
@given(st.one_of(VALUES, st.dictionaries(st.sampled_from(["sampler", "batches_in_epoch", "other"]), st.one_of(
    VALUES, st.dictionaries(st.sampled_from(["epoch", "consumed", "seed", "dataset_size"]), VALUES, max_size=4)),
    max_size=3)))
def test_a_position_read_back_is_taken_or_refused_in_one_sentence(restored):
    sampler = epoch_sampler()
    try:
        position(sampler, restored)
    except CheckpointError as exc:
        assert str(exc).startswith("The checkpoint's sampler position does not fit this run: ")
        return
    assert 0 <= sampler.consumed <= SAMPLES and sampler.epoch >= 0
    assert 0 <= sampler.batches_before <= SAMPLES and len(sampler) >= 0


def test_a_good_position_is_taken():
    sampler = epoch_sampler()
    position(sampler, {"sampler": {"epoch": 2, "consumed": 24, "seed": 0, "dataset_size": SAMPLES},
                       "batches_in_epoch": 6})
    assert (sampler.epoch, sampler.consumed, sampler.batches_before) == (2, 24, 6)
