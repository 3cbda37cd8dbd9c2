"""How every worker runs its script, so the agent can tell "finished" from "failed".

torch's agent sees only exit statuses, and judges a worker group all-or-nothing: a
worker that died at interpreter exit (a C++ destructor in gloo, NCCL or CUDA
aborting after the script returned) makes the group FAILED, and the group would be
started again from scratch although the training had finished. This entry runs the
script in this process (like ``python SCRIPT``) and records, in the directory the
rendezvous handler names in the worker environment (:mod:`elasticctl.job.environment`):

* ``started-<LOCAL_RANK>`` before the script runs;
* ``unrecoverable-<LOCAL_RANK>``, holding one line, when the worker ends on a failure a
  restart would only repeat (:func:`note_unrecoverable`), such as a script that refused its own
  arguments (:func:`refused_its_arguments`): its node stops instead;
* ``done-<LOCAL_RANK>`` once the script ended with status 0, on its own (not stopped by
  SIGTERM, see :func:`note_stop_request`), and every ``atexit`` callback ran: the last
  thing Python does before its teardown.

    python -m elasticctl.train.entry [--module] [--local-rank-flag] SCRIPT [ARGS...]

``--local-rank-flag`` hands the script ``--local_rank=N`` as torch.distributed.launch did.

Before the script runs, :func:`elasticctl.train.porting.install` sets up the checks for habits of
other launchers that cannot work here (``torch.multiprocessing.spawn``: the worker ends with the fix;
``nn.DataParallel``: a warning). In a launched worker that imports torch first, as the script would.
"""

from __future__ import annotations

import atexit
import gc
import os
import runpy
import sys

from elasticctl.job.environment import WorkerEnvironment

_completed = False
_joined = False
_marks_dir: str | None = None  # None: not decoded yet ("": no marks, not under elasticctl)
_stop_requested = False

USAGE_ERROR_STATUS = 2  # argparse's parser.error, click's UsageError, script.run_main's user mistake


def refused_its_arguments(exit_code: object, joined: bool) -> bool:
    """Whether a script that ended with ``SystemExit(exit_code)`` failed on its own command line,
    so that every restart, run with the same arguments, would fail the same way.

    The rule: the status of a usage error (2), raised before the worker ``joined`` a process
    group with its peers. Until then the script has read nothing but its arguments, its files
    and its environment, which a restart hands it unchanged; nothing a restart changes (a
    peer, the network, the world size) has played a part. Once joined, a 2 may come from
    anything the training did, and the agent judges it as it judges any failure.
    """
    is_status = isinstance(exit_code, int) and not isinstance(exit_code, bool)
    return is_status and exit_code == USAGE_ERROR_STATUS and not joined


def note_stop_request() -> None:
    """The script was asked to stop (SIGTERM): exiting 0 then is a clean stop, not a finish.

    Called by :class:`elasticctl.train.script.GracefulStop`; a script that handles SIGTERM on
    its own should call it too, or a restart of its group could be taken for the end.
    """
    global _stop_requested
    _stop_requested = True


def note_unrecoverable(reason: str) -> None:
    """The worker is about to fail in a way a restart would only repeat (its final checkpoint
    cannot be written): its node stops, saying ``reason``, instead of restarting it."""
    _mark("unrecoverable", " ".join(reason.split()))


def note_joined() -> None:
    """The worker has formed a process group with its peers (:func:`elasticctl.train.script.init`,
    each generation of hot recovery): its exits are no longer taken for a refusal of its
    arguments (:func:`refused_its_arguments`)."""
    global _joined
    _joined = True


def _has_joined() -> bool:
    # A script may form its group itself (dist.init_process_group), unnoticed by note_joined:
    # torch is loaded then, and its group still stands unless the script destroyed it.
    distributed = sys.modules.get("torch.distributed")
    return _joined or bool(distributed is not None and distributed.is_available()
                           and distributed.is_initialized())


def _mark(kind: str, text: str = "") -> None:
    global _marks_dir
    if _marks_dir is None:  # once per worker: the handler names a new directory per start
        _marks_dir = WorkerEnvironment.from_env().marks_dir
    directory = _marks_dir
    if directory:
        with open(os.path.join(directory, f"{kind}-{os.environ.get('LOCAL_RANK', '0')}"), "w") as mark:
            mark.write(text)


def _mark_done() -> None:
    # Registered before the script runs, so it runs after the script's own atexit callbacks.
    if _completed and not _stop_requested:
        _mark("done")


def main(argv: list[str]) -> None:
    global _completed
    module = local_rank_flag = False
    while argv and argv[0] in ("--module", "--local-rank-flag"):
        module |= argv[0] == "--module"
        local_rank_flag |= argv[0] == "--local-rank-flag"
        argv = argv[1:]
    if not argv:
        sys.exit("usage: python -m elasticctl.train.entry [--module] [--local-rank-flag] "
                 "SCRIPT [ARGS...]")
    script, *args = argv
    if local_rank_flag:
        args = [f"--local_rank={os.environ.get('LOCAL_RANK', '0')}", *args]
    _mark("started")
    # Before the script imports anything: scripts written for another launcher (mp.spawn,
    # nn.DataParallel) are stopped or warned about in one sentence (elasticctl/train/porting.py).
    from elasticctl.train import porting

    porting.install(mark_unrecoverable=note_unrecoverable)
    # Runs last (atexit is LIFO): with every object frozen, the interpreter's teardown skips
    # collecting torch's module graph, which took 0.7 of 1.0 s here. A worker stopped for a
    # new round exits that much sooner; the callbacks registered later still run first.
    atexit.register(gc.freeze)
    atexit.register(_mark_done)
    sys.argv = [script, *args]
    try:
        if module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
            runpy.run_path(script, run_name="__main__")
        _completed = True
    except SystemExit as exc:
        _completed = exc.code is None or exc.code == 0
        if refused_its_arguments(exc.code, _has_joined()):
            # The script printed its usage and error already: the node stops with this line
            # instead of restarting the workers to print them again, through a quarantine.
            note_unrecoverable(f"its script {script} refused its arguments (exit status "
                               f"{USAGE_ERROR_STATUS} before it joined the job), which every "
                               "restart would repeat.")
        raise


if __name__ == "__main__":
    # `python -m elasticctl.train.entry` runs this file as `__main__`, a second module object
    # beside the `elasticctl.train.entry` the runtime and GracefulStop import: a stop request
    # noted there would never reach the `_mark_done` registered here, and a worker stopped by
    # SIGTERM would be marked finished. So run the imported module's main, with its globals.
    from elasticctl.train import entry

    entry.main(sys.argv[1:])
