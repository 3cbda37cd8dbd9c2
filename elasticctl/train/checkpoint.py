"""Checkpoints that survive kills at any instant and load at any world size.

Layout of a checkpoint directory (shared by every node)::

    step-00001200.pt          torch.save payload (see below)
    step-00001200.pt.sha256   its digest; written last, so its presence marks the checkpoint complete
    .tmp-...                  a write in progress (or killed mid-way); ignored and cleaned up

A save writes a temp file, fsyncs it, renames it into place, then does the same
for the digest and fsyncs the directory, so a SIGKILL or power cut at any
instant leaves every earlier checkpoint intact and the newest one either
complete or ignored. Loading verifies the digest (torch's zip reader does not
notice flipped bytes in tensor data) and loads with ``weights_only=True``; a
checkpoint that fails either check is skipped with a warning in favour of the
one before it. Keep-N counts only checkpoints that pass both checks, so files
that merely look like newer checkpoints (planted, or another tool's) never
push real ones out; they are left in place with a warning.

The payload holds replicated (DDP) state, written by global rank 0 only: model
(unwrapped from DDP, so it loads without DDP and at any world size), optimizer,
LR scheduler, grad scaler, the :class:`~elasticctl.train.sampler.ResumableSampler`
position (a global sample count), RNG states, step, epoch and caller extras.
State sharded across ranks (FSDP, ZeRO) needs every rank to write its shard:
:class:`~elasticctl.train.checkpoints.sharded.ShardedCheckpointer` (importable
from here too) does that with ``torch.distributed.checkpoint``. The errors, atomic
writes and digests both use are in :mod:`elasticctl.train.checkpoints.files`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elasticctl.errors import ConfigError
from elasticctl.train.checkpoints.files import (
    UNFIT_STATE_ERRORS,
    CheckpointError,
    CheckpointWriteError,
    file_digest,
    fsync_dir,
    History,
    load_error,
    current_rank,
    files_signature,
    VerificationMemo,
    remove_stale_temp_files,
    write_atomically,
    Restored,
    check_directory,
    write_failure_reason,
)
from elasticctl.train.checkpoints.sharded import ShardedCheckpointer

__all__ = ["FORMAT", "CheckpointError", "CheckpointWriteError", "Checkpointer", "Restored",
           "ShardedCheckpointer", "check_directory", "write_failure_reason"]

log = logging.getLogger(__name__)

FORMAT = "elasticctl-checkpoint-1"
_NAME_RE = re.compile(r"^step-([0-9]{8,})\.pt$")
_DIGEST_SUFFIX = ".sha256"
# What the payload of a single-file checkpoint must hold, beyond its format, for restore to use it.
_PAYLOAD_FIELDS = {"step": int, "epoch": int, "world_size": int, "state": dict, "rng": dict,
                   "extra": dict}


def _unwrap(obj: Any) -> Any:
    """The module inside DDP / torch.compile wrappers, whose state dict has no wrapper prefixes."""
    obj = getattr(obj, "_orig_mod", obj)
    if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
        obj = obj.module
    return getattr(obj, "_orig_mod", obj)


def _copy_to_cpu(value: Any) -> Any:
    """A deep copy with every tensor on the CPU: a snapshot training can keep mutating past."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, Mapping):
        return {k: _copy_to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy_to_cpu(v) for v in value)
    return value


def _rng_state(device: torch.device) -> dict:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    try:
        import numpy as np

        np_state = np.random.get_state(legacy=False)
        state["numpy"] = {**np_state, "state": {k: (v.tolist() if hasattr(v, "tolist") else v)
                                                for k, v in np_state["state"].items()}}
    except ImportError:
        pass
    return state


def _set_rng_state(state: dict, device: torch.device, rank: int) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    try:
        import numpy as np

        if "numpy" in state:
            np_state = dict(state["numpy"])
            np_state["state"] = {k: (np.array(v, dtype=np.uint32) if isinstance(v, list) else v)
                                 for k, v in np_state["state"].items()}
            np.random.set_state(np_state)
    except ImportError:
        pass
    if rank:
        # Rank 0 continues its streams exactly; per-rank streams cannot survive a change of
        # world size, so the other ranks get distinct streams derived from rank 0's.
        seed = int(torch.randint(0, 2**62, (1,)).item()) + rank
        torch.manual_seed(seed)
        random.seed(seed)
        with contextlib.suppress(ImportError):
            import numpy as np

            np.random.seed(seed % 2**32)


class Checkpointer:
    """Save and restore replicated training state in ``directory``.

    Every rank constructs one and calls :meth:`save` at the same steps; only
    ``writer_rank`` (global rank 0) writes. With ``async_save`` a save copies
    the state to CPU memory and returns, and a background thread writes it;
    at most one write is in flight (the next save waits for it). :meth:`wait`
    blocks until the write in flight is committed; :meth:`close` waits too.
    ``environment``: the worker's
    :class:`~elasticctl.job.environment.WorkerEnvironment` if the caller decoded it (the runtime
    does); else it is decoded at the first checkpoint event.
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 3, async_save: bool = False,
                 device: torch.device | str | None = None, writer_rank: int = 0, environment=None) -> None:
        if keep < 1:
            raise ConfigError(f"The number of checkpoints to keep ({keep}) must be at least 1.")
        self.rank = current_rank()
        self.is_writer = self.rank == writer_rank
        self.directory = check_directory(directory, writable=self.is_writer)
        self.keep = keep
        self.async_save = async_save
        self.stale_after = 600.0  # seconds after which an untouched temp file is a killed write
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.last_step: int | None = None  # newest committed (or restored) checkpoint step
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # path -> (signature, loadable). Only the writer's commit path touches these, and at most
        # one commit runs at a time, so they need no lock.
        self._memo = VerificationMemo(keep)
        self._history = History(environment)  # a WorkerEnvironment, or None: decoded when needed
        # The newest write failure while writes keep failing (None once one succeeds), and how
        # many failed in a row: what the runtime publishes for status, doctor and the dashboard.
        self.failure: CheckpointWriteError | None = None
        self.failures_in_a_row = 0
        if self.is_writer:
            remove_stale_temp_files(self.directory, self.stale_after)

    def follow_rank(self, rank: int, writer_rank: int = 0) -> None:
        """This process is now global rank ``rank`` (a new generation of hot recovery)."""
        self.rank = rank
        if rank == writer_rank and not self.is_writer:
            check_directory(self.directory, writable=True)
        self.is_writer = rank == writer_rank

    # -- listing ------------------------------------------------------------------------

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints (digest present), newest first."""
        found = []
        for path in self.directory.iterdir():
            match = _NAME_RE.match(path.name)
            if match and path.with_name(path.name + _DIGEST_SUFFIX).exists():
                found.append((int(match[1]), path))
        return sorted(found, reverse=True)

    # -- saving -------------------------------------------------------------------------

    def save(self, step: int, epoch: int = 0, *, extra: dict | None = None,
             blocking: bool | None = None, **stateful: Any) -> None:
        """Checkpoint ``stateful`` objects (anything with ``state_dict()``, or plain state) at ``step``.

        ``blocking`` overrides ``async_save`` for this call (a final save on SIGTERM must block).
        Raises :class:`CheckpointError` if this or the previous background write failed.
        """
        if not self.is_writer:
            return
        self.wait()
        states = {name: (_unwrap(obj).state_dict() if hasattr(_unwrap(obj), "state_dict") else obj)
                  for name, obj in stateful.items() if obj is not None}
        payload = {
            "format": FORMAT, "step": int(step), "epoch": int(epoch), "time": time.time(),
            "world_size": dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1,
            "state": states, "rng": _rng_state(self.device), "extra": dict(extra or {}),
        }
        if blocking if blocking is not None else not self.async_save:
            self._commit(payload)
            return
        snapshot = _copy_to_cpu(payload)  # after this, training may change the live tensors
        self._thread = threading.Thread(target=self._commit_in_background, args=(snapshot,),
                                        name=f"checkpoint-step-{step}", daemon=True)
        self._thread.start()

    def _commit_in_background(self, payload: dict) -> None:
        try:
            self._commit(payload)
        except BaseException as exc:  # noqa: BLE001 - surfaced by the next save() or wait()
            self._error = exc

    def _commit(self, payload: dict) -> None:
        step = payload["step"]
        name = f"step-{step:08d}.pt"
        began = time.perf_counter()
        try:
            digest = write_atomically(self.directory, name, lambda f: torch.save(payload, f))
            try:
                # The digest goes last: its appearance is the commit.
                write_atomically(self.directory, name + _DIGEST_SUFFIX, lambda f: f.write(digest.encode()))
            except BaseException:
                # Without its digest the data file is ignored anyway: give its space back now
                # (a full disk needs it) rather than at a later prune.
                with contextlib.suppress(OSError):
                    (self.directory / name).unlink()
                raise
            fsync_dir(self.directory)
        except Exception as exc:  # OSError, or whatever torch.save raises for a failed write
            error = CheckpointWriteError(step, self.directory, write_failure_reason(exc))
            self._note_failure(error)
            raise error from exc
        if self.failure is not None:
            log.warning("rank %d: checkpoints are written again (step %d, after %d failed)",
                        self.rank, step, self.failures_in_a_row)
        self.failure, self.failures_in_a_row = None, 0
        self.last_step = step
        log.info("rank %d saved checkpoint %s", self.rank, self.directory / name)
        self._history.written(step, time.perf_counter() - began)
        self._loadable(self.directory / name, written_digest=digest)
        self._prune()

    def _note_failure(self, error: CheckpointWriteError) -> None:
        """Log every failed write; record an event when writes start failing or fail anew."""
        first = self.failure is None or self.failure.reason != error.reason
        self.failure, self.failures_in_a_row = error, self.failures_in_a_row + 1
        log.error("rank %d: %s (%d in a row)", self.rank, str(error).rstrip("."), self.failures_in_a_row)
        if first:
            self._history.failed(error.step, str(error))

    def _loadable(self, path: Path, written_digest: str | None = None) -> bool:
        """Whether ``path`` verifies as :meth:`read` would; remembered while its files are unchanged.

        ``written_digest``: the digest of what this process just wrote there, which spares
        re-reading the tensor data (the pickle is still loaded, onto the meta device).
        """
        try:
            signature = files_signature(path, path.with_name(path.name + _DIGEST_SUFFIX))
        except OSError:
            return False

        def verify() -> None:
            if written_digest is None:
                self._read(path, "cpu")
            else:
                self._read(path, "meta", digest=written_digest)

        return self._memo.check(path, signature, verify)

    def _prune(self) -> None:
        complete = self.checkpoints()
        listed = {path for _, path in complete}
        self._memo.forget(listed)
        # Only checkpoints that verify count: files that merely look like newer checkpoints must
        # not push real ones out. The newest valid one is always among the first ``keep``.
        valid = [(step, path) for step, path in complete if self._loadable(path)]
        oldest_kept = valid[min(self.keep, len(valid)) - 1][0] if valid else 0
        for _, path in valid[self.keep:]:
            for victim in (path.with_name(path.name + _DIGEST_SUFFIX), path):
                with contextlib.suppress(OSError):
                    victim.unlink()
            self._memo.results.pop(path, None)
        # Data files whose digest never landed (killed mid-commit) and are older than what we keep.
        for path in self.directory.glob("step-*.pt"):
            match = _NAME_RE.match(path.name)
            digest_path = path.with_name(path.name + _DIGEST_SUFFIX)
            if match and int(match[1]) < oldest_kept and not digest_path.exists():
                with contextlib.suppress(OSError):
                    path.unlink()

    def wait(self) -> None:
        """Block until the background write (if any) is committed; re-raise its failure."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, CheckpointError):
                raise error  # the same type and reason as a blocking save would have raised
            raise CheckpointError(f"The background checkpoint write failed: {error!r}.") from error

    @property
    def saving(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        self.wait()
        self._history.flush()

    # -- loading ------------------------------------------------------------------------

    def read(self, path: Path) -> dict:
        """Load and verify one checkpoint file onto this rank's device.

        Raises :class:`CheckpointError` on any defect.
        """
        return self._read(path, self.device)

    def _read(self, path: Path, map_location: torch.device | str,
              digest: str | None = None) -> dict:
        digest_path = path.with_name(path.name + _DIGEST_SUFFIX)
        try:
            with open(digest_path, "rb") as f:
                expected = f.read(256).strip()  # a hex sha256; whatever else is there cannot match
            actual = (digest if digest is not None else file_digest(path)).encode()
        except OSError as exc:
            raise CheckpointError(f"The checkpoint '{path}' or its digest cannot be read: "
                                  f"{exc.strerror or exc}.") from exc
        if actual != expected:
            raise CheckpointError(f"The checkpoint '{path}' does not match its digest (corrupt or partial).")
        try:
            payload = torch.load(path, map_location=map_location, weights_only=True)
        except Exception as exc:  # torch raises many types for a malformed file
            raise CheckpointError(f"The checkpoint '{path}' cannot be loaded with weights_only=True: "
                                  f"{load_error(exc)}.") from exc
        if not isinstance(payload, dict) or payload.get("format") != FORMAT:
            raise CheckpointError(f"The file '{path}' is not an elasticctl checkpoint.")
        for field, kind in _PAYLOAD_FIELDS.items():
            if not isinstance(payload.get(field), kind):
                raise CheckpointError(f"The checkpoint '{path}' has no valid '{field}' field.")
        return payload

    def _newest_readable(self) -> tuple[Path | None, dict | None]:
        for _, path in self.checkpoints():
            try:
                return path, self.read(path)
            except CheckpointError as exc:  # fall back to the previous checkpoint
                log.warning("Skipping checkpoint %s: %s", path, exc)
        return None, None

    def newest(self) -> Path | None:
        """The newest complete checkpoint that verifies (digest and payload), read onto the meta
        device: its tensors are checked, not loaded; None when there is none."""
        for _, path in self.checkpoints():
            try:
                self._read(path, "meta")
                return path
            except CheckpointError as exc:
                log.warning("Skipping checkpoint %s: %s", path, exc)
        return None

    def load_latest(self) -> dict | None:
        """The newest complete, verified checkpoint payload; every rank gets the same one.

        Rank 0 picks it (skipping defective files) and tells the others, so ranks
        never resume from different steps.
        """
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not distributed or self.rank == 0:
            path, payload = self._newest_readable()
        if distributed:
            chosen = [str(path) if self.rank == 0 and path else None]
            dist.broadcast_object_list(chosen, src=0)
            if self.rank != 0:
                if chosen[0] is None:
                    return None
                path = Path(chosen[0])
                try:
                    payload = self.read(path)
                except Exception as exc:
                    raise CheckpointError(
                        f"Rank {self.rank} cannot read the checkpoint '{path}' that rank 0 resumes from: {exc}"
                    ) from exc
        if payload is not None:
            payload["path"] = str(path)
        return payload

    def restore(self, **stateful: Any) -> Restored | None:
        """Load the newest checkpoint into ``stateful`` objects (by the names used in :meth:`save`).

        Returns None (and changes nothing) when there is no usable checkpoint.
        Restore the model before wrapping it in DDP or after: both work.
        """
        payload = self.load_latest()
        if payload is None:
            return None
        states = payload["state"]
        for name, obj in stateful.items():
            if obj is None or states.get(name) == {}:  # e.g. a GradScaler saved while disabled
                continue
            if name not in states:
                raise CheckpointError(f"The checkpoint '{payload['path']}' has no '{name}' state.")
            try:
                _unwrap(obj).load_state_dict(states[name])
            except UNFIT_STATE_ERRORS as exc:
                raise CheckpointError(
                    f"The '{name}' state in the checkpoint '{payload['path']}' does not fit this run "
                    f"(other model or flags?): {load_error(exc)}."
                ) from exc
        try:
            _set_rng_state(payload["rng"], self.device, self.rank)
        except UNFIT_STATE_ERRORS as exc:
            raise CheckpointError(
                f"The random number generator state in the checkpoint '{payload['path']}' "
                f"cannot be restored: {load_error(exc)}.") from exc
        self.last_step = payload["step"]
        return Restored(step=payload["step"], epoch=payload["epoch"], path=Path(payload["path"]),
                        world_size=payload["world_size"], extra=payload["extra"])
