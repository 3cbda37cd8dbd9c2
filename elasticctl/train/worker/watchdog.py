"""The worker's two clocks beside the training thread, both reading its liveness snapshot: the
no-step watchdog (a warning each time no step boundary came for a while: a joiner is admitted and
a leaver let go only at one) and the stop bound (a worker told to stop that reaches no boundary
in time exits without one, well before torch's agent SIGKILLs it with a page of tracebacks)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

from elasticctl.train.phase import Phase
from elasticctl.train.worker.liveness import LivenessBoard

log = logging.getLogger(__name__)

# A worker told to stop (SIGTERM) leaves at its next step boundary; one that reaches none in
# this many seconds (a script that never calls state.commit) exits without one, well before
# torch's agent SIGKILLs its workers (30 s after its SIGTERM) with a page of tracebacks.
STOP_BOUND = 10.0
EXIT_STOPPED_WITHOUT_BOUNDARY = 143  # 128 + SIGTERM: what the signal's default action returns


def no_step_warning_after(node_ttl: float | None) -> float:
    """Seconds without a step boundary after which a worker warns: twice the longer of the node
    TTL and a minute. A joiner waits for a boundary to be admitted and a leaver to be let go;
    a step longer than this is rare, a script that never calls ``state.commit`` is not."""
    return 2 * max(node_ttl or 0.0, 60.0)


def stop_bound(longest_step: float) -> float:
    """Seconds a worker told to stop has to reach a step boundary: a script whose steps are long
    gets twice its longest step."""
    return max(STOP_BOUND, 2 * longest_step)


class Watchdog:
    """Worker ``worker``'s clocks over ``liveness``; ``step()``: the training state's step;
    ``warn(what)``: a no-step warning (logged and recorded)."""

    def __init__(self, worker: str, liveness: LivenessBoard, no_step_warning: float, *, step: Callable[[], int],
                 warn: Callable[[str], None]) -> None:
        self.worker = worker
        self.liveness = liveness
        self._step = step
        self.no_step_warning = no_step_warning
        self._warn = warn
        self._over = threading.Event()  # set: the run is over

    def start(self) -> None:
        threading.Thread(target=self._watch_steps, name="elasticctl-no-step", daemon=True).start()

    def stop(self) -> None:
        self._over.set()

    def start_stop_timer(self) -> None:
        """A stop was requested: the bound on reaching a boundary starts now."""
        now = self.liveness.now
        timer = threading.Timer(stop_bound(now.longest_step), self._exit_without_boundary,
                                args=(now.last_boundary,))
        timer.daemon = True
        timer.start()

    def _exit_without_boundary(self, boundary_at_signal: float) -> None:
        """Still running after the stop bound without a step boundary since: leave now."""
        now = self.liveness.now
        if self._over.is_set() or now.last_boundary != boundary_at_signal:
            return  # the run ended, or a boundary came (it acts on the stop, and may be saving)
        log.error("[%s] told to stop, it reached no step boundary (state.commit) within %g s: "
                  "exiting at step %d without a final checkpoint", self.worker,
                  stop_bound(now.longest_step), self._step())
        sys.stderr.flush()
        os._exit(EXIT_STOPPED_WITHOUT_BOUNDARY)

    def _watch_steps(self) -> None:
        """Warn each time no step boundary came for ``no_step_warning`` seconds."""
        warned_for = None
        while not self._over.wait(min(5.0, self.no_step_warning / 4)):
            now = self.liveness.now
            if now.phase is not Phase.TRAINING or now.last_boundary == warned_for:
                continue  # between generations waiting is normal; warn once per silence
            idle = time.monotonic() - now.last_boundary
            if idle >= self.no_step_warning:
                warned_for = now.last_boundary
                self._warn(f"no step boundary for {idle:.0f} s at step {self._step()}: a joiner "
                           "is admitted and a leaver let go only at one (does the training "
                           "function call state.commit() after each step?)")
