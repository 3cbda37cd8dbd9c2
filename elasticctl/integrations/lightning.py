"""PyTorch Lightning's ``Trainer``, elastic: change ``from lightning.pytorch import Trainer`` to
``from elasticctl.integrations.lightning import Trainer``.

Under ``elasticctl up`` in restart mode every worker starts again, at the new world size, when a
node fails, leaves or joins. Lightning alone would start that run from scratch (or from a
``ckpt_path`` the user wires by hand), and restart the epoch at its top. This ``Trainer`` is
Lightning's with what a run that changes size needs:

* **Checkpoints through elasticctl's**: every ``checkpoint_every`` optimizer steps, into the job's
  checkpoint directory (``elasticctl up --checkpoint-dir``; else ``checkpoint_dir=``), written
  atomically with a digest, the newest ``keep`` kept, one that is partial or corrupt skipped in
  favour of the one before (:class:`~elasticctl.train.checkpoint.Checkpointer`).
* **Resumed without a ckpt_path**: ``fit`` starts from the newest checkpoint that verifies.
* **The data position, exact at any world size**: the training DataLoader's sampler becomes
  elasticctl's :class:`~elasticctl.train.sampler.ResumableSampler` (a ``DistributedSampler``):
  its position is one count of samples that means the same at every world size, saved in every
  checkpoint, so that every sample of an epoch is trained once across a resize (Lightning would
  restart the epoch: samples trained twice).
* **The world from torchrun**: ``devices`` and ``num_nodes`` from torchrun's environment, so the
  same script runs at whatever size the job formed.
* **The batch policy** (``batch_policy=``): the global batch and the learning rate at each world
  size, as :mod:`elasticctl.integrations.batching` says (``"framework"``, ``"linear"``,
  ``"constant-batch"``), printed once per start.

Checkpoints of Lightning's own ``ModelCheckpoint`` (another directory) are written as Lightning
writes them. What relies on Lightning's internals (its data connector, ``_update_dataloader``)
is in this module alone, pinned by tests/unit/test_lightning_contract.py.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch import Trainer as LightningTrainer
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from elasticctl.errors import ConfigError
from elasticctl.job import environment
from elasticctl.integrations import batching
from elasticctl.integrations.sampling import DealtSampler
from elasticctl.train.checkpoint import Checkpointer, CheckpointError
from elasticctl.train.sample_ledger import SampleLedger
from elasticctl.train.script import GracefulStop, PeerLeaving
from elasticctl.train.script import checkpoint_dir as job_checkpoint_dir

__all__ = ["Trainer"]

log = logging.getLogger(__name__)

STATE_KEY = "elasticctl"  # this integration's part of a Lightning checkpoint's "callbacks"


class EpochSampler(DealtSampler):
    """The training sampler: a :class:`DealtSampler` that counts an epoch as Lightning does.

    Resumed mid-epoch, Lightning goes on counting the epoch's batches from where its checkpoint
    was (``batches_before``) and ends the epoch when that count reaches the loader's length. The
    sampler deals only the samples left, so it reports those batches in its length too: the
    epoch ends when the samples left are dealt, at any world size.
    """

    def __init__(self, dataset, *, batch_size: int, shuffle: bool, seed: int, drop_last: bool) -> None:
        super().__init__(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.batch_size = batch_size
        self.batches_before = 0

    def __len__(self) -> int:
        return self.batches_before * self.batch_size + self.per_rank()

    def started_epoch(self) -> None:
        self.batches_before = 0


def position(sampler: EpochSampler, restored: Any) -> None:
    """Put ``sampler`` where the checkpoint's state of this integration (``restored``, read from
    disk: untrusted) says, or raise a one-sentence :class:`CheckpointError`."""
    state = restored.get("sampler") if isinstance(restored, dict) else None
    if not state:
        return
    before = restored.get("batches_in_epoch", 0)
    try:
        if not isinstance(state, dict):
            raise TypeError(f"the sampler state is a {type(state).__name__}")
        sampler.load_state_dict(state)
        if not 0 <= sampler.consumed <= sampler.dataset_size or sampler.epoch < 0:
            raise ValueError(f"the position {sampler.consumed} in epoch {sampler.epoch} is outside the "
                             f"{sampler.dataset_size} samples")
        if isinstance(before, bool) or not isinstance(before, int) or not 0 <= before <= sampler.dataset_size:
            raise ValueError(f"the batches counted in the epoch ({before!r}) are not a count of this dataset's")
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise CheckpointError(f"The checkpoint's sampler position does not fit this run: {exc}.") from exc
    if sampler.consumed:
        sampler.batches_before = before


class _Elastic(Callback):
    """Advances the sampler after each trained batch, saves every ``every`` steps and when
    training ends, carries the sampler's position in the checkpoint (Lightning saves a callback's
    ``state_dict``), and stops
    at a step boundary on SIGTERM (``elasticctl leave``/``down``, a preemption) with a final
    checkpoint.

    Lightning's own SIGTERM handler broadcasts from inside the signal handler, which can meet a
    collective in flight and hang until torchrun kills the worker (30 s, no checkpoint). Here
    the handler only sets a flag; every rank learns of it at the same step (one all-reduce), the
    checkpoint is written, the signalled ranks exit 0 and the others 1, so that their nodes
    re-form without the leaver and resume from that checkpoint, losing no step.
    """

    def __init__(self, io: _CheckpointIO, every: int, ledger: str | None, policy: str,
                 global_batch: int | None) -> None:
        self.io = io
        self.every = every
        self.policy = policy
        self.global_batch = global_batch  # constant-batch: the one the script gave, else the checkpoint's
        self.accumulation = 1  # the script's accumulate_grad_batches (the Trainer sets it after Lightning's init)
        self.batching: batching.Batching | None = None  # this start's, decided with its first training loader
        self._restored_scale = 1.0  # the learning-rate scale of the checkpoint resumed from
        self.sampler: EpochSampler | None = None
        self.batches_in_epoch = 0
        self.restored: dict | None = None
        self._saved_at: int | None = None
        self._ledger_path = ledger
        self._ledger = None
        self._stop: GracefulStop | None = None
        self._handler_before = None  # SIGTERM's handler before ours, put back when training ends

    @property
    def state_key(self) -> str:
        return STATE_KEY

    # -- the sampler ------------------------------------------------------------------

    def loader_for(self, trainer, dataloader: DataLoader, shuffle: bool, mode: RunningStage) -> DataLoader:
        """``dataloader`` dealt by this integration's sampler, in this start's micro-batches."""
        restored, self.restored = self.restored, None
        if self.batching is None:
            self.batching = self._plan(trainer, dataloader.batch_size, restored)
        if self.policy != "framework":  # else Lightning's (a GradientAccumulationScheduler's) stays
            trainer.accumulate_grad_batches = self.batching.accumulation
        sampler = EpochSampler(dataloader.dataset, batch_size=self.batching.micro_batch, shuffle=shuffle,
                               seed=int(os.environ.get("PL_GLOBAL_SEED", "0")), drop_last=dataloader.drop_last)
        if restored:
            position(sampler, restored)
        self.sampler = sampler
        loader = _update_dataloader(dataloader, sampler, mode=mode)
        if self.batching.micro_batch != dataloader.batch_size:
            if type(loader.batch_sampler) is not BatchSampler:
                raise ConfigError(f"The batch policy '{self.policy}' sets each worker's batch to "
                                  f"{self.batching.micro_batch}, which a {type(loader.batch_sampler).__name__} "
                                  "does not take: give the DataLoader a batch_size instead.")
            # torch's BatchSampler reads its batch_size as it deals (the DataLoader's own
            # attribute is fixed at construction and only informative)
            loader.batch_sampler.batch_size = self.batching.micro_batch
        return loader

    def _plan(self, trainer, batch_size: int, restored: dict | None) -> batching.Batching:
        global_batch = self.global_batch
        if restored:
            try:
                self._restored_scale = batching.saved_scale(restored.get("lr_scale"))
                saved = batching.saved_global_batch(restored.get("global_batch"))
            except ValueError as exc:
                raise CheckpointError(f"The checkpoint's batch policy does not fit this run: {exc}.") from exc
            if global_batch is None and self.policy == "constant-batch":
                global_batch = saved  # the one the first start made, held since
        return batching.plan(self.policy, world_size=trainer.world_size, batch_size=batch_size,
                             accumulation=self.accumulation, global_batch=global_batch)

    # -- Lightning's hooks --------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        if self.sampler is None:
            return {}
        return {"sampler": self.sampler.state_dict(), "batches_in_epoch": self.batches_in_epoch,
                "global_batch": self.batching.asked, "lr_scale": self.batching.lr_scale}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.restored = dict(state_dict)

    def on_train_start(self, trainer, pl_module) -> None:
        self._handler_before = signal.getsignal(signal.SIGTERM)
        self._stop = GracefulStop()  # after Lightning registered its handlers: this one replaces them
        if self.batching is not None:
            # the optimizers are made (and restored) by now: their rates at this start's scale
            batching.rescale_lr(trainer.optimizers, [config.scheduler for config in trainer.lr_scheduler_configs],
                                self.batching.lr_scale / self._restored_scale)
        self.io.announce(trainer, self.batching)
        if self._ledger_path:
            self._ledger = SampleLedger(self._ledger_path)  # closed in teardown
            self._ledger.write({"event": "start", "step": trainer.global_step, "epoch": trainer.current_epoch,
                                "consumed": self.sampler.consumed if self.sampler else None})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.batches_in_epoch = batch_idx + 1
        # Lightning's rule: a window of accumulate_grad_batches ends an optimizer step, and so
        # does the epoch's last batch
        accumulating = bool((batch_idx + 1) % trainer.accumulate_grad_batches) and self.sampler is not None \
            and self.sampler.per_rank() > self.sampler.batch_size
        if self.sampler is not None:
            batch_size = self.sampler.batch_size
            trained = self.sampler.trained(batch_size)
            self.sampler.advance(batch_size)
            if self._ledger is not None:
                loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
                # the step that applies this batch: the next one while its window is open
                self._ledger.stepped(trainer.global_step + accumulating, trainer.current_epoch, trained,
                                     float(loss) if isinstance(loss, torch.Tensor) else None)
        # Checkpoints and stops wait for the end of an optimizer step: one amid gradient
        # accumulation would count samples whose gradients were never applied.
        if accumulating:
            return
        step = trainer.global_step
        stopping = self._stop is not None and self._stop.agreed(pl_module.device)
        if (stopping or self.every and step % self.every == 0) and 0 < step != self._saved_at \
                and self.io.directory is not None:
            self._saved_at = step
            trainer.save_checkpoint(self.io.path_for(step))
        if stopping:
            try:
                self._stop.exit()  # exit 0 where the signal came; PeerLeaving elsewhere
            except PeerLeaving as exc:
                print(f"elasticctl: {exc}", file=sys.stderr, flush=True)
                sys.exit(1)

    def on_train_end(self, trainer, pl_module) -> None:
        # Training ended (max_epochs, max_steps): the last steps are kept too, so that a run
        # started again with more epochs goes on from here.
        if self.io.directory is not None and trainer.global_step != self._saved_at:
            self._saved_at = trainer.global_step
            trainer.save_checkpoint(self.io.path_for(trainer.global_step))

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._release_signal()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._release_signal()
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None

    def _release_signal(self) -> None:
        if self._stop is not None:
            signal.signal(signal.SIGTERM, self._handler_before or signal.SIG_DFL)
            self._stop = None


class _CheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, writing the checkpoints of this integration (those in
    ``directory``) through elasticctl's :class:`Checkpointer`; any other path as Lightning does."""

    def __init__(self, directory: str | None, keep: int) -> None:
        super().__init__()
        self.directory = Path(directory) if directory else None
        self.keep = keep
        self._checkpointer: Checkpointer | None = None
        self.resumed_from: Path | None = None

    @property
    def checkpointer(self) -> Checkpointer:
        if self._checkpointer is None:  # built on first use: the rank is known by then
            self._checkpointer = Checkpointer(self.directory, keep=self.keep)
        return self._checkpointer

    def path_for(self, step: int) -> str:
        return str(self.directory / f"step-{step:08d}.pt")

    def _ours(self, path) -> bool:
        return self.directory is not None and Path(path).parent == self.directory

    def newest(self) -> Path | None:
        return self.checkpointer.newest() if self.directory is not None else None

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        if not self._ours(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        self.checkpointer.save(int(checkpoint["global_step"]), int(checkpoint["epoch"]), lightning=checkpoint,
                               blocking=True)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict[str, Any]:
        if not self._ours(path):
            return super().load_checkpoint(path, map_location, weights_only)
        payload = self.checkpointer.read(Path(path))  # digest verified, loaded with weights_only
        self.resumed_from = Path(path)
        lightning = payload["state"].get("lightning")
        if not isinstance(lightning, dict):
            raise CheckpointError(f"The checkpoint '{path}' holds no Lightning state.")
        return lightning

    def remove_checkpoint(self, path) -> None:
        if not self._ours(path):  # the newest `keep` of ours are kept by the Checkpointer
            super().remove_checkpoint(path)

    def announce(self, trainer, plan: batching.Batching | None) -> None:
        """One line on rank 0 at each start: the world, its batching, and where training resumed."""
        if trainer.global_rank != 0:
            return
        world = trainer.world_size
        batch = f"; {plan.describe()}" if plan else ""
        where = (f"resuming at step {trainer.global_step} from {self.resumed_from}"
                 if self.resumed_from else "starting from scratch" if self.directory else
                 "no checkpoint directory: a restart starts from scratch")
        print(f"elasticctl: world size {world} ({trainer.num_nodes} nodes x {trainer.num_devices}){batch}; "
              f"{where}", flush=True)


def _torchrun_world() -> tuple[int, int] | None:
    """(devices per node, nodes) of the world torchrun started this worker in, else None."""
    try:
        world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    if local < 1 or world % local:
        raise ConfigError(f"The world of {world} workers is not whole nodes of {local}: elasticctl's "
                          f"Lightning Trainer needs the same number of workers on every node.")
    return local, world // local


class Trainer(LightningTrainer):
    """Lightning's ``Trainer`` for a job whose world size changes (see the module's docstring).

    ``checkpoint_dir``: where checkpoints go (default: the job's, from ``elasticctl up
    --checkpoint-dir``; with neither, no checkpoints and a restart starts over);
    ``checkpoint_every``: optimizer steps between checkpoints (0: none); ``keep``: how many are
    kept; ``batch_policy`` and ``global_batch``: how the global batch and the learning rate follow
    the world size (:mod:`elasticctl.integrations.batching`; the default leaves them to Lightning:
    ``accumulate_grad_batches`` and the DataLoader's batch size, per worker, as the script gave
    them). Every other argument is Lightning's; ``devices`` and ``num_nodes`` default to the
    world torchrun formed, the training DataLoader is reloaded every epoch (so that an epoch
    after a resize has its own length), and Lightning's default ``ModelCheckpoint`` is off
    where these checkpoints replace it (one the user passes stays).
    """

    def __init__(self, *args: Any, checkpoint_dir: str | None = None, checkpoint_every: int = 100,
                 keep: int = 3, batch_policy: str = "framework", global_batch: int | None = None,
                 **kwargs: Any) -> None:
        batching.check_policy(batch_policy, global_batch)
        if checkpoint_every < 0:
            raise ConfigError(f"checkpoint_every ({checkpoint_every}) must be 0 (never) or a number of steps.")
        if keep < 1:  # said here, where the script gave it, not at the first checkpoint
            raise ConfigError(f"keep ({keep}) must be at least 1: the newest checkpoint is what a restart resumes from.")
        world = _torchrun_world()
        if world is not None:
            kwargs.setdefault("devices", world[0])
            kwargs.setdefault("num_nodes", world[1])
        kwargs.setdefault("reload_dataloaders_every_n_epochs", 1)
        self._elastic_io = _CheckpointIO(job_checkpoint_dir(checkpoint_dir), keep)
        self._elastic = _Elastic(self._elastic_io, checkpoint_every, environment.sample_ledger(), batch_policy,
                                 global_batch)
        callbacks = _as_list(kwargs.get("callbacks"))
        if (self._elastic_io.directory is not None and "enable_checkpointing" not in kwargs
                and not any(isinstance(callback, ModelCheckpoint) for callback in callbacks)):
            # Lightning's default ModelCheckpoint would write a second copy of every epoch's end
            # into the working directory; a ModelCheckpoint the user configured stays.
            kwargs["enable_checkpointing"] = False
        kwargs["plugins"] = [*_as_list(kwargs.get("plugins")), self._elastic_io]
        kwargs["callbacks"] = [*callbacks, self._elastic]
        super().__init__(*args, **kwargs)
        self._elastic.accumulation = self.accumulate_grad_batches  # the script's, validated by Lightning
        _deal_training_data_with(self, self._elastic)

    def fit(self, model, *args: Any, ckpt_path=None, **kwargs: Any) -> None:
        """Lightning's ``fit``; without a ``ckpt_path``, from the newest checkpoint that verifies."""
        if ckpt_path is None:
            newest = self._elastic_io.newest()
            ckpt_path = str(newest) if newest is not None else None
        with warnings.catch_warnings():
            # Lightning warns that a resume mid-epoch trains part of the epoch again unless the
            # DataLoader itself is stateful; here the sampler keeps the position instead.
            warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
            return super().fit(model, *args, ckpt_path=ckpt_path, **kwargs)


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _deal_training_data_with(trainer: LightningTrainer, elastic: _Elastic) -> None:
    """Give the training DataLoader ``elastic``'s sampler where Lightning would put its
    ``DistributedSampler`` (its data connector's ``_prepare_dataloader``)."""
    connector = trainer._data_connector
    prepare = connector._prepare_dataloader

    def prepare_dataloader(dataloader: object, shuffle: bool, mode: RunningStage) -> object:
        if (mode != RunningStage.TRAINING or not isinstance(dataloader, DataLoader)
                or isinstance(dataloader.dataset, IterableDataset) or dataloader.batch_size is None):
            if mode == RunningStage.TRAINING:
                if elastic.policy != "framework":
                    raise ConfigError(f"The batch policy '{elastic.policy}' needs a training DataLoader of a sized "
                                      "dataset and a batch size, to set each worker's batch.")
                log.warning("The training DataLoader is not one of a sized dataset and a batch size: "
                            "its position in the epoch is not kept across a restart.")
            return prepare(dataloader, shuffle, mode)
        return elastic.loader_for(trainer, dataloader, shuffle, mode)

    connector._prepare_dataloader = prepare_dataloader
