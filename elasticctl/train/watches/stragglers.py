"""Stragglers: which node sets everyone's pace, measured at step boundaries, named, and evicted.

**What is measured.** A worker's *own* time for a step: from the end of its previous step
boundary (``State.commit``) to the moment its gradients go out to the all-reduce. In
synchronous data parallel the time from boundary to boundary is the same on every worker
(each waits in the all-reduce for the slowest), so it cannot tell who is slow; the time up
to the collective can. The runtime's default wrapping (DDP) gets that moment from a DDP
communication hook, which DDP calls on each bucket of gradients as soon as this worker has
computed it, before any wait for a peer (the runtime's one hook,
:mod:`elasticctl.train.watches.ddp_hooks`, calls :meth:`StepClock.gradients_ready`; the all-reduce itself is
torch's own ``allreduce_hook``). The last such call of a step ends its own time. A step in which no hook
ran (a world of one, a script's own ``wrap`` that is not DDP) is timed to ``State.commit``
instead: honest for a script that averages its gradients inside ``commit``'s optimizer
step, and no worse than boundary to boundary otherwise (every worker then looks alike and
no one is named: never a false straggler).

**How it travels.** Every ``interval`` K steps (the same step on every worker of a generation)
each worker gives two numbers about its own steps of the interval, its median (the lower one:
a step it really took) and its fastest, with their count, to one small ``all_gather`` of three
floats per rank (the node names once per generation, as fixed-size bytes: nothing a peer sends
is unpickled). A node's numbers are its slowest worker's (that worker sets its pace).

**The rule** (:func:`find_stragglers`, pure, table-tested). A step of a node is *slow* when it
took more than ``ratio`` R times the median of the other nodes' median steps of that interval,
and at least :data:`MIN_EXCESS` seconds more (a ratio of two tiny times is noise). Of a node's
steps in an interval the rule knows a lower bound: all of them were slow if its fastest was,
more than half (K // 2 + 1) if its median was, else none is counted. A node is named when both

* it is slow *on average now*: slow at more than half of its steps over the newest W steps
  (``window``: the newest intervals within W steps), its median step there above R times
  the others'. So a fast step now and then (a normal step between slow ones, one measured
  while the machine was idle) does not clear a node that is slow at most of its steps,
  whichever interval it falls in, and a node slow at half of its steps or fewer (a burst now
  and then, normal on average) is never named; and
* it has been slow *for long enough*: at W or more of its steps within the newest 2W. A node
  slow for fewer than W steps (a single slowdown shorter than the window, a one-off wait in a
  collective the script runs before ``commit``) is never named, and a node slow at every step
  is named after W of them. 2W is the shortest span in which a node that stays slow at most
  of its steps is sure to reach W slow steps; a longer one would let old slowness count.

It is cleared when either stops holding: at the latest once half of its newest W steps were
normal. The verdict on a node slow on average does not hang on any one step; only when it
comes may move by an interval. The median of the *others* is the reference, so that the rule
works from two nodes on. Counting only what is known (a lower bound) errs one way: late,
never a false straggler.

**What follows.** Rank 0 records a ``straggler`` event (node, ratio, slow steps) when a node is
first named and ``straggler_cleared`` when it is no longer; the dashboard marks the node and
``/metrics`` exports its ratio (its median step over the others', typical of the window). With
``--evict-stragglers R`` the slowest node the same rule names at ``R`` is asked to leave through
the same request as ``elasticctl leave`` (one at a time, never below ``--nnodes`` MIN): in hot
mode the others go on at the next boundary without it, in their own processes; in restart
mode they restart from a final checkpoint without it.
"""

from __future__ import annotations

import array
import dataclasses
import statistics
import time
from collections.abc import Mapping, Sequence


MIN_EXCESS = 0.002  # seconds a straggler's step is at least slower than the others' median


@dataclasses.dataclass(frozen=True)
class Interval:
    """One exchange: each node's own step times (seconds) over the last ``steps`` steps, as its
    median step and its fastest."""

    steps: int
    median: Mapping[str, float]
    fastest: Mapping[str, float] | None = None  # None: as the median (all of a node's steps alike)

    def fastest_of(self, node: str) -> float | None:
        fastest = None if self.fastest is None else self.fastest.get(node)
        return self.median.get(node) if fastest is None else fastest


@dataclasses.dataclass(frozen=True)
class Straggler:
    node: str
    ratio: float  # its median step over the others' median, typical of the newest window
    steps: int    # its slow steps within the newest 2 x window (at least the window)


def _median_of_others(interval: Interval, node: str) -> float | None:
    others = [t for other, t in interval.median.items() if other != node]
    return statistics.median(others) if others else None


def slowness(interval: Interval, node: str) -> float | None:
    """``node``'s median step over the median of the other nodes' (None: no others, or no time)."""
    reference, mine = _median_of_others(interval, node), interval.median.get(node)
    if reference is None or mine is None:
        return None
    return mine / reference if reference > 0 else (float("inf") if mine > 0 else 1.0)


def _above(seconds: float, reference: float, ratio: float) -> bool:
    return seconds > ratio * reference and seconds - reference >= MIN_EXCESS


def slow_steps(interval: Interval, node: str, ratio: float) -> int:
    """How many of ``node``'s steps in ``interval`` are known to have been slow (above ``ratio``
    x the others' median and :data:`MIN_EXCESS` more): all if its fastest was, more than half
    if its median was, else none (no others or no time: none, no evidence)."""
    reference, median = _median_of_others(interval, node), interval.median.get(node)
    if reference is None or median is None or not _above(median, reference, ratio):
        return 0
    if _above(interval.fastest_of(node), reference, ratio):
        return interval.steps
    return interval.steps // 2 + 1  # the lower median was slow: so was every step above it


def _newest(intervals: Sequence[Interval], steps: int) -> list[Interval]:
    """The newest intervals within the newest ``steps`` steps (the newest one at least)."""
    chosen, covered = [], 0
    for interval in reversed(intervals):
        if chosen and covered + interval.steps > steps:
            break
        chosen.append(interval)
        covered += interval.steps
    return chosen


def find_stragglers(intervals: Sequence[Interval], ratio: float, window: int) -> list[Straggler]:
    """The nodes slow (above ``ratio`` x the others' median and :data:`MIN_EXCESS` more) at more
    than half of their steps over the newest ``window`` steps and at ``window`` or more of them
    within the newest 2 x ``window``, slowest first (the module docstring says why).
    ``intervals``: oldest first, all of one generation."""
    if not intervals:
        return []
    newest_window, newest_two_windows = _newest(intervals, window), _newest(intervals, 2 * window)
    window_steps = sum(interval.steps for interval in newest_window)
    named = []
    for node in sorted(intervals[-1].median):
        slow_now = sum(slow_steps(interval, node, ratio) for interval in newest_window)
        slow_lately = sum(slow_steps(interval, node, ratio) for interval in newest_two_windows)
        if 2 * slow_now > window_steps and slow_lately >= window:
            ratios = [r for r in (slowness(interval, node) for interval in newest_window) if r is not None]
            typical = statistics.median_low(ratios)
            named.append(Straggler(node, round(min(typical, 1e6), 3), slow_lately))
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


def summarize(own_steps: Sequence[float]) -> tuple[float, float]:
    """What a worker sends of its own step times in an interval: (fastest, median). The lower
    median, a step it really took: above a threshold only if more than half of them were."""
    if not own_steps:
        return 0.0, 0.0
    return min(own_steps), statistics.median_low(own_steps)


class StepClock:
    """This worker's own step times (see the module docstring): started at each boundary,
    ended by the gradients' hook or, without one, at ``commit``. Fed from the training thread
    and DDP's autograd thread: each writes one float, replaced whole."""

    def __init__(self) -> None:
        self._started = time.monotonic()
        self._computed: float | None = None  # the last gradient bucket of this step went out
        self._own_steps = array.array("d")    # of the current interval (at most the window's)

    def restart(self) -> None:
        """A new generation (or the wait for one): nothing measured so far counts."""
        self._started, self._computed, self._own_steps = time.monotonic(), None, array.array("d")

    def gradients_ready(self) -> None:
        self._computed = time.monotonic()

    def step_done(self) -> None:
        """At ``commit``: the step's own time joins the interval."""
        now = time.monotonic()
        own = (self._computed if self._computed is not None and self._computed >= self._started else now) \
            - self._started
        self._own_steps.append(own)
        self._computed = None

    def next_step(self) -> None:
        """The boundary's own work is done: the next step's time starts."""
        self._started = time.monotonic()

    def take(self) -> tuple[float, float, int]:
        """The interval's fastest and median step and its step count; a new interval starts."""
        own_steps, self._own_steps = self._own_steps, array.array("d")
        return (*summarize(own_steps), len(own_steps))


def valid_seconds(value: float) -> bool:
    """A step time a peer sent that can be one (finite, not negative, under a day)."""
    return value == value and 0.0 <= value < 86400.0

