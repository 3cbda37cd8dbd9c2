"""What elasticctl's Hugging Face ``Trainer`` relies on in transformers and accelerate, pinned, in a
world of one in this process: its sampler is the one the training loader deals from (accelerate's
shard wrapper passing batches through), a resume goes on at the sample where the checkpoint was
(transformers skipping nothing), a checkpoint directory is used only once its manifest commits
it, and SIGTERM stops at a step with a checkpoint of it.

Layer tests/unit: no etcd, no processes. Skipped, saying so, without transformers. The model is a
causal LM built from a config (two layers, random weights): nothing is downloaded.
"""

from __future__ import annotations

import json
import logging
import os
import signal

import pytest

pytest.importorskip("transformers", reason="transformers is not installed: pip install 'elasticctl[huggingface]'")

import torch  # noqa: E402
import transformers  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from elasticctl.integrations import huggingface  # noqa: E402
from elasticctl.integrations.huggingface import MANIFEST, STATE_FILE, StepSampler, Trainer  # noqa: E402

SAMPLES, BATCH, LENGTH = 48, 4, 8


class Tokens(Dataset):
    """Sample i: random tokens whose first one is i, so that a batch names its samples."""

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        tokens = torch.randint(0, 64, (LENGTH,), generator=torch.Generator().manual_seed(i))
        tokens[0] = i
        return {"input_ids": tokens, "labels": tokens.clone()}


class Seen(transformers.GPT2LMHeadModel):
    """A two-layer GPT-2 that remembers the samples of every batch it trained."""

    seen: list[list[int]]

    def forward(self, input_ids=None, labels=None, **kwargs):
        if self.training:
            self.seen.append(input_ids[:, 0].tolist())
        return super().forward(input_ids=input_ids, labels=labels, **kwargs)


def model() -> Seen:
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=LENGTH)
    torch.manual_seed(0)
    m = Seen(config)
    m.seen = []
    return m


def trainer(directory, m=None, **arguments) -> Trainer:
    args = transformers.TrainingArguments(
        output_dir=str(directory), per_device_train_batch_size=BATCH, save_strategy="steps", report_to=[],
        use_cpu=True, logging_steps=1000, disable_tqdm=True, seed=0, learning_rate=1e-3, **arguments)
    return Trainer(model=m if m is not None else model(), args=args, train_dataset=Tokens())


@pytest.fixture(autouse=True)
def quiet():
    """Quiet for this file's tests only: a level left behind would hide other tests' log records."""
    verbosity, ours = transformers.logging.get_verbosity(), logging.getLogger("elasticctl")
    level = ours.level
    transformers.logging.set_verbosity_error()
    ours.setLevel(logging.ERROR)
    yield
    ours.setLevel(level)
    transformers.logging.set_verbosity(verbosity)


def trained(m: Seen) -> list[int]:
    return [i for batch in m.seen for i in batch]


def test_the_training_loader_deals_from_the_elastic_sampler(tmp_path):
    m = model()
    run = trainer(tmp_path, m, max_steps=5, save_steps=100)
    run.train()
    sampler = run.elastic_sampler
    assert isinstance(sampler, StepSampler)
    assert trained(m) == sampler.permutation()[:5 * BATCH]
    assert sampler.consumed == 5 * BATCH


def test_each_checkpoint_is_committed_by_its_manifest_with_the_sampler_position(tmp_path):
    trainer(tmp_path, max_steps=5, save_steps=3).train()
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint-"))
    assert names == ["checkpoint-3", "checkpoint-5"]
    files = huggingface.verify(tmp_path / "checkpoint-3")
    assert STATE_FILE in files and "trainer_state.json" in files
    saved = json.loads((tmp_path / "checkpoint-3" / STATE_FILE).read_text())
    assert saved == {"sampler": {"epoch": 0, "consumed": 3 * BATCH, "seed": 0, "dataset_size": SAMPLES},
                     "global_batch": None, "lr_scale": 1.0}


def test_constant_batch_accumulates_to_the_global_batch_and_keeps_it_in_the_checkpoint(tmp_path, capsys):
    m = model()
    run = trainer(tmp_path, m, max_steps=3, save_steps=3)
    run = Trainer(model=m, args=run.args, train_dataset=Tokens(), batch_policy="constant-batch",
                  global_batch=3 * BATCH)
    run.train()
    # a world of one makes 12 from three micro-batches of 4: every step trained 12 samples
    assert (run.args.per_device_train_batch_size, run.args.gradient_accumulation_steps) == (BATCH, 3)
    assert trained(m) == run.elastic_sampler.permutation()[:9 * BATCH]
    saved = huggingface.read_state(tmp_path / "checkpoint-3")
    assert (saved.global_batch, saved.lr_scale) == (3 * BATCH, 1.0)
    assert ("batch policy 'constant-batch': global batch 12 (4 per worker x 3 accumulated x 1 worker), "
            "the learning rate as configured") in capsys.readouterr().out


def test_a_resume_under_linear_moves_the_restored_learning_rates_to_this_worlds_scale(tmp_path):
    # Saved as if at a world of 4 under linear (rates x4); resumed at a world of one: x1 again.
    first = trainer(tmp_path, max_steps=2, save_steps=2, lr_scheduler_type="constant")
    first.train()
    state = tmp_path / "checkpoint-2" / STATE_FILE
    saved = json.loads(state.read_text())
    state.write_text(json.dumps({**saved, "lr_scale": 4.0}))
    optimizer = torch.load(tmp_path / "checkpoint-2" / "optimizer.pt", weights_only=True)
    for group in optimizer["param_groups"]:
        group["lr"] *= 4
    torch.save(optimizer, tmp_path / "checkpoint-2" / "optimizer.pt")
    scheduler = torch.load(tmp_path / "checkpoint-2" / "scheduler.pt", weights_only=True)
    scheduler["base_lrs"] = [lr * 4 for lr in scheduler["base_lrs"]]
    torch.save(scheduler, tmp_path / "checkpoint-2" / "scheduler.pt")
    huggingface.commit(tmp_path / "checkpoint-2")
    run = Trainer(model=model(), args=first.args, train_dataset=Tokens(), batch_policy="linear")
    run.args.max_steps = 3
    run.train()
    assert run.resumed_from == tmp_path / "checkpoint-2"
    assert [group["lr"] for group in run.optimizer.param_groups] == [pytest.approx(1e-3)] * len(
        run.optimizer.param_groups)


@pytest.mark.parametrize("arguments, named", [
    ({"batch_policy": "square-root"}, "'square-root'"),
    ({"batch_policy": "linear", "global_batch": 64}, "(64)"),
    ({"batch_policy": "constant-batch", "global_batch": 0}, "(0)"),
])
def test_a_bad_batch_policy_is_refused_in_one_sentence_naming_it(tmp_path, arguments, named):
    from elasticctl.errors import ConfigError

    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(ConfigError, match=r"^[^\n]*\.$") as refused:
        Trainer(model=model(), args=args, train_dataset=Tokens(), **arguments)
    assert named in str(refused.value)


def test_a_train_resumes_from_the_newest_committed_checkpoint_at_its_sample(tmp_path):
    trainer(tmp_path, max_steps=5, save_steps=3).train()
    (tmp_path / "checkpoint-5" / MANIFEST).unlink()  # as if killed while writing it: step 3 is the newest
    m = model()
    run = trainer(tmp_path, m, num_train_epochs=1, save_steps=100)
    run.train()  # no resume_from_checkpoint
    assert run.resumed_from == tmp_path / "checkpoint-3"
    permutation = run.elastic_sampler.permutation()
    assert trained(m) == permutation[3 * BATCH:]  # the rest of the epoch, each once; nothing skipped
    assert run.state.global_step == SAMPLES // BATCH


def test_a_changed_file_is_never_resumed_from(tmp_path):
    trainer(tmp_path, max_steps=5, save_steps=3).train()
    state = tmp_path / "checkpoint-5" / "trainer_state.json"
    state.write_text(state.read_text().replace('"global_step": 5', '"global_step": 9'))
    assert huggingface.newest_committed(tmp_path) == tmp_path / "checkpoint-3"


def test_keep_prunes_older_committed_checkpoints_and_never_the_newest(tmp_path):
    Trainer(model=model(), args=transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=BATCH, save_strategy="steps", save_steps=2,
        max_steps=9, report_to=[], use_cpu=True, disable_tqdm=True), train_dataset=Tokens(), keep=2).train()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-8", "checkpoint-9"]


class SignalAt(transformers.TrainerCallback):
    def __init__(self, at: int):
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_stops_at_the_next_step_with_a_checkpoint_and_exit_0(tmp_path):
    handler_before = signal.getsignal(signal.SIGTERM)
    run = trainer(tmp_path, num_train_epochs=1, save_steps=100)
    run.add_callback(SignalAt(4))  # after elasticctl's callback: the flag is seen at step 5
    with pytest.raises(SystemExit) as stopped:
        run.train()
    assert stopped.value.code == 0
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint-")] == ["checkpoint-5"]
    huggingface.verify(tmp_path / "checkpoint-5")
    assert signal.getsignal(signal.SIGTERM) is handler_before


# -- what is read back from disk: untrusted --------------------------------------------------

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from elasticctl.train.checkpoints.files import CheckpointError  # noqa: E402

JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=8)),
                    lambda inner: st.one_of(st.lists(inner, max_size=3),
                                            st.dictionaries(st.text(max_size=8), inner, max_size=3)), max_leaves=8)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(manifest=st.one_of(JSON, st.fixed_dictionaries({"format": st.just(huggingface.MANIFEST_FORMAT), "files": JSON})))
@example(manifest={"format": huggingface.MANIFEST_FORMAT, "files": {"\n": ""}})
def test_a_manifest_read_back_commits_its_directory_or_is_refused_in_one_sentence(tmp_path, manifest):
    directory = tmp_path / "checkpoint-1"
    directory.mkdir(exist_ok=True)
    (directory / "model.safetensors").write_bytes(b"weights")
    (directory / MANIFEST).write_text(json.dumps(manifest))
    try:
        files = huggingface.verify(directory)
    except CheckpointError as exc:
        assert str(exc).endswith(".") and "\n" not in str(exc)
        return
    assert all((directory / name).is_file() for name in files)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=st.one_of(JSON, st.dictionaries(st.sampled_from(["sampler", "global_batch", "lr_scale"]), JSON)))
def test_the_state_read_back_is_taken_or_refused_in_one_sentence(tmp_path, state):
    (tmp_path / STATE_FILE).write_text(json.dumps(state))
    try:
        saved = huggingface.read_state(tmp_path)
    except CheckpointError as exc:
        assert str(exc).endswith(".") and "\n" not in str(exc) and "cannot be read" in str(exc)
        return
    assert saved.sampler is None or isinstance(saved.sampler, dict)
    assert saved.global_batch is None or saved.global_batch >= 1
    assert saved.lr_scale > 0


@settings(max_examples=200, deadline=None)
@given(state=st.dictionaries(st.sampled_from(["epoch", "consumed", "seed", "dataset_size"]), JSON, max_size=4))
def test_a_position_read_back_is_taken_or_refused_in_one_sentence(state):
    sampler = StepSampler(range(SAMPLES), shuffle=True, seed=0, drop_last=False)
    try:
        huggingface.place(sampler, state, huggingface.Path("checkpoint-1"))
    except CheckpointError as exc:
        assert "does not fit this run" in str(exc)
        return
    assert 0 <= sampler.consumed <= SAMPLES and sampler.epoch >= 0


@pytest.mark.parametrize("world, use_cpu, cuda, needed", [
    (2, False, False, True),   # several workers, no CUDA: without use_cpu each would train alone
    (1, False, False, False),  # a world of one needs nothing
    (2, True, False, False),   # already said
    (2, False, True, False),   # CUDA: transformers forms the world itself
])
def test_several_workers_on_a_host_without_cuda_are_told_use_cpu(world, use_cpu, cuda, needed):
    assert huggingface.needs_use_cpu(world, use_cpu, cuda) == needed
