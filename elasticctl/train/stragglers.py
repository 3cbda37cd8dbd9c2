"""Stragglers: which node sets everyone's pace, measured at step boundaries, named, and evicted.

**What is measured.** A worker's *own* time for a step: from the end of its previous step
boundary (``State.commit``) to the moment its gradients go out to the all-reduce. In
synchronous data parallel the time from boundary to boundary is the same on every worker
(each waits in the all-reduce for the slowest), so it cannot tell who is slow; the time up
to the collective can. The runtime's default wrapping (DDP) gets that moment from a DDP
communication hook, which DDP calls on each bucket of gradients as soon as this worker has
computed it, before any wait for a peer (:func:`timed_allreduce_hook`, registered with
``DistributedDataParallel.register_comm_hook``; the all-reduce itself is torch's own
``allreduce_hook``). The last such call of a step ends its own time. A step in which no hook
ran (a world of one, a script's own ``wrap`` that is not DDP) is timed to ``State.commit``
instead: honest for a script that averages its gradients inside ``commit``'s optimizer
step, and no worse than boundary to boundary otherwise (every worker then looks alike and
no one is named: never a false straggler).

**How it travels.** Every ``interval`` steps (the same step on every worker of a generation)
each worker gives its fastest own step of the interval to one small ``all_gather`` of one
float per rank (the node names once per generation, as fixed-size bytes: nothing a peer
sends is unpickled). A node's time is its slowest worker's (that worker sets its pace).

**The rule** (:func:`find_stragglers`, pure, table-tested). For each node, its fastest step
of the interval over the median of the other nodes' fastest steps. The *fastest* step, so
that a node is slow in an interval only if every one of its steps there was slow: a node
named after ``window`` steps was slow at each of them, and a node slow for fewer steps is
never named, whatever the interval boundaries (a single slow step, a one-off wait in a
collective the script runs before ``commit``, a scheduling hiccup, is no evidence). The
median of the *others*, so that the rule works from two nodes on. A ratio of two tiny
times is noise: a node must also be at least :data:`MIN_EXCESS` seconds slower.

**What follows.** Rank 0 records a ``straggler`` event (node, ratio, steps) when a node is
first named and ``straggler_cleared`` when it is no longer; the dashboard marks the node and
``/metrics`` exports its ratio. With ``--evict-stragglers R`` the slowest node that stays
above ``R`` times the others for the window is asked to leave through the same request as
``elasticctl leave`` (one at a time, never below ``--nnodes`` MIN): in hot mode the others
go on at the next boundary without it, in their own processes; in restart mode they
restart from a final checkpoint without it.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Mapping, Sequence

from elasticctl.job.spec import validate_name

MIN_EXCESS = 0.002  # seconds a straggler's step is at least slower than the others' median
NAME_BYTES = 64     # a node id is at most 63 bytes (job.spec.validate_name)


@dataclasses.dataclass(frozen=True)
class Interval:
    """One exchange: each node's fastest own step time (seconds) over the last ``steps`` steps."""

    steps: int
    seconds: Mapping[str, float]


@dataclasses.dataclass(frozen=True)
class Straggler:
    node: str
    ratio: float  # its time over the others' median, in the newest interval
    steps: int    # steps in a row it has been slower than the threshold (at least the window)


def _median_of_others(interval: Interval, node: str) -> float | None:
    others = [t for other, t in interval.seconds.items() if other != node]
    return statistics.median(others) if others else None


def slowness(interval: Interval, node: str) -> float | None:
    """``node``'s time over the median of the other nodes' (None: no others, or no time)."""
    median, mine = _median_of_others(interval, node), interval.seconds.get(node)
    if median is None or mine is None:
        return None
    return mine / median if median > 0 else (float("inf") if mine > 0 else 1.0)


def _slow(interval: Interval, node: str, ratio: float) -> bool:
    median, mine = _median_of_others(interval, node), interval.seconds.get(node)
    if median is None or mine is None:
        return False
    return mine > ratio * median and mine - median >= MIN_EXCESS


def find_stragglers(intervals: Sequence[Interval], ratio: float, window: int) -> list[Straggler]:
    """The nodes whose time stayed above ``ratio`` x the others' median (and :data:`MIN_EXCESS`
    above it) in every interval of the newest ``window`` steps or more, slowest first.
    ``intervals``: oldest first, all of one generation."""
    if not intervals:
        return []
    named = []
    for node in sorted(intervals[-1].seconds):
        steps = 0
        for interval in reversed(intervals):
            if not _slow(interval, node, ratio):
                break
            steps += interval.steps
        if steps >= window:
            named.append(Straggler(node, round(min(slowness(intervals[-1], node), 1e6), 3), steps))
    return sorted(named, key=lambda s: (-s.ratio, s.node))


def to_evict(stragglers: Sequence[Straggler], world_nodes: int, min_nodes: int) -> Straggler | None:
    """Which of ``stragglers`` (slowest first, each above the eviction ratio) leaves now: the
    slowest, if the others are still at least ``min_nodes``; one at a time, so that the
    next exchange measures the job without it before another goes."""
    if not stragglers or world_nodes - 1 < min_nodes:
        return None
    return stragglers[0]


def node_times(names: Sequence[str], seconds: Sequence[float]) -> dict[str, float]:
    """Each node's time from its workers' (rank order): its slowest worker's."""
    times: dict[str, float] = {}
    for name, value in zip(names, seconds):
        times[name] = max(times.get(name, 0.0), value)
    return times


def encode_name(name: str) -> list[int]:
    raw = name.encode()[:NAME_BYTES]
    return list(raw) + [0] * (NAME_BYTES - len(raw))


def decode_name(raw: Sequence[int]) -> str:
    """A peer's node id from its bytes (untrusted): a ConfigError if it is not one."""
    text = bytes(b for b in raw if b).decode(errors="replace")
    return validate_name(text, "node id a peer sent")


class StepClock:
    """This worker's own step times (see the module docstring): started at each boundary,
    ended by the gradients' hook or, without one, at ``commit``. Fed from the training thread
    and DDP's autograd thread: each writes one float, replaced whole."""

    def __init__(self) -> None:
        self._started = time.monotonic()
        self._computed: float | None = None  # the last gradient bucket of this step went out
        self.fastest: float | None = None     # of the current interval
        self.steps = 0                        # in the current interval

    def restart(self) -> None:
        """A new generation (or the wait for one): nothing measured so far counts."""
        self._started, self._computed, self.fastest, self.steps = time.monotonic(), None, None, 0

    def gradients_ready(self) -> None:
        self._computed = time.monotonic()

    def step_done(self) -> None:
        """At ``commit``: the step's own time joins the interval."""
        now = time.monotonic()
        own = (self._computed if self._computed is not None and self._computed >= self._started else now) \
            - self._started
        self.fastest = own if self.fastest is None else min(self.fastest, own)
        self.steps += 1
        self._computed = None

    def next_step(self) -> None:
        """The boundary's own work is done: the next step's time starts."""
        self._started = time.monotonic()

    def take(self) -> tuple[float, int]:
        """The interval's fastest step and its step count; a new interval starts."""
        fastest, steps = self.fastest or 0.0, self.steps
        self.fastest, self.steps = None, 0
        return fastest, steps


def timed_allreduce_hook(clock: StepClock):
    """A DDP communication hook: note that this worker's gradients are ready, then torch's
    ``allreduce_hook`` (the average DDP computes without a hook)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(process_group, bucket):  # unannotated: DDP refuses any annotation but its own types
        clock.gradients_ready()
        return allreduce_hook(process_group, bucket)

    return hook


def valid_seconds(value: float) -> bool:
    """A step time a peer sent that can be one (finite, not negative, under a day)."""
    return value == value and 0.0 <= value < 86400.0

