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
* ``failure-<LOCAL_RANK>``, a small JSON record, when the script raised: the exception's type and
  message, the file and line of the script's own code it was raised at, whether it may be its
  peers' doing, and whether the worker had trained a step (:mod:`elasticctl.job.worker_failure`).
  Its node stops when the same failure comes twice before a first step (a restart would only
  repeat it: :func:`elasticctl.rendezvous.policy.repeated_failure`).

A torch ``DistributedSampler`` built before any process group exists (at module level) raises
torch's "Default process group has not been initialized" in every worker: the worker says the fix
in one sentence instead (:func:`elasticctl.train.porting.sampler_before_group`), and its node stops.

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
import site
import sys
import sysconfig
import traceback

from elasticctl.job.environment import WorkerEnvironment

_completed = False
_joined = False
_marks_dir: str | None = None  # None: not decoded yet ("": no marks, not under elasticctl)
_stop_requested = False
_steps_counted = False  # the elastic runtime counts this worker's steps (State.commit tells each one)
_stepped = False  # a step was committed in this process

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


def note_steps_counted() -> None:
    """The script trains through the elastic runtime (:class:`elasticctl.train.state.State` is
    bound to it): :func:`note_step` tells each step, so a failure before the first one is known."""
    global _steps_counted
    _steps_counted = True


def note_step() -> None:
    """A training step was committed (:meth:`elasticctl.train.state.State.commit`)."""
    global _stepped
    _stepped = True


def _trained() -> bool:
    # A script that counts its own steps says nothing of them: once it joined its peers it may
    # have trained, and its failures keep the node's usual restart policy.
    return _stepped or (not _steps_counted and _has_joined())


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


def _library_dirs() -> list[str]:
    """Where code that is not the script's own lives: Python's library, installed packages,
    elasticctl itself."""
    paths = sysconfig.get_paths()
    dirs = [paths.get(name, "") for name in ("stdlib", "platstdlib", "purelib", "platlib")]
    try:
        dirs += [*site.getsitepackages(), site.getusersitepackages()]
    except AttributeError:  # a virtualenv's old site module has neither
        pass
    dirs.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return [os.path.abspath(d) for d in dirs if d]


def _note_failure(error: BaseException) -> None:
    """Leave the ``failure`` mark of ``error`` for the node (never raises: the script's own
    exception is what the worker ends with)."""
    try:
        from elasticctl.errors import ConfigError
        from elasticctl.job import worker_failure

        frames = [(f.filename if f.filename.startswith("<") else os.path.abspath(f.filename), f.lineno or 0)
                  for f in traceback.extract_tb(error.__traceback__)]
        # Loaded by then if the script used torch.distributed; if not, its error is none of it.
        distributed = sys.modules.get("torch.distributed")
        dist_error = getattr(distributed, "DistError", None)
        involved = worker_failure.peers_involved(
            frames[-1][0] if frames else "",
            distributed_error=dist_error is not None and isinstance(error, dist_error),
            config_error=isinstance(error, ConfigError),
            distributed_dir=os.path.dirname(distributed.__file__) if getattr(distributed, "__file__", None) else "",
            package_dir=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        # A SyntaxError's frames are its compiler's caller's: its own file and line are the place.
        syntax_at = ((os.path.abspath(error.filename), error.lineno or 0)
                     if isinstance(error, SyntaxError) and error.filename else None)
        record = worker_failure.describe(type(error).__name__, str(error), frames, library=_library_dirs(),
                                         peers_involved=involved, trained=_trained(), syntax_at=syntax_at)
        if record is not None:
            _mark("failure", record.to_json())
    except Exception as exc:  # noqa: BLE001 - without the mark the node keeps its usual policy
        print(f"elasticctl: warning: cannot record the script's failure for its node: {exc}", file=sys.stderr)


def _refuse_sampler_before_group(error: BaseException) -> None:
    """torch's DistributedSampler built before any process group: the fix in one sentence, the
    worker marked unrecoverable (every restart builds it again), and exit 1 without torch's
    traceback."""
    from elasticctl.train import porting

    frames = [(f.filename, f.name) for f in traceback.extract_tb(error.__traceback__)]
    reason = porting.sampler_before_group(error, frames)
    if reason is None:
        return
    note_unrecoverable(reason)
    print(f"elasticctl: error: {reason[0].upper()}{reason[1:]}", file=sys.stderr, flush=True)
    raise SystemExit(1) from None


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
    except Exception as exc:
        _note_failure(exc)
        _refuse_sampler_before_group(exc)
        raise
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
