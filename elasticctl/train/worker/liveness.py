"""What the worker's other threads read of it: one snapshot, replaced whole by the training
thread (the only writer), so that a reader (the SIGTERM handler, the no-step watchdog, the stop
timer, the lost-member abort) sees one consistent value without a lock."""

from __future__ import annotations

import dataclasses
import time

from elasticctl.train.phase import Phase


@dataclasses.dataclass(frozen=True)
class Liveness:
    phase: Phase = Phase.FORMING
    last_boundary: float = dataclasses.field(default_factory=time.monotonic)  # the last step boundary, or start
    longest_step: float = 0.0  # seconds between two boundaries, the longest seen


class LivenessBoard:
    """The snapshot (:attr:`now`) and its one writer's updates."""

    def __init__(self) -> None:
        self.now = Liveness()

    def phase(self, phase: Phase) -> None:
        if phase is not self.now.phase:
            self.now = dataclasses.replace(self.now, phase=phase)

    def boundary(self, at: float | None = None) -> None:
        """A step boundary (or the start of a generation's steps) at ``at`` (monotonic): within a
        generation the time since the last one is a step, the longest of which is kept."""
        at = time.monotonic() if at is None else at
        now = self.now
        longest = max(now.longest_step, at - now.last_boundary) if now.phase is Phase.TRAINING else now.longest_step
        self.now = Liveness(now.phase, at, longest)

    def restart_clock(self) -> None:
        """A generation's steps (and silences) count from here."""
        self.now = dataclasses.replace(self.now, last_boundary=time.monotonic())
