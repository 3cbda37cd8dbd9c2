"""The key layout of a job in etcd: every path, built here and nowhere else.

Under ``<key_prefix>/<job>/``::

    spec                      the JobSpec every node launches (no lease; its create revision is
                              the run's identity, which signed records are bound to)
    lease                     the id of the run lease (job/run_lease.py), bound to itself
    nodes/<node>              one record per elasticctl process, bound to its lease
    members/<node>            the round the node's torchrun agent is in (state, rank,
                              restarts), bound to the agent's rendezvous lease
    failures/<round>/<node>   worker-group failures of a round, ordered by revision
    control/<node>            "leave" requests; control/_job = "down"
    progress                  what the trainer's rank 0 publishes
    finished                  written when a node's workers all succeeded
    checkpoint-marker         the token of the marker file in the checkpoint directory
    history/events/<time>-<node>-<kind>
                              the event history (time: microseconds, zero-padded: key order
                              is time order), bound to history/lease; kept after `down`
    history/progress/<time>   samples of rank 0's progress over time (time: microseconds,
                              zero-padded), bound to history/lease; for the dashboard's curves
    history/counters/<node>   totals of the job's events for the life of the job (job/counters.py),
                              one shard per node the events are about (``_``: the job's own),
                              updated by compare-and-swap as each event is recorded; bound to
                              history/lease
    history/lease             the id of the lease the events, samples and counters are bound to
    rdzv/nodes/<node>         rendezvous declarations, bound to each node's lease
    rdzv/ctl/round            the sealed round
    rdzv/ctl/closed           the job is done: no round after it
    rdzv/ctl/sealer           the claim to seal the next round, bound to its holder's lease
    rdzv/ctl/reform           the running round must re-form, and why, as a follower of the
                              declarations saw it (bound to the run lease)
    generations/...           the same keys as rdzv/ for the workers' generations (hot recovery):
                              nodes/<node>.<local rank>, ctl/round, ctl/sealer, ctl/closed,
                              ctl/reform
    store/<round>/...         the agents' c10d store of a round
    rdzv                      torch's own rendezvous state (``EtcdRendezvousBackend`` only)
"""

from __future__ import annotations

import dataclasses

DEFAULT_KEY_PREFIX = "/elasticctl/jobs"
JOB_CONTROL = "_job"  # the name under control/ that speaks to every node


@dataclasses.dataclass(frozen=True)
class JobKeys:
    """Every key of job ``job`` under ``key_prefix``; prefixes end with ``/``."""

    job: str
    key_prefix: str = DEFAULT_KEY_PREFIX
    protocol: str = "rdzv"  # whose rendezvous keys: the agents' rounds, or the workers' generations

    def generations(self) -> JobKeys:
        """The keys of the workers' generations (hot recovery): the same protocol as the agents'
        rounds, under ``generations/`` instead of ``rdzv/``."""
        return dataclasses.replace(self, protocol="generations")

    @property
    def root(self) -> str:
        """The job's prefix, without the trailing ``/`` (every key below starts with it)."""
        return f"{self.key_prefix.rstrip('/')}/{self.job}"

    @property
    def everything(self) -> str:
        return self.root + "/"

    # -- the job and its nodes ---------------------------------------------------------

    @property
    def spec(self) -> str:
        return f"{self.root}/spec"

    @property
    def run_lease(self) -> str:
        """The id of the run lease every live agent and worker renews (job/run_lease.py)."""
        return f"{self.root}/lease"

    @property
    def nodes(self) -> str:
        return f"{self.root}/nodes/"

    def node(self, node: str) -> str:
        return self.nodes + node

    @property
    def members(self) -> str:
        return f"{self.root}/members/"

    def member(self, node: str) -> str:
        return self.members + node

    def failures(self, round_number: int) -> str:
        return f"{self.root}/failures/{round_number}/"

    def failure(self, round_number: int, node: str) -> str:
        return self.failures(round_number) + node

    @property
    def control(self) -> str:
        return f"{self.root}/control/"

    def control_for(self, node: str) -> str:
        return self.control + node

    @property
    def progress(self) -> str:
        return f"{self.root}/progress"

    @property
    def finished(self) -> str:
        return f"{self.root}/finished"

    @property
    def checkpoint_marker(self) -> str:
        return f"{self.root}/checkpoint-marker"

    # -- the event history ----------------------------------------------------------------

    @property
    def history(self) -> str:
        """What outlives a run's `down`: the events and their lease."""
        return f"{self.root}/history/"

    @property
    def events(self) -> str:
        return self.history + "events/"

    def event(self, time: float, node: str, kind: str) -> str:
        """The key of an event: its time in microseconds, zero-padded, so key order is time order."""
        return f"{self.events}{round(time * 1_000_000):020d}-{node or '_'}-{kind}"

    @property
    def events_lease(self) -> str:
        """The shared lease of everything under ``history/`` (events, progress samples, counters)."""
        return self.history + "lease"

    @property
    def counters(self) -> str:
        """The shards of the job's counters (job/counters.py): monotonic totals of its events."""
        return self.history + "counters/"

    def counter_shard(self, shard: str) -> str:
        return self.counters + shard

    @property
    def progress_samples(self) -> str:
        return self.history + "progress/"

    def progress_sample(self, time: float) -> str:
        """The key of a progress sample: its time in microseconds, zero-padded (key order: time order)."""
        return f"{self.progress_samples}{round(time * 1_000_000):020d}"

    # -- the rendezvous ----------------------------------------------------------------

    @property
    def rdzv(self) -> str:
        return f"{self.root}/{self.protocol}/"

    @property
    def rdzv_nodes(self) -> str:
        return self.rdzv + "nodes/"

    def rdzv_node(self, node: str) -> str:
        return self.rdzv_nodes + node

    @property
    def rdzv_ctl(self) -> str:
        return self.rdzv + "ctl/"

    @property
    def rdzv_round(self) -> str:
        return self.rdzv_ctl + "round"

    @property
    def rdzv_closed(self) -> str:
        return self.rdzv_ctl + "closed"

    @property
    def rdzv_sealer(self) -> str:
        return self.rdzv_ctl + "sealer"

    @property
    def rdzv_reform(self) -> str:
        return self.rdzv_ctl + "reform"

    def store(self, round_number: int | None = None) -> str:
        """The agents' store of a round (of every round without one)."""
        return f"{self.root}/store/" + ("" if round_number is None else f"{round_number}/")

    @property
    def torch_state(self) -> str:
        return f"{self.root}/rdzv"

    # -- keys back to names ------------------------------------------------------------

    def node_of(self, key: str | bytes) -> str:
        """The node a ``nodes/<node>`` key is of."""
        return name_under(self.nodes, key)


def name_under(prefix: str, key: str | bytes) -> str:
    """What ``key`` (bytes as etcd returns them, or text) names under ``prefix``: the rest of it.

    Keys come from etcd, where anyone may have written them: bytes that are not UTF-8 are
    replaced, not an error. A key not under ``prefix`` is a bug of the caller's.
    """
    text = key.decode(errors="replace") if isinstance(key, bytes) else key
    if not text.startswith(prefix):
        raise ValueError(f"The key {text!r} is not under {prefix!r}.")
    return text[len(prefix):]


def jobs_root(key_prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The prefix under which every job has its keys."""
    return key_prefix.rstrip("/") + "/"


def job_of(key: str | bytes, key_prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The job a key under :func:`jobs_root` belongs to (its first name there)."""
    return name_under(jobs_root(key_prefix), key).split("/", 1)[0]


def probe_key(key_prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """A key no job has and nothing writes: ``doctor`` times reads of it without a job."""
    return f"{key_prefix.rstrip('/')}/doctor-probe"
