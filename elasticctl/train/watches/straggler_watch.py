"""One worker's part in straggler detection: its step clock, the exchange every K steps and,
on rank 0, naming, clearing and evicting (the why of each: :mod:`elasticctl.train.watches.stragglers`,
whose pure rules decide; this module does the collectives and hands events and leave requests
to the runtime's callbacks, which write them on the event thread).

The runtime owns one watch per run: ``new_generation`` when a generation forms, ``step_done``,
``at_boundary`` and ``next_step`` at each step boundary, and its ``bucket_observer`` in the DDP
communication hook of the model it wraps (:mod:`elasticctl.train.watches.ddp_hooks`).
Without settings (not under elasticctl's handler) every call is a no-op.

The exchange runs on the generation's control group with CPU tensors, as the boundary flags do
(a gloo side group where the training group is NCCL: ``process_group.control_channel``), so
that reading the gathered times never waits for a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elasticctl.job.settings import StragglerSettings
from elasticctl.job.records import EventKind
from elasticctl.train.groups.roster import Roster
from elasticctl.train.watches.verdicts import Verdicts
from elasticctl.train.watches.stragglers import (
    Interval,
    StepClock,
    find_stragglers,
    node_times,
    to_evict,
    valid_seconds,
)

log = logging.getLogger(__name__)


class StragglerWatch:
    """This worker's own step times, and what the exchanges of the current generation found."""

    def __init__(self, settings: StragglerSettings | None, worker: str, node: str, *,
                 control_group: Callable[[], Any],
                 roster: Callable[[Any, Any, str], list[str]] | None = None) -> None:
        self.settings = settings
        self.worker, self.node = worker, node
        # the generation's roster, shared with the other watches (groups/roster.py)
        self._roster = roster or Roster(node, worker).nodes
        self._control_group = control_group  # the current generation's, as the flags' (None: torch's default)
        self.verdicts = Verdicts()  # what it concludes: the reporter acts on them (watches/verdicts.py)
        self.clock = StepClock()
        self._intervals: list[Interval] = []
        self._rank_nodes: list[str] | None = None  # the node of each rank ([]: a peer sent a bad id)
        self._named: set[str] = set()     # nodes named stragglers in this generation
        self._evicted: set[str] = set()   # nodes asked to leave as stragglers (once each, per run)

    # -- the runtime's calls ------------------------------------------------------------

    def new_generation(self) -> None:
        """Measure afresh: the members, and so the ranks' nodes, changed."""
        self._intervals, self._rank_nodes, self._named = [], None, set()
        self.clock.restart()

    def step_done(self) -> None:
        self.clock.step_done()

    def next_step(self) -> None:
        self.clock.next_step()

    def bucket_observer(self) -> Callable[[torch.Tensor], None] | None:
        """What the DDP communication hook calls on each bucket: this worker's gradients are ready
        (None: no detection; a model that is not DDP is timed up to ``commit``: see stragglers'
        docstring)."""
        if self.settings is None:
            return None
        clock = self.clock
        return lambda buffer: clock.gradients_ready()

    def at_boundary(self, group: Any, step: int) -> None:
        """The exchange, if this boundary is one: the same answer on every worker of the
        generation (same settings, same step)."""
        if self.settings is not None and group.world_size > 1 and step % self.settings.interval == 0:
            self._exchange(group, step)

    # -- the exchange ---------------------------------------------------------------------

    def _exchange(self, group: Any, step: int) -> None:
        """Every worker's fastest and median own step of the interval (and, once per generation,
        its node), to every worker; rank 0 names, clears and evicts stragglers."""
        fastest, median, steps = self.clock.take()
        control_group = self._control_group()
        if self._rank_nodes is None:
            self._rank_nodes = self._roster(group, control_group, "straggler detection is off")
        mine = torch.tensor([fastest, median, float(steps)], dtype=torch.float64)
        gathered = [torch.empty_like(mine) for _ in range(group.world_size)]
        dist.all_gather(gathered, mine, group=control_group)
        if group.rank != 0 or not self._rank_nodes:
            return
        values = [t.tolist() for t in gathered]
        if not all(valid_seconds(fastest) and valid_seconds(median) and fastest <= median and counted >= 1
                   for fastest, median, counted in values):
            # A worker that measured no step in the interval (or sent nonsense): no evidence, and
            # the intervals before it no longer run up to now (a node is named only for steps
            # that were all measured).
            self._intervals.clear()
            return
        self._intervals.append(Interval(steps=int(min(counted for _, _, counted in values)),
                                        median=node_times(self._rank_nodes, [median for _, median, _ in values]),
                                        fastest=node_times(self._rank_nodes, [fastest for fastest, _, _ in values])))
        settings = self.settings
        # Enough to cover the rule's span, twice the window
        del self._intervals[:-(2 * settings.window // settings.interval + 2)]
        self._act(group, step, len(set(self._rank_nodes)))

    def _act(self, group: Any, step: int, world_nodes: int) -> None:
        settings = self.settings
        named = {s.node: s for s in find_stragglers(self._intervals, settings.ratio, settings.window)}
        for node in sorted(named.keys() - self._named):
            straggler = named[node]
            log.warning("[%s] node %s is a straggler: its own step time is %.2fx the others' median, slow at "
                        "most of its last %d steps and %d of its last %d", self.worker, node, straggler.ratio,
                        settings.window, straggler.steps, 2 * settings.window)
            self.verdicts.record(EventKind.STRAGGLER, node=node, ratio=straggler.ratio, step=step,
                         world_size=group.world_size,
                         reason=f"own step time above {settings.ratio:g}x the others' median at most of its "
                                f"last {settings.window} steps ({straggler.steps} of its last "
                                f"{2 * settings.window})")
        for node in sorted(self._named - named.keys()):
            log.info("[%s] node %s is no longer a straggler", self.worker, node)
            self.verdicts.record(EventKind.STRAGGLER_CLEARED, node=node, step=step)
        self._named = set(named)
        if not settings.evict:
            return
        evict = to_evict(find_stragglers(self._intervals, settings.evict, settings.window), world_nodes,
                         settings.min_nodes)
        if evict is None or evict.node in self._evicted:
            return
        self._evicted.add(evict.node)
        log.warning("[%s] evicting the straggler %s (%.2fx the others, above %g at %d of its last %d steps; "
                    "--evict-stragglers)", self.worker, evict.node, evict.ratio, settings.evict, evict.steps,
                    2 * settings.window)
        self.verdicts.record(EventKind.STRAGGLER, node=evict.node, ratio=evict.ratio, step=step,
                     world_size=group.world_size,
                     reason=f"evicted: above {settings.evict:g}x the others' median at most of its last "
                            f"{settings.window} steps ({evict.steps} of its last {2 * settings.window}) "
                            f"(--evict-stragglers); asked to leave")
        self.verdicts.evict(evict.node)
