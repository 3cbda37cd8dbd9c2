"""One worker's part in the replica check: the exchange every K steps and, on rank 0, naming and
evicting a diverged replica; on every rank, the stop when replicas disagree with no majority
(the why of each: :mod:`elasticctl.train.watches.replica_check`, whose pure rule decides; this module
does the collective and hands events and leave requests to the runtime's callbacks, which write
them on the event thread).

The runtime owns one watch per run: ``new_generation`` when a generation forms and
``at_boundary`` at each step boundary, before that boundary's checkpoint (a checkpoint of a step
whose check failed is never written). Without settings (not under elasticctl's handler), or with
``--replica-check 0``, every call is a no-op.

Cost: every K steps one checksum of this worker's parameters on their device (a pass over them,
with one scalar brought to the CPU) and one all-gather of two int64 per worker on the
generation's control group, with CPU tensors as the boundary flags and the straggler exchange
(:mod:`elasticctl.train.groups.process_group`). Every worker has the same K and reaches the same step,
so every worker takes part in the same exchange.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elasticctl.job.records import EventKind
from elasticctl.job.settings import ReplicaCheckSettings
from elasticctl.train.watches.replica_check import (
    NO_REPLICA,
    Diverged,
    ReplicasDisagree,
    ReplicaVerdict,
    judge_replicas,
    parameters_digest,
)
from elasticctl.train.groups.roster import Roster
from elasticctl.train.watches.verdicts import Verdicts

log = logging.getLogger(__name__)


class ReplicaWatch:
    """The replica checks of this worker's run, and what they found in the current generation."""

    def __init__(self, settings: ReplicaCheckSettings | None, worker: str, node: str, *,
                 control_group: Callable[[], Any], replica_set: Callable[[], int | None], sharded: bool,
                 roster: Callable[[Any, Any, str], list[str]] | None = None) -> None:
        self.settings = settings
        self.worker, self.node = worker, node
        # the generation's roster, shared with the other watches (groups/roster.py)
        self._roster = roster or Roster(node, worker).nodes
        self._control_group = control_group  # the current generation's, as the flags' (None: torch's default)
        self._replica_set = replica_set      # this worker's replica-set key (None: its state has no replica)
        self._sharded = sharded              # the replica sets are shard indexes (else one set: DDP)
        self.verdicts = Verdicts()  # what it concludes: the reporter acts on them (watches/verdicts.py)
        self._rank_nodes: list[str] | None = None  # the node of each rank ([]: a peer sent a bad id)
        self._named: set[str] = set()    # nodes named diverged in this generation (one event each)
        self._evicted: set[str] = set()  # nodes asked to leave as diverged (once each, per run)
        self._kept: set[str] = set()     # nodes not evicted (too few nodes left): logged once per generation
        self.agreed_at: int | None = None  # the newest step every replica agreed at, in this run

    @property
    def interval(self) -> int:
        return 0 if self.settings is None else self.settings.interval

    def new_generation(self) -> None:
        """The members, and so the ranks' nodes, changed."""
        self._rank_nodes, self._named, self._kept = None, set(), set()

    def at_boundary(self, group: Any, step: int, model: torch.nn.Module) -> None:
        """The check, if this boundary is one: the same verdict on every worker of the generation
        (same settings, same step, the same gathered checksums). Raises ReplicasDisagree on every
        worker when a replica set has no majority."""
        if not self.interval or group.world_size == 1 or step % self.interval:
            return
        key = self._replica_set()
        if key is None:  # no replica anywhere (the same on every worker): nothing to compare
            return
        verdict = self._exchange(group, parameters_digest(model), key)
        if group.rank == 0 and self._rank_nodes:
            self._name(group, step, verdict)
        if verdict.no_majority:
            raise ReplicasDisagree(self._stop_sentence(step, verdict))
        if verdict.agree:
            self.agreed_at = step

    # -- the exchange ---------------------------------------------------------------------

    def _exchange(self, group: Any, digest: int, key: int) -> ReplicaVerdict:
        """Every worker's (checksum, replica-set key), and once per generation its node, to every
        worker; the verdict on them (any two int64 are a report: the rule reads nothing else)."""
        control_group = self._control_group()
        if self._rank_nodes is None:
            self._rank_nodes = self._roster(group, control_group, "the replica check names no node and evicts none")
        mine = torch.tensor([digest, key if key >= 0 else NO_REPLICA], dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(group.world_size)]
        dist.all_gather(gathered, mine, group=control_group)
        reports = [tuple(int(v) for v in t.tolist()) for t in gathered]
        return judge_replicas(reports)

    # -- the verdict ----------------------------------------------------------------------

    def _name(self, group: Any, step: int, verdict: ReplicaVerdict) -> None:
        """Rank 0: an event per diverged node (once per generation), its eviction if asked for;
        a job-wide event when a set has no majority (the stop follows on every rank)."""
        for diverged in verdict.diverged:
            node = self._rank_nodes[diverged.rank]
            what = self._set_name(diverged.replica_set)
            if node not in self._named:
                self._named.add(node)
                log.error("[%s] the parameters of rank %d (node %s) differ from those of %d of the %d replicas%s at "
                          "step %d: silent corruption on that node", self.worker, diverged.rank, node,
                          diverged.agreeing, diverged.members, what, step)
                self.verdicts.record(EventKind.REPLICA_DIVERGED, node=node, step=step, world_size=group.world_size,
                             reason=f"rank {diverged.rank}'s parameters differ from those of {diverged.agreeing} of "
                                    f"its {diverged.members} replicas{what} (a parameter checksum every "
                                    f"{self.interval} steps)")
            if self.settings.evict and node not in self._evicted:
                self._evict(group, step, node, diverged)
        for split in verdict.no_majority:
            nodes = sorted({self._rank_nodes[rank] for rank in split.ranks})
            self.verdicts.record(EventKind.REPLICA_DIVERGED, node="", step=step, world_size=group.world_size,
                         reason=f"the replicas{self._set_name(split.replica_set)} on {', '.join(nodes)} hold "
                                f"{split.checksums} different parameter checksums and none is held by a majority: "
                                "the job stops")

    def _evict(self, group: Any, step: int, node: str, diverged: Diverged) -> None:
        nodes_left = len(set(self._rank_nodes)) - 1
        if nodes_left < self.settings.min_nodes:
            if node in self._kept:
                return
            self._kept.add(node)
            log.warning("[%s] not evicting the diverged node %s: %d nodes would be left, fewer than the job's "
                        "minimum %d", self.worker, node, nodes_left, self.settings.min_nodes)
            return
        self._evicted.add(node)
        log.warning("[%s] evicting the diverged node %s (--evict-diverged)", self.worker, node)
        self.verdicts.record(EventKind.REPLICA_DIVERGED, node=node, step=step, world_size=group.world_size,
                     reason=f"evicted: rank {diverged.rank}'s parameters differ from its replicas' majority "
                            "(--evict-diverged); asked to leave")
        self.verdicts.evict(node)

    def _set_name(self, key: int) -> str:
        """How a sentence names a replica set: nothing for DDP's one set, the shard for HSDP's."""
        return f" of shard {key}" if self._sharded else ""

    def _stop_sentence(self, step: int, verdict: ReplicaVerdict) -> str:
        split = verdict.no_majority[0]
        since = (f"the replicas last agreed at step {self.agreed_at}: resume from a checkpoint of that step or "
                 "older" if self.agreed_at is not None else
                 "no earlier check of this run passed: resume from a checkpoint you trust")
        return (f"The replicas{self._set_name(split.replica_set)} (ranks {', '.join(map(str, split.ranks))}) hold "
                f"{split.checksums} different parameter checksums at step {step} and none is held by a majority, "
                f"so the job stops; {since}.")
