"""Checkpoints on a full disk, on a small tmpfs each test mounts.

A failed periodic checkpoint costs training nothing: no crash, no restart, no re-formation.
It is logged, recorded (``checkpoint_failed``), published in the progress record (status,
doctor, the dashboard's /metrics), and checkpoints resume once space returns. Only a final
checkpoint that fails after its retries ends the run non-zero, naming the disk.

The disk fills after a known event: the test writes a filler file once the job's first
checkpoint is on disk, leaving less room than one checkpoint needs (its size is measured).

Layer tests/unit: no etcd, no processes. The other tests of this subject:
tests/process/test_full_disk.py.
"""

from __future__ import annotations

import errno

import pytest

from elasticctl.train.checkpoint import write_failure_reason


# -- the checkpointer ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), "the disk is full (No space left on device)"),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), "the disk quota is exhausted (Disk quota exceeded)"),
        (OSError(errno.EROFS, "Read-only file system"), "the file system is read-only (Read-only file system)"),
        (OSError(errno.EACCES, "Permission denied"), "Permission denied"),
        (RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0"),
         "RuntimeError: [enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0"),
    ],
    ids=["enospc", "edquot", "erofs", "eacces", "torch-runtime-error"],
)
def test_write_failure_reason(exc, reason):
    assert write_failure_reason(exc) == reason
