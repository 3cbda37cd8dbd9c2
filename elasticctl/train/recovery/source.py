"""The seam of the recovery sources (:mod:`elasticctl.train.recovery`): what every member reports,
whom the members believe, the protocol each source implements, and the pure choice of a plan.

Every member of a new generation reports a fixed-width row of integers: the common part (the
step of its live state, -1 for none: a newcomer, a restarted worker, or a survivor whose shards
no longer fit the new mesh; the generation in which its state was last made one with its peers';
the step it trained to; the shard index it holds in the new mesh, -1 for a replicated state),
then each source's own fields. One all-gather carries them all; :func:`read_reports` splits them.

Who counts as a member of the previous generation is agreed from the reports, never from each
worker's own view of etcd (views differ: a worker sealed out of a generation, or frozen through
it, still remembers the one before): the previous generation's members are those that report the
newest generation last in sync (:func:`previous_members`). A node that was sealed out (lost,
frozen) and returns is a newcomer to the generation it returns to: the survivors that trained on
without it keep their steps, and nothing rolls the job back past them.

A member's report is its own word: a process that could write etcd and got itself admitted (no
job secret) could claim any step and have every real worker load its weights. So the holders
believed are the previous generation's members when any of them holds state (they trained
together, step by step), and a member that claims to be far ahead of the others it trained with
is not believed: members of one generation are at most one step apart (the step in flight when
it ended) (:func:`trust`). Every source plans over the members :func:`trust` believes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from elasticctl.train.state import State

MAX_STEP_LEAD = 1  # steps a member of the previous generation may be ahead of its peers' median
COMMON_FIELDS = 4  # a report's common part: step, in sync, trained, shard


def previous_members(in_sync: Sequence[int], generation: int) -> list[bool]:
    """Which members of generation ``generation`` were members of the previous one, by rank, from
    ``in_sync[rank]``: the generation in which that member's state was last made one with its
    peers' (-1: never, a newcomer or a restarted worker). They are the members that report the
    newest such generation: they trained together until this one formed. A report of this
    generation or a later one cannot be true (the state is synced after the generation forms)
    and counts as none."""
    believable = [number if 0 <= number < generation else -1 for number in in_sync]
    newest = max(believable, default=-1)
    return [newest >= 0 and number == newest for number in believable]


@dataclasses.dataclass(frozen=True)
class Reports:
    """What the members of a forming generation reported, by rank."""

    steps: tuple[int, ...]            # the step of each one's live state (-1: none)
    survivors: tuple[bool, ...]       # whether it was a member of the previous generation
    shards: tuple[int, ...] | None = None  # the shard index it holds in the new mesh; None: a replicated state
    trained: tuple[int, ...] = ()     # the step it trained to before the re-wrap (-1: none)
    fields: Mapping[str, tuple[tuple[int, ...], ...]] = dataclasses.field(default_factory=dict)  # by source

    def of(self, source: str) -> tuple[tuple[int, ...], ...]:
        """Each member's fields of the source named ``source`` (empty: it reported none)."""
        return self.fields.get(source, ())


def common_report(step: int, in_sync: int, trained: int, shard: int | None) -> list[int]:
    """This member's common part of the report (``shard`` None: a replicated state)."""
    return [step, in_sync, trained, -1 if shard is None else shard]


def read_reports(rows: Sequence[Sequence[int]], generation: int, widths: Sequence[tuple[str, int]],
                 sharded: bool) -> Reports:
    """The gathered ``rows`` (one per rank: the common part, then each source's fields in the order
    of ``widths``, ``(name, width)``) as :class:`Reports` of ``generation``."""
    steps, in_sync, trained, shards = (tuple(int(row[field]) for row in rows) for field in range(COMMON_FIELDS))
    fields, start = {}, COMMON_FIELDS
    for name, width in widths:
        fields[name] = tuple(tuple(int(v) for v in row[start:start + width]) for row in rows)
        start += width
    return Reports(steps, tuple(previous_members(in_sync, generation)), shards if sharded else None, trained,
                   fields)


@dataclasses.dataclass(frozen=True)
class Trust:
    """Whose live state the members believe."""

    holders: tuple[int, ...] = ()   # the members whose live state is believed, in rank order
    refused: tuple[int, ...] = ()   # members whose reported step is not believed (far ahead of their peers)
    from_survivors: bool = False    # the holders are members of the previous generation (they trained together)


def trust(steps: Sequence[int], survivors: Sequence[bool], max_lead: int = MAX_STEP_LEAD) -> Trust:
    """The holders believed among members reporting ``steps`` (by rank; -1: no state); ``survivors[rank]``:
    that member was in the previous generation (see the module docstring)."""
    holders = [rank for rank, step in enumerate(steps) if step >= 0]
    if not holders:
        return Trust()
    from_survivors = any(survivors[rank] for rank in holders)
    trusted = [rank for rank in holders if survivors[rank]] if from_survivors else holders
    ordered = sorted(steps[rank] for rank in trusted)
    reference = ordered[(len(ordered) - 1) // 2]  # the lower median: one liar among two loses
    refused = tuple(rank for rank in trusted if steps[rank] > reference + max_lead)
    return Trust(tuple(rank for rank in trusted if rank not in refused), refused, from_survivors)


@dataclasses.dataclass(frozen=True)
class NothingToMove:
    """Every member already holds the state it trains on from."""


@dataclasses.dataclass(frozen=True)
class Restoring:
    """What a source's restore works with: this worker's state and rank, where its new tensors go
    (``device``) and where collectives' tensors travel from (``transport``), the largest message,
    the runtime's checkpoint restore (``restore_from_checkpoint(**event)``: its Restored, None:
    none), the script's ``emit(kind, **fields)``, the worker's name (for the log) and the sharded
    model (None: a replicated state)."""

    state: State
    rank: int
    device: torch.device
    transport: torch.device
    bucket_bytes: int
    restore_from_checkpoint: Callable[..., Any]
    emit: Callable[..., None]
    worker: str
    sharded: Any = None  # elasticctl.train.sharding.shards.ShardedModel


class RecoverySource(Protocol):
    """One place a training state can be brought back from (see :mod:`elasticctl.train.recovery`)."""

    name: str          # names its fields in the reports
    report_width: int  # the integers it adds to every member's report

    def report(self) -> Sequence[int]:
        """This member's fields: exactly ``report_width`` integers."""
        ...

    def plan(self, reports: Reports) -> Any:
        """Pure: the plan that brings every member to one state from this source (one variant of
        :data:`elasticctl.train.recovery.sources.Plan`), or None if it cannot."""
        ...

    def restore(self, plan: Any, reports: Reports, restoring: Restoring) -> tuple[int, ...]:
        """This member's part in carrying out ``plan`` (one this source made; every member calls it
        with the same plan): the ranks that sent this worker its state (empty: none did)."""
        ...


def choose_plan(sources: Sequence[RecoverySource], reports: Reports) -> tuple[RecoverySource, Any]:
    """The first of ``sources`` (in precedence order) that has a plan for ``reports``, and its plan."""
    for source in sources:
        plan = source.plan(reports)
        if plan is not None:
            return source, plan
    raise ValueError(f"None of the recovery sources {[s.name for s in sources]} has a plan; the last "
                     "should always have one (the checkpoint).")
