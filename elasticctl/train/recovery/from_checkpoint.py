"""The checkpoint as a recovery source: the last one asked, and the one that always has a plan.

Where nobody holds state (the job's start, every worker lost), or no step of the live replicas
has every shard and no peer copies make one state, every member restores the newest checkpoint,
resharded to this generation for a sharded state, in process, through the runtime's restore
(it owns the checkpointer).
"""

from __future__ import annotations

import dataclasses
import logging

from elasticctl.train.recovery.from_replicas import unheld_shards
from elasticctl.train.recovery.source import Reports, Restoring
from elasticctl.train.state import StateError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FromCheckpoint:
    """Every member restores the newest checkpoint; ``missing``: the shard indexes no live replica held
    at the newest step (why the replicas had no plan; empty: nobody holds state, or a replicated state)."""

    missing: tuple[int, ...] = ()


class Checkpoint:
    """The newest checkpoint (the runtime's restore)."""

    name = "checkpoint"
    report_width = 0  # every member reads the same files

    def report(self) -> list[int]:
        return []

    def plan(self, reports: Reports) -> FromCheckpoint:
        return FromCheckpoint(missing=unheld_shards(reports))

    def restore(self, plan: FromCheckpoint, reports: Reports, restoring: Restoring) -> tuple[int, ...]:
        if restoring.sharded is None:
            restoring.restore_from_checkpoint()
            return ()
        self._restore_shards(plan.missing, max(reports.trained, default=-1), restoring)
        return ()

    @staticmethod
    def _restore_shards(missing: tuple[int, ...], trained: int, restoring: Restoring) -> None:
        """No replica holds some shard, or no shard fits this generation's mesh (FSDP without
        replicas, resized), or nobody holds state (the job's start): the newest sharded checkpoint,
        resharded to this generation. ``trained``: the newest step any member trained to (-1: none);
        with no checkpoint, state trained that far is lost: StateError."""
        if trained >= 0:
            log.warning("[%s] %s at step %d: restoring the newest checkpoint", restoring.worker,
                        f"shard(s) {', '.join(map(str, missing))} have no replica" if missing
                        else "no member's shards fit the new mesh", trained)
        restored = restoring.restore_from_checkpoint(shard=restoring.sharded.position.index, missing=list(missing))
        if restored is None and trained >= 0:
            raise StateError(f"The model's shards trained to step {trained} have no replica in this generation "
                             "and there is no checkpoint to restore them from: the training state is lost.")
