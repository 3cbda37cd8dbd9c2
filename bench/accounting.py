"""Checks on a hot job's step record: identical replicas, and every sample trained once.

Shared by the chaos soak (bench/chaos.py, records of trainers/mlp.py with
``--record-params``) and tests/process/test_hot.py (records of tests/support/workers/hot.py).
A step line needs ``step``, ``generation``, ``epoch``, ``world_size``, ``time``, ``params``
(a digest of the parameters before the step), and its global span in the epoch:
either ``position`` (before the step) and ``batch`` (per worker; hot.py), or
``consumed`` (after the step, capped at the epoch's end) and ``indices`` (mlp.py).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools


class AccountingError(AssertionError):
    """A check failed; the message is one line naming what and where."""


@dataclasses.dataclass(frozen=True)
class Accounting:
    steps: int        # step numbers in the lineage
    applications: int  # (generation, step) pairs: a step re-done after a failure counts again
    epochs_completed: int

    @property
    def redone(self) -> int:
        return self.applications - self.steps


def span(r: dict) -> tuple[int, int]:
    """The step's [start, end) positions in its epoch's global stream."""
    if "position" in r:
        return r["position"], r["position"] + r["batch"] * r["world_size"]
    # consumed is capped at the epoch's end, where the sampler pads the last step (up to
    # world_size - 1 samples twice): the start derived here is then at most that much early.
    return r["consumed"] - len(r["indices"]) * r["world_size"], r["consumed"]


def lineage(steps: list[dict]) -> dict[int, dict]:
    """Per step number, a line of the generation that applied it last (a re-done step replaces the first)."""
    latest: dict[int, dict] = {}
    for r in sorted(steps, key=lambda r: (r["generation"], r["time"])):
        latest[r["step"]] = r
    return latest


def check_replicas(steps: list[dict], across_generations: bool = False) -> None:
    """Every worker of a generation had the same parameters before each step. With
    ``across_generations``, so did every generation that (re-)did a step: a step in flight
    is either applied by all or re-done from the same state. A sharded model's lines carry
    ``shard`` and the digest of that shard: compared among the replicas of each shard."""
    digests = collections.defaultdict(set)
    for r in steps:
        at = r["step"] if across_generations else (r["generation"], r["step"])
        digests[(at, r["shard"]) if "shard" in r else at].add(r["params"])
    diverged = sorted(k for k, v in digests.items() if len(v) > 1)
    if diverged:
        where = "step" if across_generations else "(generation, step)"
        raise AccountingError(f"replicas diverged at {len(diverged)} {where}: {diverged[:5]}")


def check_samples(steps: list[dict], dataset_size: int | None = None) -> Accounting:
    """No sample lost or trained twice: the lineage's spans tile each epoch from 0, the step
    numbers follow each other, and (given ``dataset_size``) every epoch but the last reaches its end."""
    if not steps:
        raise AccountingError("no step was recorded")
    latest = lineage(steps)
    numbers = sorted(latest)
    if numbers != list(range(numbers[0], numbers[-1] + 1)):
        missing = sorted(set(range(numbers[0], numbers[-1] + 1)) - set(numbers))
        raise AccountingError(f"step numbers missing from the record: {missing[:5]}")
    by_epoch = collections.defaultdict(list)
    for step in numbers:
        r = latest[step]
        by_epoch[r["epoch"]].append((*span(r), step, r["world_size"]))
    epochs = sorted(by_epoch)
    for epoch in epochs:
        spans = by_epoch[epoch]  # in step order: each step starts where the one before ended
        first_start, _, first_step, _ = spans[0]
        if first_step != numbers[0] and first_start != 0:  # the record's first epoch may start mid-way
            raise AccountingError(f"epoch {epoch} starts at position {first_start} (step {first_step}), not 0")
        for (_, end, step, _), (start, next_end, next_step, world) in itertools.pairwise(spans):
            padded = next_end == dataset_size and end - world < start <= end
            if start != end and not padded:
                raise AccountingError(f"epoch {epoch}: step {step} ends at position {end}, "
                                      f"step {next_step} starts at {start}")
        if dataset_size is not None and epoch != epochs[-1] and spans[-1][1] != dataset_size:
            raise AccountingError(f"epoch {epoch} ended at position {spans[-1][1]} of {dataset_size}")
    applications = len({(r["generation"], r["step"]) for r in steps})
    return Accounting(steps=len(numbers), applications=applications, epochs_completed=len(epochs) - 1)
