"""Child processes that never outlive elasticctl: spawn with a parent-death signal, stop as a tree."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

import psutil

# The parent-death signal is set by a tiny exec shim rather than a pre-exec hook: a
# hook forces a plain fork() of this process, whose grpc threads (the etcd client)
# then abort the child. Without a hook, Python vforks, and no fork handler runs.
_PDEATHSIG_SHIM = """
import ctypes, os, signal, sys
ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit(143)  # the parent died before the signal was armed
os.execvp(sys.argv[2], sys.argv[2:])
"""


def spawn(command: Sequence[str], **popen_kwargs) -> subprocess.Popen:
    """Start ``command`` in its own session; if this process dies, the kernel sends it SIGTERM."""
    argv = list(command)
    if sys.platform.startswith("linux"):
        argv = [sys.executable, "-c", _PDEATHSIG_SHIM, str(os.getpid()), *argv]
    return subprocess.Popen(argv, start_new_session=True, **popen_kwargs)


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
