"""Whose fault was a worker-group failure, and when a node is put aside: pure decisions.

A node whose workers failed re-joins at once; whether the failure spends one of its
restarts is decided afterwards, from evidence gathered in etcd (:class:`Evidence`),
by :func:`failure_verdict`. The rules:

* a member of the failed round was lost (its lease ended) up to ``node_ttl`` + 1 s
  after the failure: the failure was collateral, free;
* this node was cut off (its own lease ended, or etcd was unreachable): free;
* the round was re-forming when the workers failed (a newcomer waiting, a member
  re-joining without a failure of its own): the teardown took them down, free;
* another node recorded a failure in the same round first: free;
* otherwise, once ``node_ttl`` + 1 s have passed without such evidence: its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

EVIDENCE_SLACK = 1.0


@dataclasses.dataclass(frozen=True)
class Evidence:
    node: str
    round_members: tuple[str, ...]
    failed_at: float                    # when this node's workers were seen failing (monotonic)
    gone_at: Mapping[str, float]        # member -> when its lease ended (monotonic)
    departed: frozenset[str] = frozenset()  # members that left gracefully (not a fault)
    failures: Sequence[str] = ()        # nodes that recorded a failure of the round, first first
    cut_off: bool = False               # this node's lease ended, or etcd was out of reach
    waiting: tuple[str, ...] = ()       # newcomers waiting for the next round when the workers failed
    rejoining: tuple[str, ...] = ()     # members that wanted a later round when the workers failed


@dataclasses.dataclass(frozen=True)
class Verdict:
    own: bool
    reason: str


def failure_verdict(evidence: Evidence, node_ttl: float, now: float) -> Verdict | None:
    """The verdict on ``evidence``, or None while it may still change (keep gathering)."""
    window = node_ttl + EVIDENCE_SLACK
    lost = sorted(m for m in evidence.round_members
                  if m != evidence.node and m in evidence.gone_at and m not in evidence.departed
                  and evidence.gone_at[m] <= evidence.failed_at + window)
    if lost:
        return Verdict(False, f"the round lost {', '.join(lost)}")
    if evidence.cut_off:
        return Verdict(False, "this node was cut off (frozen, or etcd out of reach)")
    changed = [*evidence.waiting, *(m for m in evidence.rejoining if m not in evidence.failures)]
    if changed:
        return Verdict(False, f"the round was re-forming for {', '.join(changed)}")
    if evidence.failures and evidence.failures[0] != evidence.node:
        return Verdict(False, f"{evidence.failures[0]} failed first")
    alone = set(evidence.round_members) <= {evidence.node}
    if now - evidence.failed_at < window and not alone:  # a lone node has no peer to blame
        return None
    return Verdict(True, "its workers failed on their own")


def quarantine_due(counted_at: Sequence[float], now: float, window: float, after: int) -> bool:
    """Whether ``after`` own failures fell within the last ``window`` seconds."""
    return len([t for t in counted_at if now - t < window]) >= after


def quarantine_by_default(own_budget: bool, min_nodes: int, max_nodes: int) -> bool:
    """Whether quarantine applies when ``quarantine_after`` was not given.

    Quarantine puts a failing node aside so that the others train on without it.
    ``own_budget`` (``max_restarts`` in the rendezvous options, as ``elasticctl up`` always
    passes): the handler keeps the restart budget and torchrun's is unlimited, so
    quarantine is part of that budget: on. Under plain torchrun, ``--max-restarts`` is the
    budget; quarantine only helps where the others can form a round without this node
    (``min_nodes < max_nodes``). Otherwise it would only add a pause to the same restarts.
    """
    return own_budget or min_nodes < max_nodes
