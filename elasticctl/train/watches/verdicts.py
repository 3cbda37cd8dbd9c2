"""What a watch concludes, as values: an event for the job's history (:class:`Finding`) or a node
asked to leave (:class:`Eviction`). A watch only collects them; the runtime's one reporter acts on
them (train/worker/watch_supervisor.py), so that no watch writes to etcd or asks a node to go."""

from __future__ import annotations

import dataclasses
from typing import Any

from elasticctl.job.records import EventKind


@dataclasses.dataclass(frozen=True)
class Finding:
    """An event of ``node`` (None: the watching worker's own node; "": the job's own) for the
    job's history, with its fields."""

    kind: EventKind
    node: str | None
    fields: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Eviction:
    """``node`` asked to leave, as ``elasticctl leave`` does."""

    node: str


Verdict = Finding | Eviction


class Verdicts:
    """A watch's verdicts since they were last taken (the training thread's: no lock)."""

    def __init__(self) -> None:
        self._found: list[Verdict] = []

    def record(self, kind: EventKind, node: str | None = None, **fields: Any) -> None:
        self._found.append(Finding(kind, node, fields))

    def evict(self, node: str) -> None:
        self._found.append(Eviction(node))

    def take(self) -> list[Verdict]:
        found, self._found = self._found, []
        return found
