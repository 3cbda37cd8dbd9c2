"""Hugging Face ``transformers``' ``Trainer``, elastic: change ``from transformers import Trainer``
to ``from elasticctl.integrations.huggingface import Trainer``.

Under ``elasticctl up`` in restart mode every worker starts again, at the new world size, when a
node fails, leaves or joins. ``transformers`` alone would resume only from a
``resume_from_checkpoint`` the user passes, skip a number of batches counted at the old world
size (samples trained twice or never), and pick a checkpoint directory that a kill left half
written. This ``Trainer`` is transformers' own with:

* **Checkpoints the job can trust**: its ``checkpoint-N`` directories go to the job's checkpoint
  directory (``elasticctl up --checkpoint-dir``, else ``args.output_dir``); each is committed by
  a manifest of its files' digests, written last, so that one a kill cut short, or one whose
  bytes changed, is never resumed from; the newest ``keep`` committed ones are kept.
* **Resumed without ``resume_from_checkpoint``**: ``train()`` starts from the newest committed
  checkpoint.
* **The data position, exact at any world size**: the training sampler is elasticctl's
  :class:`~elasticctl.train.sampler.ResumableSampler`, its position saved in each checkpoint;
  the epoch goes on with the samples not yet trained, each once, and transformers skips nothing.
* **SIGTERM** (``elasticctl leave``/``down``, torchrun re-forming the world for a join, a
  preemption) stops every rank at the same step with a checkpoint of it.
* **The batch policy** (``batch_policy=``): the global batch and the learning rate at each world
  size, as :mod:`elasticctl.integrations.batching` says (``"framework"``, ``"linear"``,
  ``"constant-batch"``), printed once per start.

What relies on transformers' and accelerate's internals (the sampler hook, the shard wrapper,
the resume arithmetic) is in this module alone, pinned by tests/unit/test_huggingface_contract.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from transformers import TrainerCallback

from elasticctl.errors import ConfigError
from elasticctl.integrations import batching
from elasticctl.integrations.sampling import DealtSampler
from elasticctl.train.checkpoints.files import CheckpointError, file_digest, fsync_dir, write_atomically
from elasticctl.train.sample_ledger import SampleLedger
from elasticctl.train.script import GracefulStop, PeerLeaving
from elasticctl.train.script import checkpoint_dir as job_checkpoint_dir

__all__ = ["Trainer"]

log = logging.getLogger(__name__)

MANIFEST = "elasticctl-manifest.json"  # written last: its presence commits the directory
MANIFEST_FORMAT = "elasticctl-hf-manifest-1"
STATE_FILE = "elasticctl-state.json"  # the sampler's position and the batch policy's, listed in the manifest
_CHECKPOINT_RE = re.compile(r"^checkpoint-([0-9]+)$")


class StepSampler(DealtSampler):
    """The training sampler: a :class:`DealtSampler` whose length is a whole epoch at this world
    size (transformers counts an epoch's steps once, from it) while it deals only the samples of
    the epoch left."""

    def __len__(self) -> int:
        if self.drop_last:
            return self.dataset_size // self.num_replicas
        return -(-self.dataset_size // self.num_replicas)


# -- checkpoint directories committed by a manifest ------------------------------------------

def commit(directory: Path) -> None:
    """Write ``directory``'s manifest (every file's digest), last and atomically."""
    files = {p.name: file_digest(p) for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}
    for name in files:
        with open(directory / name, "rb") as f:
            os.fsync(f.fileno())
    manifest = json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=1, sort_keys=True)
    write_atomically(directory, MANIFEST, lambda f: f.write(manifest.encode()))
    fsync_dir(directory)


def verify(directory: Path) -> dict[str, str]:
    """The files ``directory``'s manifest lists, once every one is there with its digest; else a
    one-sentence :class:`CheckpointError` (no manifest: a save cut short)."""
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"The checkpoint '{directory}' has no manifest (a save cut short).") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"The manifest of the checkpoint '{directory}' cannot be read: {exc}.") from exc
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not (isinstance(manifest, dict) and manifest.get("format") == MANIFEST_FORMAT and isinstance(files, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())):
        raise CheckpointError(f"The file '{path}' is not an elasticctl checkpoint manifest.")
    for name, digest in files.items():
        # A name is one plain file of this directory; anything else (a path, a control character
        # that would split the error's sentence) is a manifest this code never wrote.
        if "/" in name or name in ("", ".", "..", MANIFEST) or not name.isprintable():
            raise CheckpointError(f"The manifest of the checkpoint '{directory}' has an invalid entry {name!r}.")
        try:
            actual = file_digest(directory / name)
        except OSError as exc:
            raise CheckpointError(f"The checkpoint '{directory}' lacks '{name}': {exc.strerror or exc}.") from exc
        if actual != digest:
            raise CheckpointError(f"The file '{name}' of the checkpoint '{directory}' does not match its digest.")
    return files


def checkpoints(root: Path) -> list[tuple[int, Path]]:
    """``checkpoint-N`` directories under ``root``, newest first (committed or not)."""
    if not root.is_dir():
        return []
    found = [(int(m[1]), p) for p in root.iterdir() if p.is_dir() and (m := _CHECKPOINT_RE.match(p.name))]
    return sorted(found, reverse=True)


def newest_committed(root: Path) -> Path | None:
    for _, path in checkpoints(root):
        try:
            verify(path)
            return path
        except CheckpointError as exc:
            log.warning("Skipping checkpoint %s: %s", path, exc)
    return None


def prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` committed checkpoints; remove older ones, committed or not."""
    committed = 0
    for _, path in checkpoints(root):
        if committed >= keep:
            shutil.rmtree(path, ignore_errors=True)
            continue
        if (path / MANIFEST).exists():
            committed += 1


@dataclasses.dataclass(frozen=True)
class SavedState:
    """What this integration keeps in a checkpoint beside transformers' files (read back: validated)."""

    sampler: dict | None  # the sampler's position (checked against the dataset by place())
    global_batch: int | None = None  # constant-batch's, held since the first start
    lr_scale: float = 1.0  # the factor on the configured learning rate its optimizer carries


def read_state(directory: Path) -> SavedState | None:
    """The checkpoint's :class:`SavedState`, None if it has none, or a one-sentence error."""
    path = directory / STATE_FILE
    if not path.exists():
        return None
    try:
        state = json.loads(path.read_bytes())
        if not isinstance(state, dict):
            raise ValueError("it is not an object")
        sampler = state.get("sampler")
        if sampler is not None and not isinstance(sampler, dict):
            raise ValueError(f"its sampler position is a {type(sampler).__name__}")
        return SavedState(sampler, batching.saved_global_batch(state.get("global_batch")),
                          batching.saved_scale(state.get("lr_scale")))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"The elasticctl state of the checkpoint '{directory}' cannot be read: {exc}.") from exc


def place(sampler: StepSampler, state: dict, directory: Path) -> None:
    """Put ``sampler`` at ``state`` (read from disk: untrusted), or raise a one-sentence error."""
    try:
        sampler.load_state_dict(state)
        if not 0 <= sampler.consumed <= sampler.dataset_size or sampler.epoch < 0:
            raise ValueError(f"the position {sampler.consumed} in epoch {sampler.epoch} is outside the "
                             f"{sampler.dataset_size} samples")
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise CheckpointError(f"The sampler position of the checkpoint '{directory}' does not fit this run: "
                              f"{exc}.") from exc


# -- the callback ------------------------------------------------------------------------------

class _Elastic(TrainerCallback):
    """Advances the sampler after each optimizer step, commits every checkpoint transformers
    writes, and stops every rank at the same step on SIGTERM (the handler only sets a flag)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.stop: GracefulStop | None = None
        self.ended: GracefulStop | None = None  # the stop of the training that ended, for its exit
        self.stopping = False
        self._handler_before = None
        self._ledger = None

    def on_train_begin(self, args, state, control, **kwargs):
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1 and (args.world_size != world or self.trainer.accelerator.distributed_type.value == "NO"):
            # transformers with accelerate does so on a host without CUDA unless told use_cpu=True
            raise ConfigError(
                f"transformers does not train this world of {world} workers as one (it sees {args.world_size}, "
                f"{self.trainer.accelerator.distributed_type.value}): each worker would train a model of its own; "
                "pass TrainingArguments(use_cpu=True) on a host without CUDA, or ddp_backend for your devices.")
        self._handler_before = signal.getsignal(signal.SIGTERM)
        self.stop = GracefulStop()
        self._ledger = SampleLedger.from_environment()  # closed at the end of training
        if self._ledger is not None:
            self._ledger.started(state.global_step, self.trainer.elastic_sampler)
        self.trainer.announce()

    def on_step_end(self, args, state, control, **kwargs):
        sampler = self.trainer.elastic_sampler
        if sampler is not None:
            samples = self.trainer.current_gradient_accumulation_steps * self.trainer._train_batch_size
            trained = sampler.trained(samples)  # this rank's samples of the step, in order
            epoch = sampler.epoch
            sampler.advance(len(trained))
            if self._ledger is not None:
                self._ledger.stepped(state.global_step, epoch, trained, self.trainer.step_loss())
        if self.stop is not None and self.stop.agreed(args.device):
            self.stopping = True
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        directory = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if dist.is_initialized():
            dist.barrier()  # every rank's files (its RNG state) are written
        if state.is_world_process_zero and directory.is_dir():
            sampler, plan = self.trainer.elastic_sampler, self.trainer.batching
            state = {"sampler": sampler.state_dict() if sampler is not None else None,
                     "global_batch": plan.asked if plan else None, "lr_scale": plan.lr_scale if plan else 1.0}
            write_atomically(directory, STATE_FILE, lambda f: f.write(json.dumps(state).encode()))
            commit(directory)
            prune(Path(args.output_dir), self.trainer.keep)
        if dist.is_initialized():
            dist.barrier()  # committed before any rank goes on (and before a stop's exit)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.release()

    def release(self) -> None:
        if self.stop is not None:
            signal.signal(signal.SIGTERM, self._handler_before or signal.SIG_DFL)
            self.ended, self.stop, self._handler_before = self.stop, None, None
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None


def needs_use_cpu(world: int, use_cpu: bool, cuda: bool) -> bool:
    """Whether ``TrainingArguments`` must be told ``use_cpu=True`` for a world of ``world``
    workers to train one model: transformers (with accelerate) otherwise leaves every worker's
    model unwrapped on a host without CUDA, while the process group is up."""
    return world > 1 and not use_cpu and not cuda


def _one_world_on_the_cpu(args: tuple, kwargs: dict) -> dict:
    """``kwargs`` with ``TrainingArguments(use_cpu=True)`` where :func:`needs_use_cpu` says so
    (the arguments given by keyword only; the check at the start of training names the rest)."""
    training = kwargs.get("args")
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        world = 1
    if training is None or len(args) > 1 or not needs_use_cpu(world, training.use_cpu, torch.cuda.is_available()):
        return kwargs
    log.info("no CUDA here: TrainingArguments(use_cpu=True), so that the %d workers train one model with DDP", world)
    return {**kwargs, "args": dataclasses.replace(training, use_cpu=True)}


class Trainer(transformers.Trainer):
    """transformers' ``Trainer`` for a job whose world size changes (see the module's docstring).

    ``checkpoint_dir``: where the ``checkpoint-N`` directories go (default: the job's, from
    ``elasticctl up --checkpoint-dir``, else ``args.output_dir``); ``keep``: how many committed
    ones are kept (``args.save_total_limit`` is left to this); ``batch_policy`` and
    ``global_batch``: how the global batch and the learning rate follow the world size
    (:mod:`elasticctl.integrations.batching`; the default leaves ``per_device_train_batch_size``,
    ``gradient_accumulation_steps`` and ``learning_rate`` as given). Every other argument is
    transformers'; ``args.save_steps`` says how often to save.
    """

    def __init__(self, *args: Any, checkpoint_dir: str | None = None, keep: int = 3,
                 batch_policy: str = "framework", global_batch: int | None = None, **kwargs: Any) -> None:
        batching.check_policy(batch_policy, global_batch)
        if keep < 1:
            raise ConfigError(f"keep ({keep}) must be at least 1: the newest checkpoint is what a restart resumes from.")
        kwargs = _one_world_on_the_cpu(args, kwargs)
        super().__init__(*args, **kwargs)
        directory = job_checkpoint_dir(checkpoint_dir)
        if directory:
            self.args.output_dir = str(directory)
        self.args.save_total_limit = None  # the committed checkpoints are pruned here, never a newer one first
        self.keep = keep
        self.batch_policy, self.global_batch = batch_policy, global_batch
        # what the script configured, which each start's batching starts from
        self._configured = (self.args.per_device_train_batch_size, self.args.gradient_accumulation_steps,
                            self.args.learning_rate)
        self.batching: batching.Batching | None = None
        self.elastic_sampler: StepSampler | None = None
        self.resumed_from: Path | None = None
        self._saved: SavedState | None = None
        self._position: dict | None = None
        self._losses: list[float] = []  # this step's micro-batches' losses, while a sample ledger is kept
        self._elastic = _Elastic(self)
        self.add_callback(self._elastic)

    # -- resume ---------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """transformers' ``train``; without ``resume_from_checkpoint``, from the newest committed
        checkpoint (``True`` means the same)."""
        if resume_from_checkpoint is None or resume_from_checkpoint is True:
            newest = newest_committed(Path(self.args.output_dir))
            resume_from_checkpoint = str(newest) if newest is not None else None
        if resume_from_checkpoint:
            self.resumed_from = Path(resume_from_checkpoint)
            self._saved = read_state(self.resumed_from)
            self._position = self._saved.sampler if self._saved else None
        self._batch_for_this_world()
        try:
            output = super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._elastic.release()
        if self._elastic.stopping:
            # Stopped at a step boundary with a checkpoint: the signalled ranks leave now (the
            # script's own code after train() is for a job that finished); the others restart
            # in the world without them.
            try:
                self._elastic.ended.exit()
            except PeerLeaving as exc:
                print(f"elasticctl: {exc}", file=sys.stderr, flush=True)
                sys.exit(1)
        return output

    # -- the batch policy -----------------------------------------------------------------

    def _batch_for_this_world(self) -> None:
        batch_size, accumulation, lr = self._configured
        global_batch = self.global_batch
        if global_batch is None and self.batch_policy == "constant-batch" and self._saved is not None:
            global_batch = self._saved.global_batch  # the one the first start made, held since
        world = dist.get_world_size() if dist.is_initialized() else self.args.world_size
        self.batching = plan = batching.plan(self.batch_policy, world_size=world, batch_size=batch_size,
                                             accumulation=accumulation, global_batch=global_batch)
        self.args.per_device_train_batch_size = self._train_batch_size = plan.micro_batch
        self.args.gradient_accumulation_steps = self.accelerator.gradient_accumulation_steps = plan.accumulation
        self.args.learning_rate = lr * plan.lr_scale  # a new optimizer's; a restored one is rescaled on load

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self.batching is not None:
            saved = self._saved.lr_scale if self._saved else 1.0
            scheduler = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)  # accelerate's wrapper or not
            batching.rescale_lr([self.optimizer], [scheduler] if scheduler is not None else [],
                                self.batching.lr_scale / saved)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self._elastic._ledger is not None:  # the ledger's loss of the step (a sync per micro-batch: only then)
            self._losses.append(float(loss))
        return loss

    def step_loss(self) -> float | None:
        """The loss of the optimizer step just taken, as transformers accumulates it (the sum of its
        micro-batches' losses, each scaled for the accumulation), for the sample ledger."""
        losses, self._losses = self._losses, []
        return sum(losses) if losses else None

    # -- the sampler ----------------------------------------------------------------------

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if dataset is None or not hasattr(dataset, "__len__"):
            return super()._get_train_sampler(train_dataset)
        sampler = StepSampler(dataset, shuffle=True, seed=self.args.data_seed or self.args.seed,
                              drop_last=self.args.dataloader_drop_last)
        if self._position is not None:
            place(sampler, self._position, self.resumed_from)
            self._position = None
        self.elastic_sampler = sampler
        return sampler

    def get_train_dataloader(self):
        dataloader = super().get_train_dataloader()
        # The sampler deals this rank's share already: accelerate's shard wrapper must pass its
        # batches through, as transformers makes it do for its own rank-aware sampler.
        shard = getattr(dataloader, "batch_sampler", None)
        inner = getattr(shard, "batch_sampler", None)
        if self.elastic_sampler is not None and getattr(inner, "sampler", None) is self.elastic_sampler:
            shard.num_processes, shard.process_index = 1, 0
        return dataloader

    def _init_training_state(self, max_steps, num_update_steps_per_epoch, num_train_epochs,
                             resume_from_checkpoint, trial):
        # transformers divides the steps done by this world's steps per epoch to find the epoch,
        # and skips that many batches: at another world size both are wrong. The sampler knows
        # the epoch and where in it training is; nothing is skipped.
        epochs_trained, _ = super()._init_training_state(max_steps, num_update_steps_per_epoch, num_train_epochs,
                                                         resume_from_checkpoint, trial)
        if self.elastic_sampler is not None and resume_from_checkpoint is not None:
            epochs_trained = self.elastic_sampler.epoch + (1 if self.elastic_sampler.epoch_done else 0)
        return epochs_trained, 0

    def announce(self) -> None:
        if not self.is_world_process_zero():
            return
        world = dist.get_world_size() if dist.is_initialized() else self.args.world_size
        where = f"resuming at step {self.state.global_step} from {self.resumed_from}" if self.resumed_from \
            else "starting from scratch"
        print(f"elasticctl: world size {world}; {self.batching.describe()}; {where}", flush=True)
