"""What every worker checks in a script written for another launcher (trainers/porting/).

Two habits of the tutorials people learned from do not work when elasticctl already starts one
process per worker, and neither fails on its own:

* ``torch.multiprocessing.spawn`` (or ``start_processes``) with ``init_method="tcp://IP:PORT"``
  starts more workers beside the ones torchrun started: on one node they train a job of their
  own, on several they wait on each other's address until a timeout. Such a worker ends at once
  instead, with the fix in one sentence (:func:`refuse_spawn`), and its node stops rather than
  restarting workers that would do the same.
* ``nn.DataParallel`` splits each batch over this process's GPUs only: every worker trains a model
  of its own and nothing tells. The first forward names it, with the line that replaces it
  (:func:`warn_on_data_parallel`), on stderr and in the job's history.

And one habit that fails, but in torch's words: torch's ``DistributedSampler(dataset)`` asks the
default process group for the world size when it is built, so one built at module level (before
``init_process_group``, or before ``elasticctl.train.run`` forms the first generation) raises
"Default process group has not been initialized" in every worker. The entry turns that into the
fix in one sentence (:func:`sampler_before_group`).

:func:`install` sets both up; :mod:`elasticctl.train.entry` calls it before the script runs. The
decisions are pure functions (:func:`spawn_refusal`, :func:`data_parallel_warning`), the rest
only wires them to torch.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence

SPAWN_FUNCTIONS = ("spawn", "start_processes")  # torch.multiprocessing's public ways to start workers
DDP_LINE = ("model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank]) "
            "after torch.distributed.init_process_group() (no device_ids on the CPU)")


def launched(environ: Mapping[str, str]) -> bool:
    """Whether this process is one worker of a world a launcher started: torchrun (which
    elasticctl runs) hands every worker its RANK and WORLD_SIZE."""
    return "RANK" in environ and "WORLD_SIZE" in environ


def spawn_refusal(function: str, environ: Mapping[str, str]) -> str | None:
    """Why a worker must not call ``torch.multiprocessing.<function>``, or None where it may.

    A launched worker (:func:`launched`) already is one of the processes the job needs: the
    processes it would start claim ranks of their own, and their ``tcp://`` rendezvous either
    trains a second job or waits forever for peers that never come. Outside a launched world
    (the entry run by hand) the call does what it always did.
    """
    if not launched(environ):
        return None
    return (f"this script calls torch.multiprocessing.{function}, but elasticctl already starts one "
            "process per worker: call the worker function once, with the rank and world size "
            "from the environment (RANK, WORLD_SIZE, LOCAL_RANK), and init_method=\"env://\" "
            "(or none) in torch.distributed.init_process_group.")


def data_parallel_warning(module: object, environ: Mapping[str, str]) -> str | None:
    """The warning for a launched worker whose first forward is ``nn.DataParallel``, else None.

    DataParallel copies the model to this process's GPUs for each batch and back; it never talks
    to another worker, so each node trains its own model and the job's world size buys nothing.
    DistributedDataParallel (not a DataParallel subclass) is the replacement.
    """
    from torch import nn

    if not launched(environ) or not isinstance(module, nn.DataParallel):
        return None
    return ("nn.DataParallel only splits each batch over this process's GPUs, so every worker "
            f"trains a model of its own; replace it with {DDP_LINE}.")


# Where torch's DistributedSampler asks for the world: its constructor, in this file of torch.
SAMPLER_FILE = os.path.join("torch", "utils", "data", "distributed.py")
NO_GROUP = "process group has not been initialized"  # torch's message for a missing default group


def sampler_before_group(error: BaseException, frames: Sequence[tuple[str, str]]) -> str | None:
    """The fix for ``error``, raised through ``frames`` (file, function; outermost first), when it
    is torch's ``DistributedSampler(dataset)`` built before any process group exists; else None.

    torch fills in the world size and rank it was not given from the default process group, and
    raises when there is none yet (a sampler built at module level, or before ``run``). The
    elastic runtime's sampler takes them from each generation instead.
    """
    if not isinstance(error, (ValueError, RuntimeError)) or NO_GROUP not in str(error):
        return None
    if not any(file.endswith(SAMPLER_FILE) and function == "__init__" for file, function in frames):
        return None
    return ("this script builds torch's DistributedSampler before any process group exists (at module "
            "level, or before elastic.run): use elastic.ResumableSampler(dataset) (elasticctl.train), "
            "which takes its world size and rank from each generation of workers, or build the "
            "sampler after torch.distributed.init_process_group().")


def _no_mark(reason: str) -> None:
    """Outside the worker entry nothing marks a worker unrecoverable."""


def refuse_spawn(environ: Mapping[str, str] = os.environ, mark_unrecoverable=_no_mark) -> None:
    """Make torch.multiprocessing's ``spawn`` and ``start_processes`` end this worker at once.

    Why a wrapper: torch has no hook for these calls, and a guard further down (a rendezvous
    that notices too many ranks) would only speak after its timeout. Only the public names are
    replaced, before the script runs, so ``import torch.multiprocessing as mp; mp.spawn(...)``
    and ``from torch.multiprocessing import spawn`` both find the guard (torch's ``spawn`` calls
    the ``start_processes`` of its own module, not the public name: each name has its guard).
    The worker says the sentence, marks itself unrecoverable (``mark_unrecoverable``, the entry's:
    a restart would call it again) and exits 1.
    """
    import torch.multiprocessing as mp

    def guard(name, original):
        @functools.wraps(original)
        def guarded(*args, **kwargs):
            reason = spawn_refusal(name, environ)
            if reason is None:
                return original(*args, **kwargs)
            mark_unrecoverable(reason)
            print(f"elasticctl: error: {reason[0].upper()}{reason[1:]}", file=sys.stderr, flush=True)
            raise SystemExit(1)
        return guarded

    for name in SPAWN_FUNCTIONS:
        setattr(mp, name, guard(name, getattr(mp, name)))


def warn_on_data_parallel(environ: Mapping[str, str] = os.environ, record=None) -> None:
    """Warn, once, when the first module this worker runs forward is ``nn.DataParallel``.

    Why torch's global forward pre-hook (``register_module_forward_pre_hook``, public API): it
    sees the model as the script calls it, however the script built it, and removing it after
    the first forward leaves every later forward on torch's fast path (a global hook disables
    it). The outermost module runs forward first, so a DataParallel model is what it sees.
    ``record(text)``: also writes the warning to the job's history (:func:`_record_in_history`).
    """
    from torch.nn.modules.module import register_module_forward_pre_hook

    def first_forward(module, _inputs) -> None:
        handle.remove()
        text = data_parallel_warning(module, environ)
        if text is not None:
            print(f"elasticctl: warning: {text}", file=sys.stderr, flush=True)
            if record is not None:
                record(text)

    handle = register_module_forward_pre_hook(first_forward)


def _record_in_history(text: str) -> None:
    """A ``script_warning`` event in the job's history, from local rank 0 only (one per node: its
    workers run the same script); never raises, as every history write."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    from elasticctl.etcd.client import EtcdClient
    from elasticctl.job.environment import WorkerEnvironment
    from elasticctl.job.events import EventLog
    from elasticctl.job.records import EventKind

    try:
        environment = WorkerEnvironment.from_env()
        settings = environment.etcd_settings(retry_timeout=5.0)
        if settings is None:  # not under elasticctl: stderr is all there is
            return
        with EtcdClient(settings) as client:
            EventLog(client, environment.job_keys()).record(EventKind.SCRIPT_WARNING, environment.node,
                                                            reason=text)
    except Exception as exc:  # noqa: BLE001 - a warning must never stop the training it warns about
        print(f"elasticctl: warning: cannot record the warning in the job's history: {exc}", file=sys.stderr)


class _AfterTorchLoads(importlib.abc.MetaPathFinder):
    """Runs ``then()`` once the script's own ``import torch`` has finished, and leaves
    ``sys.meta_path`` as it found it. Why not import torch here: a script may set what torch reads
    at import (``CUDA_VISIBLE_DEVICES``, ``OMP_NUM_THREADS``) in ``os.environ`` before it imports
    torch, and must keep that power under elasticctl."""

    def __init__(self, then) -> None:
        self.then = then

    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # one shot; the real finders find torch
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        load = spec.loader.exec_module

        def load_then(module) -> None:
            load(module)
            self.then()

        spec.loader.exec_module = load_then
        return spec


def install(environ: Mapping[str, str] = os.environ, mark_unrecoverable=_no_mark) -> None:
    """Set up both checks in this worker, once the script imports torch (never before: see
    :class:`_AfterTorchLoads`). Outside a launched world (:func:`launched`) they would let
    everything through, so nothing is installed."""
    if not launched(environ):
        return

    def both() -> None:
        refuse_spawn(environ, mark_unrecoverable)
        warn_on_data_parallel(environ, record=_record_in_history)

    if "torch" in sys.modules:
        both()
    else:
        sys.meta_path.insert(0, _AfterTorchLoads(both))
