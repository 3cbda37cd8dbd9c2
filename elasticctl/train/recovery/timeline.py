"""Where the seconds of a hot recovery go: the phases between a fault and the first step after it.

A survivor notices the fault (a collective raised, or the workers agreed on a change at a step
boundary), takes its process group down, waits for the next generation to be sealed in etcd,
builds the new group, brings the state in sync and trains the first step. The runtime marks
the wall-clock end of each phase; these pure functions turn the marks into the timeline the
worker reports (a ``recovery_timeline`` event to the script, the reason of ``recovery_finished``
in the job's history) and the benchmark publishes.
"""

from __future__ import annotations

from collections.abc import Mapping

# In the order they happen; a phase a recovery skipped is left out (``rewrapped``: only a sharded
# model is wrapped anew on each generation's mesh before its state moves, ``module_kept`` where its
# mesh is kept and its groups were reconfigured in place; DDP wraps after; the group is either
# built anew or reconfigured in place: train/groups/reconfigure.py).
RECOVERY_PHASES = ("torn_down", "sealed", "group_built", "group_reconfigured", "rewrapped", "module_kept",
                   "state_synced", "first_step")
PHASE_NAMES = {"torn_down": "group torn down", "sealed": "generation sealed", "group_built": "group built",
               "group_reconfigured": "group reconfigured in place",
               "rewrapped": "model re-wrapped", "module_kept": "sharded module kept",
               "state_synced": "state synced", "first_step": "first step"}


def recovery_timeline(noticed: float, marks: Mapping[str, float]) -> dict[str, float]:
    """Seconds from ``noticed`` to the end of each phase in ``marks`` (wall-clock times), in
    phase order, to the millisecond; unknown names and marks before ``noticed`` are dropped
    (a clock step backwards must not read as a negative phase)."""
    return {phase: round(marks[phase] - noticed, 3) for phase in RECOVERY_PHASES
            if phase in marks and marks[phase] >= noticed}


def describe_timeline(timeline: Mapping[str, float]) -> str:
    """One line for people: ``group torn down +0.012 s, generation sealed +0.310 s, ...``."""
    return ", ".join(f"{PHASE_NAMES[phase]} +{seconds:.3f} s" for phase, seconds in timeline.items()
                     if phase in PHASE_NAMES)
