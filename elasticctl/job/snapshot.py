"""One read of a job, as every reader of it starts: ``status`` (:class:`elasticctl.job.registry.JobView`)
and the dashboard (:class:`elasticctl.dashboard.model.Reading`) each present the same snapshot,
which :meth:`elasticctl.job.registry.Registry.snapshot` reads. Data only: no I/O here.
"""

from __future__ import annotations

import dataclasses
import enum

from elasticctl.job.records import Round
from elasticctl.job.spec import JobSpec

MAX_HEARTBEAT_LOOKUPS = 128  # one lease request per node and snapshot: bounded for very large jobs


class Part(enum.Flag):
    """What a snapshot reads besides the nodes, members and progress every reader needs."""

    NONE = 0
    SPEC = enum.auto()
    REQUESTS = enum.auto()    # whether `down` was requested
    GENERATION = enum.auto()  # the workers' current generation (hot recovery)
    HEARTBEATS = enum.auto()  # the nodes' lease ages: one lease request per node
    HISTORY = enum.auto()     # the event history, the progress samples and the counters
    STATUS = SPEC | REQUESTS | GENERATION
    DASHBOARD = HEARTBEATS | HISTORY | GENERATION


@dataclasses.dataclass(frozen=True)
class JobSnapshot:
    """One read of a job's records, as stored: untrusted bytes by node id where keys name a
    node. Each reader (``status``'s :class:`JobView`, the dashboard's ``Reading``) types and
    checks them its own way; parts not asked for are empty."""

    job: str
    nodes: dict[str, bytes]        # nodes/<node>
    node_leases: dict[str, int]    # the lease each nodes/<node> key is bound to (0: none)
    members: dict[str, bytes]      # members/<node>
    progress: bytes | None
    spec: JobSpec | None = None
    down_requested: bool = False
    generation: Round | None = None
    heartbeats: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds since a
    # node's lease was last renewed (granted TTL - remaining TTL), for the first nodes by id
    events: list[bytes] = dataclasses.field(default_factory=list)   # history/events/, time order
    samples: list[bytes] = dataclasses.field(default_factory=list)  # history/progress/, time order
    counters: list[bytes] = dataclasses.field(default_factory=list)  # history/counters/, the shards
