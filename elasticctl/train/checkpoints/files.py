"""What the replicated and the sharded checkpoints share: their errors, atomic writes and digests.

A file is written to a temp file (``.tmp-...``), fsynced and renamed into place, and
its sha256 is computed on the way; directories are fsynced after renames. A write
that fails says why in a few words (:func:`write_failure_reason`: "the disk is
full"). :class:`VerificationMemo` remembers which checkpoints verified while
their files are unchanged; :class:`History` records checkpoint events in the job's
history. Messages go to the ``elasticctl.train.checkpoint`` logger, as before these
modules were split from ``checkpoint.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import logging
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from elasticctl.errors import ConfigError, ElasticctlError

log = logging.getLogger("elasticctl.train.checkpoint")

TMP_PREFIX = ".tmp-"
# What load_state_dict and the RNG setters raise for state of the wrong shape or kind.
UNFIT_STATE_ERRORS = (ArithmeticError, AttributeError, LookupError, RuntimeError, TypeError,
                       ValueError)


@dataclasses.dataclass(frozen=True)
class Restored:
    """What a checkpointer's ``restore`` loaded (the replicated and the sharded one alike)."""

    step: int
    epoch: int
    path: Path
    world_size: int  # the world size that wrote it
    extra: dict


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


def process_rank(group_rank: int | None, environ: Mapping[str, str]) -> int:
    """This process's rank: its process group's (``group_rank``, None while there is none), else
    the ``RANK`` torchrun hands every worker, which its group will have once the script calls
    ``init_process_group`` (a Checkpointer built at module level, before it: not every worker a
    writer); 0 outside any launcher or with a ``RANK`` that is no number."""
    if group_rank is not None:
        return group_rank
    try:
        return max(int(environ.get("RANK", "0")), 0)
    except ValueError:
        return 0


def current_rank() -> int:
    return process_rank(dist.get_rank() if dist.is_available() and dist.is_initialized() else None, os.environ)


def fsync_dir(path: Path) -> None:
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


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def files_signature(*paths: Path) -> tuple:
    """Name, size and mtime of each file: what verification results are remembered by."""
    return tuple((p.name, st.st_size, st.st_mtime_ns) for p in paths for st in [p.stat()])


def load_error(exc: BaseException) -> str:
    """The gist of a torch.load failure (its full text is a page of advice on loading unsafely)."""
    text = str(exc)
    gist = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\.\s|\n\n|$)", text, re.DOTALL)
    lines = text.strip().splitlines()
    reason = gist[1] if gist else (lines[0] if lines else type(exc).__name__)
    return " ".join(reason.split()).rstrip(":. ")


def write_atomically(directory: Path, name: str, write) -> str:
    """Write ``directory/name`` through ``write(file)`` via temp file + fsync + rename; return its sha256."""
    tmp = directory / f"{TMP_PREFIX}{name}.{os.getpid()}"
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


class VerificationMemo:
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


class History:
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


def remove_stale_temp_files(directory: Path, older_than: float) -> None:
    """Temp files of writes that never finished, left in ``directory`` for over ``older_than``
    seconds. Only long-untouched ones: a fresh temp file may be another process's write in progress
    (a previous rank 0 still shutting down, or a tool reading this directory)."""
    cutoff = time.time() - older_than
    for path in directory.glob(f"{TMP_PREFIX}*"):
        with contextlib.suppress(OSError):
            if path.stat().st_mtime < cutoff:
                path.unlink()
