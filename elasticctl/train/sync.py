"""Who sends the state when a generation forms: a pure decision over the steps the members report.

Every member of a new generation reports its step (-1: it holds no state, a newcomer or a
restarted worker). When they differ, one member broadcasts its whole state to the others.
A member's report is its own word: a process that could write etcd and got itself
admitted (no job secret) could claim any step and have every real worker load its
weights. So the sender is chosen among the members that were in the previous generation
when any of them holds state (they trained together, step by step), and a member that
claims to be far ahead of the others it trained with is not believed: members of one
generation are at most one step apart (the step in flight when it ended).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

MAX_STEP_LEAD = 1  # steps a member of the previous generation may be ahead of its peers' median


@dataclasses.dataclass(frozen=True)
class SyncPlan:
    """What the members of a new generation do before they train."""

    source: int | None = None         # the rank that broadcasts its state (None: nobody needs to)
    from_checkpoint: bool = False     # nobody holds state: everyone restores the newest checkpoint
    refused: tuple[int, ...] = ()     # ranks whose reported step was not believed


def plan_state_sync(steps: Sequence[int], survivors: Sequence[bool],
                    max_lead: int = MAX_STEP_LEAD) -> SyncPlan:
    """The plan for members reporting ``steps`` (by rank); ``survivors[rank]``: that member was in
    the previous generation."""
    holders = [rank for rank, step in enumerate(steps) if step >= 0]
    if not holders:
        return SyncPlan(from_checkpoint=True)
    trusted = [rank for rank in holders if survivors[rank]] or holders
    ordered = sorted(steps[rank] for rank in trusted)
    reference = ordered[(len(ordered) - 1) // 2]  # the lower median: one liar among two loses
    refused = tuple(rank for rank in trusted if steps[rank] > reference + max_lead)
    eligible = [rank for rank in trusted if rank not in refused]
    best = max(steps[rank] for rank in eligible)
    if all(step == best for step in steps):
        return SyncPlan(refused=refused)
    return SyncPlan(source=min(rank for rank in eligible if steps[rank] == best), refused=refused)
