"""The worker's checkpoint duty: the periodic save, the one before some workers leave, the final
one (retried, agreed on by every rank), and the restore of the newest one.

It owns the checkpointer (made for the first generation, following this worker's rank after
that) and reports what it did through ``emit`` (the script's ``on_event``). A failed periodic save
costs training nothing (no re-formation, no restart): the checkpointer logs it and records a
``checkpoint_failed`` event, the progress record carries it to status, doctor and the dashboard,
and the next save tries again. How often the final checkpoint is retried is the lifecycle's
(:func:`elasticctl.train.worker.lifecycle.final_checkpoint_retry`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elasticctl.job.environment import WorkerEnvironment
from elasticctl.train import entry as worker_entry
from elasticctl.train.worker import lifecycle
from elasticctl.train.checkpoint import CheckpointError, Checkpointer
from elasticctl.train.checkpoints.sharded import ShardedStateCheckpointer
from elasticctl.train.state import State

log = logging.getLogger(__name__)

AGREED_FAILURE_BYTES = 1024  # the longest failure text one rank tells the others


class CheckpointDuty:
    """Checkpoints of ``state`` under ``directory`` (None: none are written), every ``every`` steps
    (0: only the final one), ``keep`` of them; ``sharded``: DCP shards, resharded on load."""

    def __init__(self, state: State, directory: str | None, *, every: int, keep: int, async_save: bool,
                 sharded: bool, device: torch.device, environment: WorkerEnvironment, worker: str,
                 emit: Callable[..., None], sleep: Callable[[float], None] = time.sleep) -> None:
        self.state = state
        self.directory = directory
        self.every = every
        self.keep = keep
        self.async_save = async_save
        self.sharded = sharded
        self.device = device
        self.environment = environment
        self.worker = worker
        self._emit = emit
        self._sleep = sleep
        self.checkpointer: Checkpointer | None = None

    # -- a generation's rank ---------------------------------------------------------------

    def follow_rank(self, rank: int) -> None:
        """The checkpointer for this worker's ``rank`` in the generation now forming."""
        if not self.directory:
            return
        if self.checkpointer is None:
            kind = ShardedStateCheckpointer if self.sharded else Checkpointer
            self.checkpointer = kind(self.directory, keep=self.keep, async_save=self.async_save,
                                     device=self.device, environment=self.environment)
            return
        self.checkpointer.follow_rank(rank)

    @property
    def last_step(self) -> int | None:
        return self.checkpointer.last_step if self.checkpointer else None

    def health(self) -> dict:
        """The progress record's checkpoint fields: set while checkpoints fail."""
        failure = self.checkpointer.failure if self.checkpointer else None
        if failure is None:
            return {}
        return {"checkpoint_error": str(failure), "checkpoint_failures": self.checkpointer.failures_in_a_row}

    # -- saves -------------------------------------------------------------------------------

    def at_boundary(self, step: int) -> None:
        """The periodic save, every ``every`` steps."""
        if self.checkpointer and self.every and step % self.every == 0:
            self.save()

    def now(self) -> None:
        """:meth:`State.checkpoint`: a save at a point every worker reaches (not a boundary), even
        at a step already saved: the state may have moved on (a new epoch)."""
        if self.checkpointer is not None:
            self.save()

    def save(self, blocking: bool | None = None) -> bool:
        """Checkpoint the state; False if the write failed (or, async, if the previous one did).
        Only rank 0 writes, and no collective runs here, so the other ranks need not hear of a
        failure."""
        self._report_background_failure()  # else save() would raise it and skip this save
        began = time.perf_counter()
        try:
            self.checkpointer.save(self.state.step, self._epoch(), extra={"fields": self.state.fields},
                                   blocking=blocking, **self.state.objects())
        except CheckpointError as exc:
            self._emit("checkpoint_failed", step=self.state.step, reason=str(exc))
            return False
        if self.checkpointer.is_writer:  # blocked_ms: how long the training thread stood still for it
            self._emit("checkpoint", step=self.state.step, epoch=self._epoch(), consumed=self._consumed(),
                       blocked_ms=round((time.perf_counter() - began) * 1000, 2),
                       **{"async": not blocking and self.checkpointer.async_save})
        return True

    def before_leave(self, stop_requested: bool) -> bool:
        """Every worker of the generation, at the boundary where some of them leave: a checkpoint
        of the step all of them trained (:func:`elasticctl.train.worker.boundary.checkpoint_before_leave`),
        agreed on by every rank. False without a checkpoint directory, or when the write failed on
        any rank: one attempt, not the final checkpoint's retries, since the state lives on in the
        workers that stay (a full disk must not end them); the leave goes on as without it."""
        if self.checkpointer is None:
            return False
        failure = self._agreed_attempt()
        if failure is not None:
            log.warning("[%s] the checkpoint of step %d before %s leave failed (%s); the workers that stay "
                        "keep the state", self.worker, self.state.step, "it and others" if stop_requested
                        else "others", failure)
            return False
        self._emit("final_checkpoint", step=self.state.step, signalled=stop_requested)
        return True

    def final(self) -> None:
        """The checkpoint of the state training ends with, retried, and agreed on by every rank: if
        it failed on any, every rank raises the same CheckpointError (naming why, e.g. the disk is
        full) and marks its worker unrecoverable, so that no node restarts workers only to re-train
        the steps since the last good checkpoint and fail on the same disk again."""
        if self.checkpointer is None:
            return
        self._report_background_failure()
        # Every rank takes part in each attempt (a writer that fails, the others that wait for
        # it): no rank waits in a collective through all the retries, longer than a timeout.
        attempt = 0
        while (failure := self._agreed_attempt()) is not None:
            attempt += 1
            delay = lifecycle.final_checkpoint_retry(attempt)
            if delay is None:
                message = (f"The final checkpoint failed {attempt} times, the training of step "
                           f"{self.state.step} is not saved: {failure}")
                worker_entry.note_unrecoverable(message)
                raise CheckpointError(message)
            log.warning("[%s] retrying the final checkpoint of step %d in %g s", self.worker,
                        self.state.step, delay)
            self._sleep(delay)

    def final_of_stop(self, stop_requested: bool) -> None:
        """The final checkpoint of a stop (SIGTERM), reported on every rank."""
        self.final()
        if self.checkpointer is not None:
            self._emit("final_checkpoint", step=self.state.step, signalled=stop_requested)

    def _agreed_attempt(self) -> str | None:
        """One save of this step (none if it is saved already), and its outcome agreed on every
        rank: the lowest failing rank's failure, or None."""
        saved = self.checkpointer.last_step == self.state.step or self.save(blocking=True)
        return agree_on_failure(None if saved else str(self.checkpointer.failure or "the write failed"),
                                self.device)

    def _report_background_failure(self) -> None:
        """Wait for a background write; a failure of it is reported like a blocking one's."""
        try:
            self.checkpointer.wait()
        except CheckpointError as exc:
            self._emit("checkpoint_failed", step=getattr(exc, "step", None), reason=str(exc))

    # -- restore -----------------------------------------------------------------------------

    def restore(self, recovers_in_process: bool, **event: Any) -> Any:
        """The newest checkpoint into the state (its Restored; None: there is none). In hot mode
        (``recovers_in_process``) the script also hears ``state_restored`` (source checkpoint,
        with ``event``'s fields)."""
        restored = self.checkpointer.restore(**self.state.objects()) if self.checkpointer else None
        if restored is not None:
            self.state.step = restored.step
            self.state.update_fields(restored.extra.get("fields", {}))
            log.info("[%s] resumed from %s at step %d", self.worker, restored.path, restored.step)
            self._emit("resume", step=restored.step, epoch=self._epoch(), consumed=self._consumed(),
                       from_world_size=restored.world_size, path=str(restored.path))
            if recovers_in_process:
                self._emit("state_restored", step=restored.step, source="checkpoint", path=str(restored.path),
                           **event)
        self.state.live = True
        return restored

    def close(self) -> None:
        if self.checkpointer is not None:
            try:
                self.checkpointer.close()
            except CheckpointError:
                pass  # a write that failed while the worker stopped otherwise: logged and recorded

    # -- what the records say of the sampler ---------------------------------------------------

    def _epoch(self) -> int:
        return int(getattr(self.state.sampler, "epoch", 0))

    def _consumed(self) -> int | None:
        consumed = getattr(self.state.sampler, "consumed", None)
        return None if consumed is None else int(consumed)


def agree_on_failure(failure: str | None, device: torch.device) -> str | None:
    """The failure of the lowest rank that had one, on every rank (None: no rank failed), over the
    training group (its tensors on ``device``).

    A fixed-size byte tensor rather than ``broadcast_object_list``: nothing a peer sends is
    unpickled."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return failure
    world = dist.get_world_size()
    first = torch.tensor([dist.get_rank() if failure is not None else world], dtype=torch.int64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    source = int(first.item())
    if source == world:
        return None
    text = torch.zeros(AGREED_FAILURE_BYTES, dtype=torch.uint8, device=device)
    if source == dist.get_rank():
        encoded = failure.encode()[:AGREED_FAILURE_BYTES]
        text[:len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    dist.broadcast(text, source)
    sent = bytes(text.cpu().tolist()).rstrip(b"\0").decode(errors="replace")
    return sent if source == dist.get_rank() else f"{sent.rstrip('.')} (on rank {source})."
