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
State sharded across ranks (FSDP, ZeRO) needs every rank to write its shard;
:class:`ShardedCheckpointer` does that with ``torch.distributed.checkpoint``
(DCP) into one directory per checkpoint::

    step-00001200/
        .metadata           DCP's index of the shards (a pickle)
        __0_0.distcp ...    the shards, one or more per rank
        extra.json          step, epoch, sampler position, ...
        manifest.json       {"format": ..., "files": {name: sha256}}: every other file, written last

A sharded checkpoint is used only if its manifest lists exactly the files
present and every digest matches. DCP unpickles ``.metadata`` with
``pickle.load``, and a manifest proves integrity, not authorship, so the
metadata is read with an unpickler that allows only DCP's own metadata classes,
and non-tensor values are loaded with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import hashlib
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elasticctl.errors import ConfigError, ElasticctlError

log = logging.getLogger(__name__)

FORMAT = "elasticctl-checkpoint-1"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "elasticctl-sharded-manifest-1"
_NAME_RE = re.compile(r"^step-([0-9]{8,})\.pt$")
_DIR_RE = re.compile(r"^step-([0-9]{8,})$")
_DIGEST_SUFFIX = ".sha256"
_TMP_PREFIX = ".tmp-"
_DCP_METADATA = ".metadata"
_EXTRA = "extra.json"
# What the payload of a single-file checkpoint must hold, beyond its format, for restore to use it.
_PAYLOAD_FIELDS = {"step": int, "epoch": int, "world_size": int, "state": dict, "rng": dict,
                   "extra": dict}
# What load_state_dict and the RNG setters raise for state of the wrong shape or kind.
_UNFIT_STATE_ERRORS = (ArithmeticError, AttributeError, LookupError, RuntimeError, TypeError,
                       ValueError)


class CheckpointError(ElasticctlError):
    """A checkpoint could not be written, or the one every rank agreed on could not be read."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written; ``reason`` says why in a few words ("the disk is full")."""

    def __init__(self, step: int, directory: Path, reason: str) -> None:
        super().__init__(f"Writing the checkpoint of step {step} to '{directory}' failed: {reason}.")
        self.step = step
        self.directory = directory
        self.reason = reason


# Why a write fails, for the errors where the operator's fix is about the storage itself.
_STORAGE_REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EROFS: "the file system is read-only",
    errno.EIO: "the storage reports an I/O error",
}


def write_failure_reason(exc: BaseException) -> str:
    """Why a checkpoint write failed, in a few words: the storage's state first when that is the
    cause ("the disk is full (No space left on device)"), else the error itself."""
    if isinstance(exc, OSError):
        text = exc.strerror or str(exc)
        storage = _STORAGE_REASONS.get(exc.errno or 0)
        return f"{storage} ({text})" if storage else text
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


@dataclasses.dataclass(frozen=True)
class Restored:
    """What :meth:`Checkpointer.restore` loaded."""

    step: int
    epoch: int
    path: Path
    world_size: int  # the world size that wrote it
    extra: dict


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """A write-only file wrapper that digests what passes through (torch.save writes sequentially)."""

    def __init__(self, file) -> None:
        self.file = file
        self.digest = hashlib.sha256()
        self.error: OSError | None = None

    def write(self, data) -> int:
        self.digest.update(data)
        try:
            return self.file.write(data)
        except OSError as exc:
            # torch.save turns a failed write into RuntimeError("... unexpected pos ..."): keep
            # the real cause (ENOSPC: the disk is full) for the error the caller sees.
            self.error = exc
            raise

    def flush(self) -> None:
        self.file.flush()


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _signature(*paths: Path) -> tuple:
    """Name, size and mtime of each file: what verification results are remembered by."""
    return tuple((p.name, st.st_size, st.st_mtime_ns) for p in paths for st in [p.stat()])


def _load_error(exc: BaseException) -> str:
    """The gist of a torch.load failure (its full text is a page of advice on loading unsafely)."""
    text = str(exc)
    gist = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\.\s|\n\n|$)", text, re.DOTALL)
    lines = text.strip().splitlines()
    reason = gist[1] if gist else (lines[0] if lines else type(exc).__name__)
    return " ".join(reason.split()).rstrip(":. ")


def _write_atomically(directory: Path, name: str, write) -> str:
    """Write ``directory/name`` through ``write(file)`` via temp file + fsync + rename; return its sha256."""
    tmp = directory / f"{_TMP_PREFIX}{name}.{os.getpid()}"
    writer: _HashingWriter | None = None
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            write(writer)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / name)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if writer is not None and writer.error is not None and not isinstance(exc, OSError):
            raise writer.error from exc  # what torch.save's RuntimeError hides
        raise
    return writer.digest.hexdigest()


def check_directory(directory: str | os.PathLike, writable: bool) -> Path:
    """Create ``directory`` if needed and check access, or raise a one-sentence :class:`ConfigError`."""
    path = Path(directory)
    try:  # every rank may create it: readers must not race the writer that would
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"The checkpoint directory '{path}' cannot be created: {exc.strerror}.") from exc
    if not path.is_dir():
        raise ConfigError(f"The checkpoint directory '{path}' does not exist or is not a directory.")
    mode = os.R_OK | os.X_OK | (os.W_OK if writable else 0)
    if not os.access(path, mode):
        what = "readable and writable" if writable else "readable"
        raise ConfigError(f"The checkpoint directory '{path}' is not {what} by this user.")
    return path


class _VerificationMemo:
    """Which checkpoints verified, remembered per path while their files keep the same
    signature (names, sizes, mtimes); each failure is warned about once."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.results: dict[Path, tuple[tuple, bool]] = {}
        self._warned: set[tuple[Path, tuple]] = set()

    def check(self, path: Path, signature: tuple, verify) -> bool:
        """``verify()`` raises CheckpointError for a checkpoint that must not count."""
        cached = self.results.get(path)
        if cached is not None and cached[0] == signature:
            return cached[1]
        try:
            verify()
            valid = True
        except CheckpointError as exc:
            valid = False
            if (path, signature) not in self._warned:
                self._warned.add((path, signature))
                log.warning("Ignoring %s (not counted towards keep=%d, left in place): %s",
                            path, self.keep, exc)
        self.results[path] = (signature, valid)
        return valid

    def forget(self, keep_only) -> None:
        self.results = {p: v for p, v in self.results.items() if p in keep_only}


class _History:
    """Records ``checkpoint_written`` and ``checkpoint_failed`` in the job's event history (under elasticctl, else nothing),
    from a background thread: a checkpoint never waits for etcd. ``environment``: the worker's,
    if its caller decoded it already; else it is decoded at the first event."""

    def __init__(self, environment=None) -> None:
        self._environment = environment
        self._log: Any = None
        self._checked = False

    def written(self, step: int, seconds: float) -> None:
        self._record("CHECKPOINT_WRITTEN", step=step, duration=round(seconds, 3))

    def failed(self, step: int, reason: str) -> None:
        self._record("CHECKPOINT_FAILED", step=step, reason=reason)

    def _record(self, kind: str, **fields) -> None:
        if not self._checked:
            self._checked = True
            from elasticctl.job.environment import WorkerEnvironment
            from elasticctl.job.events import EventLog  # grpc only under elasticctl

            self._environment = self._environment or WorkerEnvironment.from_env()
            self._log = EventLog.from_env(self._environment)
        if self._log is not None:
            from elasticctl.job.records import EventKind

            self._log.record_later(EventKind[kind], self._environment.node, **fields)

    def flush(self, timeout: float = 5.0) -> None:
        if self._log is not None:
            self._log.flush(timeout)


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
        self.rank = _rank()
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
        self._memo = _VerificationMemo(keep)
        self._history = _History(environment)  # a WorkerEnvironment, or None: decoded when needed
        # The newest write failure while writes keep failing (None once one succeeds), and how
        # many failed in a row: what the runtime publishes for status, doctor and the dashboard.
        self.failure: CheckpointWriteError | None = None
        self.failures_in_a_row = 0
        if self.is_writer:
            self._remove_stale_temp_files()

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

    def _remove_stale_temp_files(self) -> None:
        # Only long-untouched ones: a fresh temp file may be another process's write in progress
        # (a previous rank 0 still shutting down, or a tool reading this directory).
        cutoff = time.time() - self.stale_after
        for path in self.directory.glob(f"{_TMP_PREFIX}*"):
            with contextlib.suppress(OSError):
                if path.stat().st_mtime < cutoff:
                    path.unlink()

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
            digest = _write_atomically(self.directory, name, lambda f: torch.save(payload, f))
            try:
                # The digest goes last: its appearance is the commit.
                _write_atomically(self.directory, name + _DIGEST_SUFFIX, lambda f: f.write(digest.encode()))
            except BaseException:
                # Without its digest the data file is ignored anyway: give its space back now
                # (a full disk needs it) rather than at a later prune.
                with contextlib.suppress(OSError):
                    (self.directory / name).unlink()
                raise
            _fsync_dir(self.directory)
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
            signature = _signature(path, path.with_name(path.name + _DIGEST_SUFFIX))
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
            actual = (digest if digest is not None else _file_digest(path)).encode()
        except OSError as exc:
            raise CheckpointError(f"The checkpoint '{path}' or its digest cannot be read: "
                                  f"{exc.strerror or exc}.") from exc
        if actual != expected:
            raise CheckpointError(f"The checkpoint '{path}' does not match its digest (corrupt or partial).")
        try:
            payload = torch.load(path, map_location=map_location, weights_only=True)
        except Exception as exc:  # torch raises many types for a malformed file
            raise CheckpointError(f"The checkpoint '{path}' cannot be loaded with weights_only=True: "
                                  f"{_load_error(exc)}.") from exc
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
            except _UNFIT_STATE_ERRORS as exc:
                raise CheckpointError(
                    f"The '{name}' state in the checkpoint '{payload['path']}' does not fit this run "
                    f"(other model or flags?): {_load_error(exc)}."
                ) from exc
        try:
            _set_rng_state(payload["rng"], self.device, self.rank)
        except _UNFIT_STATE_ERRORS as exc:
            raise CheckpointError(
                f"The random number generator state in the checkpoint '{payload['path']}' "
                f"cannot be restored: {_load_error(exc)}.") from exc
        self.last_step = payload["step"]
        return Restored(step=payload["step"], epoch=payload["epoch"], path=Path(payload["path"]),
                        world_size=payload["world_size"], extra=payload["extra"])


# Exactly the globals torch 2.14's FileSystemWriter pickles into ``.metadata`` (found by saving
# model and optimizer state and listing the pickle's globals), plus every torch dtype.
_DCP_METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # where each item lies
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how torch pickles a torch.layout
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
})


@functools.cache
def _torch_dtype_names() -> frozenset[str]:
    # vars(), not getattr(): torch's module __getattr__ imports submodules on demand.
    return frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, refusing every global outside the allow-list (no code runs)."""

    def __init__(self, data: bytes, path: Path) -> None:
        super().__init__(io.BytesIO(data))
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _DCP_METADATA_GLOBALS or (
            module == "torch" and name in _torch_dtype_names())
        if not allowed:
            raise CheckpointError(
                f"The DCP metadata '{self.path}' refers to {module}.{name}, which is not one of "
                f"the torch checkpoint metadata classes it may contain.")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(
            f"The DCP metadata '{self.path}' holds a persistent id, which DCP never writes.")


def _load_dcp_metadata(path: Path) -> Any:
    """The DCP ``Metadata`` in ``path``, unpickled with the allow-list; CheckpointError if not."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    try:
        data = path.read_bytes()  # in memory: a length field in the pickle cannot ask for more
        metadata = _MetadataUnpickler(data, path).load()
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(
            f"The DCP metadata '{path}' cannot be read: {exc.strerror or exc}.") from exc
    except Exception as exc:  # the unpickler raises many types for a malformed file
        raise CheckpointError(f"The DCP metadata '{path}' is malformed: {exc!r}.") from exc
    if not (isinstance(metadata, Metadata)
            and isinstance(getattr(metadata, "state_dict_metadata", None), dict)
            and isinstance(getattr(metadata, "storage_data", None), dict)
            and isinstance(getattr(metadata, "storage_meta", None), (StorageMeta, type(None)))):
        raise CheckpointError(f"The file '{path}' does not hold DCP checkpoint metadata.")
    return metadata


@functools.cache
def _dcp_loading() -> tuple[type, type]:
    """DCP's file reader and load planner, minus their unrestricted unpickling (built on first use:
    importing torch.distributed.checkpoint takes a second)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class RestrictedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            name = _DCP_METADATA if rank is None else f"__{rank}{_DCP_METADATA}"
            metadata = _load_dcp_metadata(Path(self.checkpoint_id) / name)
            # As FileSystemReader.read_metadata does after its pickle.load.
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            # DefaultLoadPlanner loads non-tensor values (optimizer hyperparameters, ...) with
            # weights_only=False. Load them safely, and hand it bytes re-serialized from the result.
            fqn = read_item.dest_index.fqn
            try:
                safe = torch.load(value, weights_only=True)
            except Exception as exc:  # torch raises many types for malformed bytes
                raise CheckpointError(
                    f"The value '{fqn}' in the sharded checkpoint cannot be loaded with "
                    f"weights_only=True: {_load_error(exc)}.") from exc
            buffer = io.BytesIO()
            torch.save(safe, buffer)
            buffer.seek(0)
            super().load_bytes(read_item, buffer)

    return RestrictedReader, WeightsOnlyPlanner


def _read_manifest(directory: Path) -> dict[str, str]:
    """The ``{file name: sha256}`` that the manifest of a sharded checkpoint lists."""
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_bytes())
    except OSError as exc:
        raise CheckpointError(
            f"The manifest '{path}' cannot be read: {exc.strerror or exc}.") from exc
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, or nested absurdly deep
        raise CheckpointError(f"The manifest '{path}' is not valid JSON: {exc}.") from exc
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not (isinstance(manifest, dict) and manifest.get("format") == MANIFEST_FORMAT
            and isinstance(files, dict)):
        raise CheckpointError(
            f"The file '{path}' is not an elasticctl sharded checkpoint manifest.")
    for name, digest in files.items():
        # Plain names only: a manifest must not point outside its directory, nor at itself.
        plain = name not in ("", ".", "..", MANIFEST) and "/" not in name and "\\" not in name
        if not plain or not isinstance(digest, str):
            raise CheckpointError(f"The manifest '{path}' has an invalid entry {name!r}.")
    return files


def _verify_sharded(directory: Path, digests: Mapping[str, str] | None = None) -> dict:
    """Check a sharded checkpoint before torch reads any of it; return its extras.

    Raises :class:`CheckpointError` unless the manifest lists exactly the files present, each
    matches its digest (``digests``: ones just computed, instead of re-reading the files), the
    metadata passes the allow-list and points only at listed files, and extra.json has the step.
    """
    files = _read_manifest(directory)
    try:
        present = {p.name for p in directory.iterdir()} - {MANIFEST}
    except OSError as exc:
        raise CheckpointError(f"The sharded checkpoint '{directory}' cannot be listed: "
                              f"{exc.strerror or exc}.") from exc
    missing, unlisted = sorted(set(files) - present), sorted(present - set(files))
    if missing or unlisted:
        raise CheckpointError(f"The sharded checkpoint '{directory}' does not match its manifest "
                              f"(missing {missing}, unlisted {unlisted}).")
    for required in (_DCP_METADATA, _EXTRA):
        if required not in files:
            raise CheckpointError(
                f"The manifest of the sharded checkpoint '{directory}' does not list {required}.")
    for name, expected in sorted(files.items()):
        try:
            actual = digests[name] if digests is not None else _file_digest(directory / name)
        except (OSError, KeyError) as exc:
            raise CheckpointError(f"The file '{directory / name}' cannot be read: {exc}.") from exc
        if actual != expected:
            raise CheckpointError(f"The file '{directory / name}' does not match the digest in its "
                                  "manifest (corrupt, partial or replaced).")
    metadata = _load_dcp_metadata(directory / _DCP_METADATA)
    shards = set(files) - {_DCP_METADATA, _EXTRA}
    for info in metadata.storage_data.values():
        # Only getattr and isinstance: the objects' own methods may fail on the __dict__ a
        # pickle gave them.
        where = getattr(info, "relative_path", None)
        if not isinstance(where, str) or where not in shards:
            raise CheckpointError(f"The DCP metadata '{directory / _DCP_METADATA}' refers to data "
                                  f"outside the files its manifest lists: {where!r}.")
    try:
        extra = json.loads((directory / _EXTRA).read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(
            f"The file '{directory / _EXTRA}' cannot be read as JSON: {exc}.") from exc
    if not isinstance(extra, dict) or type(extra.get("step")) is not int:
        raise CheckpointError(f"The file '{directory / _EXTRA}' has no integer 'step'.")
    return extra


class ShardedCheckpointer:
    """Checkpoints of sharded state (FSDP2 ``fully_shard``, DTensor) with DCP.

    Every rank writes its own shard into a temp directory; once all are done,
    rank 0 adds ``extra.json`` (step, epoch, sampler position, ...), every rank
    digests a share of the files, rank 0 writes the manifest and renames the
    directory to ``step-NNNNNNNN/``, so a partial save is never taken for a
    complete one. DCP reshards on load, so a checkpoint written at world size W
    loads at any other size. Model and optimizer go through ``get_state_dict`` /
    ``set_state_dict``, which understand FSDP's parameter sharding. Saving and
    restoring are collectives: call them on every rank.
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 3) -> None:
        if keep < 1:
            raise ConfigError(f"The number of checkpoints to keep ({keep}) must be at least 1.")
        self.rank = _rank()
        self.directory = check_directory(directory, writable=self.rank == 0)
        self.keep = keep
        self.last_step: int | None = None
        self._memo = _VerificationMemo(keep)
        self._history = _History()

    def _candidates(self) -> list[tuple[int, Path]]:
        """Directories named like checkpoints that have a manifest, newest first."""
        found = []
        for path in self.directory.iterdir():
            match = _DIR_RE.match(path.name)
            if match and (path / MANIFEST).is_file():
                found.append((int(match[1]), path))
        return sorted(found, reverse=True)

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Verified sharded checkpoints (see :func:`_verify_sharded`), newest first.

        A directory is verified again only when one of its files changed (name, size or mtime).
        """
        return [(step, path) for step, path in self._candidates() if self._valid(path)]

    def _valid(self, path: Path, digests: Mapping[str, str] | None = None) -> bool:
        try:
            signature = _signature(*sorted(path.iterdir()))
        except OSError:
            return False
        return self._memo.check(path, signature, lambda: _verify_sharded(path, digests))

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             extra: dict | None = None) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        began = time.perf_counter()
        model_state, optim_state = get_state_dict(model, optimizer)
        name = f"step-{step:08d}"
        tmp = self.directory / f"{_TMP_PREFIX}{name}"
        if self.rank == 0:  # files a save killed before its rename left would enter the manifest
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
        # dcp.save returns on every rank once the metadata is written. Every failure below is
        # shared with all ranks instead of raised alone, which would leave the others waiting.
        listing: list[Any] = [None]
        if self.rank == 0:
            try:
                (tmp / _EXTRA).write_text(json.dumps({"step": step, **(extra or {})}))
                listing[0] = sorted(p.name for p in tmp.iterdir())
            except (TypeError, ValueError) as exc:
                listing[0] = f"The extras of the checkpoint of step {step} are not JSON: {exc}."
            except OSError as exc:
                listing[0] = f"Writing '{tmp / _EXTRA}' failed: {exc.strerror or exc}."
        dist.broadcast_object_list(listing, src=0)
        if isinstance(listing[0], str):
            raise CheckpointError(listing[0])
        # Each rank digests a share, so rank 0 does not read the whole checkpoint alone.
        world = dist.get_world_size()
        share: dict[str, str] | str
        try:
            share = {n: _file_digest(tmp / n) for n in listing[0][self.rank::world]}
        except OSError as exc:
            share = (f"Rank {self.rank} cannot read '{exc.filename}' to digest it: "
                     f"{exc.strerror or exc}.")
        shares: list[Any] = [None] * world
        dist.all_gather_object(shares, share)
        errors = [s for s in shares if isinstance(s, str)]
        if errors:
            raise CheckpointError(errors[0])
        outcome: list[str | None] = [None]
        if self.rank == 0:
            digests = {n: d for s in shares for n, d in s.items()}
            try:
                self._commit(tmp, self.directory / name, digests)
            except OSError as exc:
                outcome[0] = (f"Committing the sharded checkpoint '{self.directory / name}' "
                              f"failed: {exc.strerror or exc}.")
        dist.broadcast_object_list(outcome, src=0)  # also keeps the ranks together, like a barrier
        if outcome[0] is not None:
            raise CheckpointError(outcome[0])
        self.last_step = step
        if self.rank == 0:
            self._history.written(step, time.perf_counter() - began)

    def _commit(self, tmp: Path, final: Path, digests: dict[str, str]) -> None:
        manifest = json.dumps({"format": MANIFEST_FORMAT, "files": digests}, indent=1,
                              sort_keys=True)
        # The manifest goes last, atomically; the rename then publishes the complete directory.
        _write_atomically(tmp, MANIFEST, lambda f: f.write(manifest.encode()))
        _fsync_dir(tmp)
        os.replace(tmp, final)
        _fsync_dir(self.directory)
        log.info("rank %d saved sharded checkpoint %s", self.rank, final)
        self._valid(final, digests)  # checked without re-reading the shards just digested
        self._prune()

    def _prune(self) -> None:
        candidates = self._candidates()
        listed = {path for _, path in candidates}
        self._memo.forget(listed)
        # As in Checkpointer: only verified checkpoints count towards keep.
        for _, old in [(s, p) for s, p in candidates if self._valid(p)][self.keep:]:
            shutil.rmtree(old, ignore_errors=True)
            self._memo.results.pop(old, None)

    def _newest_verified(self) -> tuple[str, dict] | None:
        """Rank 0's pick: the newest checkpoint that verifies now (not from memory), and extras."""
        for _, path in self._candidates():
            try:
                return str(path), _verify_sharded(path)
            except CheckpointError as exc:  # fall back to the previous checkpoint
                log.warning("Skipping sharded checkpoint %s: %s", path, exc)
        return None

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict | None:
        """Load the newest verified checkpoint into model and optimizer; return its extras or None.

        Rank 0 picks it (skipping any that fail verification) and tells the others.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        chosen = [self._newest_verified() if self.rank == 0 else None]
        dist.broadcast_object_list(chosen, src=0)
        if chosen[0] is None:
            return None
        path, extra = chosen[0]
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        reader, planner = _dcp_loading()
        try:
            dcp.load(state, storage_reader=reader(path), planner=planner())
        except (dcp.CheckpointException, Exception) as exc:  # DCP's is a BaseException
            # DCP raises every rank's failure on every rank, as {rank: (exception, traceback)}.
            failures = getattr(exc, "failures", None) or {self.rank: exc}
            rank = min(failures)
            cause = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
            raise CheckpointError(f"Loading the sharded checkpoint '{path}' failed on rank {rank}: "
                                  f"{_load_error(cause)}.") from exc
        try:
            set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        except _UNFIT_STATE_ERRORS as exc:
            raise CheckpointError(f"The state in the sharded checkpoint '{path}' does not fit this "
                                  f"run (other model or flags?): {_load_error(exc)}.") from exc
        self.last_step = int(extra["step"])
        return extra
