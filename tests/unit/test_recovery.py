"""The recovery sources' seam (elasticctl.train.recovery): reports split from one all-gather, the pure
chooser's precedence, the registered order, table-tested. Each source's own plan: test_state_sync.py
and test_shard_sync.py (the replicas), test_peer_copies.py (the peer copies)."""

from __future__ import annotations

import dataclasses

import pytest

from elasticctl.train.recovery.from_checkpoint import Checkpoint, FromCheckpoint
from elasticctl.train.recovery.from_peer_copies import FromPeerCopies, PeerCopySource
from elasticctl.train.recovery.from_replicas import FromReplicas, Replicas, ReplicaTransfer
from elasticctl.train.recovery.source import (
    NothingToMove,
    Reports,
    choose_plan,
    common_report,
    read_reports,
)
from elasticctl.train.recovery.sources import recovery_sources

T, F = True, False


@dataclasses.dataclass
class Fake:
    """A source whose plan is given (None: it has none)."""

    name: str
    answer: object
    report_width: int = 0

    def report(self):
        return []

    def plan(self, reports):
        return self.answer

    def restore(self, plan, reports, restoring):
        return ()


REPORTS = Reports((7, -1), (T, F))


@pytest.mark.parametrize("answers, chosen", [
    # the first source with a plan wins, whatever the later ones would do
    ([NothingToMove(), FromCheckpoint()], ("a", NothingToMove())),
    ([None, FromCheckpoint((1,))], ("b", FromCheckpoint((1,)))),
    ([None, None, FromCheckpoint()], ("c", FromCheckpoint())),
    ([None, FromPeerCopies(3, 2, 5, 9, (0, 1), ()), FromCheckpoint()], ("b", FromPeerCopies(3, 2, 5, 9, (0, 1), ()))),
])
def test_the_chooser_takes_the_first_plan_in_precedence_order(answers, chosen):
    sources = [Fake(name, answer) for name, answer in zip("abc", answers, strict=False)]
    source, plan = choose_plan(sources, REPORTS)
    assert (source.name, plan) == chosen


def test_the_chooser_refuses_sources_without_a_plan():
    with pytest.raises(ValueError, match="has a plan"):
        choose_plan([Fake("a", None)], REPORTS)


def test_the_registered_order_is_replicas_then_peer_copies_then_the_checkpoint():
    assert [type(s) for s in recovery_sources()] == [Replicas, Checkpoint]
    assert [type(s) for s in recovery_sources(object())] == [Replicas, PeerCopySource, Checkpoint]


@pytest.mark.parametrize("steps, survivors, shards, plan", [
    # a replicated state: its replicas, else the checkpoint
    ((7, 7, -1), (T, T, F), None, FromReplicas((ReplicaTransfer(None, (0, 1, 2), (0, 1)),), 7)),
    ((7, 7), (T, T), None, NothingToMove()),
    ((-1, -1), (F, F), None, FromCheckpoint()),
    # a sharded one without peer copies: the checkpoint names the shards no replica held at the newest step
    ((9, 8, 9, 8), (T, T, T, T), (0, 1, 0, 1), FromCheckpoint((1,))),
    ((9, 9, 8, 8), (T, T, T, T), (0, 1, 0, 1),
     FromReplicas((ReplicaTransfer(0, (0, 2), (0,)), ReplicaTransfer(1, (1, 3), (1,))), 9)),
    ((-1, -1), (F, F), (0, 1), FromCheckpoint()),
])
def test_the_chooser_over_the_registered_sources_without_peer_copies(steps, survivors, shards, plan):
    assert choose_plan(recovery_sources(), Reports(steps, survivors, shards, steps))[1] == plan


def test_reports_are_split_by_field_and_by_source():
    rows = [common_report(9, 4, 9, 0) + [1, 2, 3] + [7], common_report(-1, -1, -1, 1) + [4, 5, 6] + [8]]
    reports = read_reports(rows, 5, [("x", 3), ("y", 1)], sharded=True)
    assert reports == Reports((9, -1), (T, F), (0, 1), (9, -1), {"x": ((1, 2, 3), (4, 5, 6)), "y": ((7,), (8,))})
    assert reports.of("x") == ((1, 2, 3), (4, 5, 6)) and reports.of("z") == ()
    replicated = read_reports([common_report(3, 4, 3, None)], 5, [], sharded=False)
    assert replicated.shards is None and replicated.steps == (3,) and replicated.survivors == (T,)
