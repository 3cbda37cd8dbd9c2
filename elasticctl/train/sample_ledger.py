"""The sample ledger: an audit of the exactly-once claim on a job of one's own.

Where ``ELASTICCTL_SAMPLE_LEDGER=FILE`` is set, each worker appends to ``FILE`` (JSON lines;
opened for appending and line-buffered, so that the workers' lines do not interleave) a
``start`` line each time training starts or re-enters with the
step it resumed at, and per step the indices of samples: a framework ``Trainer``'s rank names
its own share, an ``elasticctl.train.run`` rank the whole step's (a rank killed right after a
step's all-reduce writes no line, yet its samples were trained). Reading it back, a step's
samples are the union of its lines, counted from the start that trained them up to the step
the next start resumed at; every sample of an epoch should then appear once. ``elasticctl.train.run`` scripts and the
framework integrations write it alike (tests/process/test_frameworks.py reads it).
"""

from __future__ import annotations

import json
import os
import time
from typing import IO, Any

import torch.distributed as dist

from elasticctl.job import environment


class SampleLedger:
    """One worker's appender to the ledger file."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] | None = open(path, "a", buffering=1)  # noqa: SIM115 - closed by close()

    @classmethod
    def from_environment(cls) -> SampleLedger | None:
        path = environment.sample_ledger()
        return cls(path) if path else None

    def started(self, step: int, sampler: Any) -> None:
        """Training starts (or re-enters, in hot mode) at ``step``, the sampler where it is."""
        self.write({"event": "start", "step": step, "epoch": getattr(sampler, "epoch", None),
                    "consumed": getattr(sampler, "consumed", None)})

    def stepped(self, step: int, epoch: int, indices: list[int], loss: float | None = None) -> None:
        """Step ``step`` trained ``indices`` on this worker."""
        record: dict[str, Any] = {"step": step, "epoch": epoch, "indices": indices}
        if loss is not None:
            record["loss"] = loss
        self.write(record)

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        self._file.write(json.dumps({**record, "rank": rank, "world_size": world, "pid": os.getpid(),
                                     "time": time.time()}) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
