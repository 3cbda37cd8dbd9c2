"""Child processes that never outlive elasticctl: spawn with a parent-death signal, stop as a tree."""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
from collections.abc import Sequence

import psutil

_PR_SET_PDEATHSIG = 1
# Loaded up front: the pre-exec hook runs in a forked child and must do almost nothing.
_LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    # If elasticctl is SIGKILLed, the kernel sends the child SIGTERM.
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(command: Sequence[str], **popen_kwargs) -> subprocess.Popen:
    """Start ``command`` in its own process group, tied to this process's life."""
    preexec = _die_with_parent if _LIBC is not None else None
    return subprocess.Popen(list(command), preexec_fn=preexec, start_new_session=True, **popen_kwargs)


def terminate(process: subprocess.Popen, timeout: float = 10.0) -> int | None:
    """SIGTERM ``process`` and its descendants, SIGKILL whatever is left after ``timeout``."""
    try:
        parent = psutil.Process(process.pid)
        tree = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for proc in tree:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(tree, timeout=timeout)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
