"""Checkpoints of sharded state (FSDP, ZeRO, DTensor): every rank writes its shard.

:class:`ShardedCheckpointer` writes with ``torch.distributed.checkpoint`` (DCP)
into one directory per checkpoint::

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

import functools
import io
import json
import logging
import os
import pickle
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elasticctl.errors import ConfigError
from elasticctl.train.checkpoints.files import (
    TMP_PREFIX,
    UNFIT_STATE_ERRORS,
    CheckpointError,
    file_digest,
    fsync_dir,
    History,
    load_error,
    current_rank,
    files_signature,
    VerificationMemo,
    write_atomically,
    Restored,
    check_directory,
)

log = logging.getLogger("elasticctl.train.checkpoint")  # the checkpoint messages' logger, as before

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "elasticctl-sharded-manifest-1"
_DIR_RE = re.compile(r"^step-([0-9]{8,})$")
_DCP_METADATA = ".metadata"
_EXTRA = "extra.json"


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
                    f"weights_only=True: {load_error(exc)}.") from exc
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
            actual = digests[name] if digests is not None else file_digest(directory / name)
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
        self.rank = current_rank()
        self.directory = check_directory(directory, writable=self.rank == 0)
        self.keep = keep
        self.last_step: int | None = None
        self.last_path: Path | None = None  # the checkpoint the last restore loaded
        self._memo = VerificationMemo(keep)
        self._history = History()

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
            signature = files_signature(*sorted(path.iterdir()))
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
        tmp = self.directory / f"{TMP_PREFIX}{name}"
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
            share = {n: file_digest(tmp / n) for n in listing[0][self.rank::world]}
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

    def close(self) -> None:
        self._history.flush()

    def _commit(self, tmp: Path, final: Path, digests: dict[str, str]) -> None:
        manifest = json.dumps({"format": MANIFEST_FORMAT, "files": digests}, indent=1,
                              sort_keys=True)
        # The manifest goes last, atomically; the rename then publishes the complete directory.
        write_atomically(tmp, MANIFEST, lambda f: f.write(manifest.encode()))
        fsync_dir(tmp)
        os.replace(tmp, final)
        fsync_dir(self.directory)
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
                                  f"{load_error(cause)}.") from exc
        try:
            set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        except UNFIT_STATE_ERRORS as exc:
            raise CheckpointError(f"The state in the sharded checkpoint '{path}' does not fit this "
                                  f"run (other model or flags?): {load_error(exc)}.") from exc
        self.last_step = int(extra["step"])
        self.last_path = Path(path)
        return extra


# What a sharded checkpoint's extra.json holds of the state besides step and epoch: the runtime's
# fields and the small objects' state dicts (JSON: the sampler's position, a scheduler's counters).
_STATE_EXTRAS = ("scheduler", "scaler", "sampler")


class ShardedStateCheckpointer:
    """The runtime's checkpointer of a sharded :class:`~elasticctl.train.state.State` (``run(...,
    sharded=True)``), with :class:`~elasticctl.train.checkpoint.Checkpointer`'s interface over a
    :class:`ShardedCheckpointer`: model and optimizer as DCP shards (every rank writes its own,
    resharded on load), the step, epoch, world size, fields, scheduler, scaler and sampler in
    ``extra.json``. Saves are collectives and block (no background write); every rank reports
    the same failure. The random number generators' states are not saved."""

    async_save = False

    def __init__(self, directory: str | os.PathLike, keep: int = 3, **_: Any) -> None:
        self._inner = ShardedCheckpointer(directory, keep=keep)
        self.directory = self._inner.directory
        self.is_writer = self._inner.rank == 0
        self.failure: CheckpointError | None = None
        self.failures_in_a_row = 0

    @property
    def last_step(self) -> int | None:
        return self._inner.last_step

    def follow_rank(self, rank: int, writer_rank: int = 0) -> None:
        if rank == writer_rank and not self.is_writer:
            check_directory(self.directory, writable=True)
        self._inner.rank, self.is_writer = rank, rank == writer_rank

    def save(self, step: int, epoch: int = 0, *, extra: dict | None = None, blocking: bool | None = None,
             model: torch.nn.Module, optimizer: torch.optim.Optimizer, **objects: Any) -> None:
        extras = {"epoch": int(epoch), "world_size": dist.get_world_size(), **(extra or {}),
                  **{name: obj.state_dict() for name, obj in objects.items() if name in _STATE_EXTRAS}}
        try:
            self._inner.save(step, model, optimizer, extra=extras)
        except CheckpointError as exc:
            self.failure, self.failures_in_a_row = exc, self.failures_in_a_row + 1
            log.error("rank %d: %s (%d in a row)", self._inner.rank, str(exc).rstrip("."), self.failures_in_a_row)
            raise
        self.failure, self.failures_in_a_row = None, 0

    def restore(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **objects: Any) -> Any:
        """Load the newest verified checkpoint into the state's objects (resharded to this world);
        a :class:`~elasticctl.train.checkpoint.Restored`, or None when there is none."""

        extra = self._inner.restore(model, optimizer)
        if extra is None:
            return None
        path = self._inner.last_path
        for name, obj in objects.items():
            if name not in _STATE_EXTRAS or obj is None or not extra.get(name):
                continue
            try:
                obj.load_state_dict(extra[name])
            except UNFIT_STATE_ERRORS as exc:
                raise CheckpointError(f"The '{name}' state in the sharded checkpoint '{path}' does not fit "
                                      f"this run (other model or flags?): {load_error(exc)}.") from exc
        fields = extra.get("fields")
        return Restored(step=extra["step"], epoch=_whole(extra.get("epoch")), path=path,
                        world_size=_whole(extra.get("world_size")),
                        extra={"fields": fields if isinstance(fields, dict) else {}})

    def wait(self) -> None:
        """Nothing in the background: saves block."""

    def close(self) -> None:
        self._inner.close()


def _whole(value: Any) -> int:
    """An integer of extra.json (verified JSON, but any member's): 0 if it is not one."""
    return value if type(value) is int else 0
