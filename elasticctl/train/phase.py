"""Where a worker is in its run: the runtime's phases (:mod:`elasticctl.train.runtime` moves
between them; the SIGTERM handler, the no-step watchdog and the loss watcher read them)."""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    """Where the worker is; changed on the training thread only (the SIGTERM handler and the
    no-step watchdog read it)."""

    FORMING = "forming"        # waiting for its first generation, or setting it up
    TRAINING = "training"      # in a generation: the script's steps are boundaries
    RE_FORMING = "re-forming"  # between generations: the group is down, the next one forms
    LEAVING = "leaving"        # let go at a boundary: a final checkpoint if it is the last, then out
    FINISHED = "finished"      # the training function returned, or the run ended
