"""The recovery sources a worker asks, in precedence order, and the plan's variants: the registration
of every source (see :mod:`elasticctl.train.recovery`)."""

from __future__ import annotations

from typing import Union

from elasticctl.train.sharding.buddy_copies import PeerCopies
from elasticctl.train.recovery.from_checkpoint import Checkpoint, FromCheckpoint
from elasticctl.train.recovery.from_peer_copies import FromPeerCopies, PeerCopySource
from elasticctl.train.recovery.from_replicas import FromReplicas, Replicas
from elasticctl.train.recovery.source import NothingToMove, RecoverySource

# What a forming generation does before it trains: exactly one of these, made by one source.
Plan = Union[NothingToMove, FromReplicas, FromPeerCopies, FromCheckpoint]  # noqa: UP007 - the sum type, named


def recovery_sources(peer_copies: PeerCopies | None = None) -> list[RecoverySource]:
    """The sources in precedence order: per shard, a live replica beats a buddy's copy, which beats
    the checkpoint (always last: it always has a plan). ``peer_copies``: this worker's copies (None:
    the state keeps none, and its source is not asked)."""
    sources: list[RecoverySource] = [Replicas()]
    if peer_copies is not None:
        sources.append(PeerCopySource(peer_copies))
    sources.append(Checkpoint())
    return sources
