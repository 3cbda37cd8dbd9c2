"""What etcd knows about a job: its spec, its nodes, their rounds, requests and progress.

Everything is JSON (never pickle), at the keys :mod:`elasticctl.job.keys` lays out.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import socket
import time
from collections.abc import Iterable, Mapping

from elasticctl.errors import ConfigError, ElasticctlError
from elasticctl.etcd.client import EtcdClient
from elasticctl.etcd.watch import WatchedKeys
from elasticctl.job.keys import DEFAULT_KEY_PREFIX, JOB_CONTROL, JobKeys, job_of, jobs_root, name_under, probe_key
from elasticctl.job.records import (
    MEMBER_FIELDS,
    NODE_FIELDS,
    PROGRESS_FIELDS,
    MemberState,
    Round,
    json_object,
    record_json,
    typed_record,
)
from elasticctl.job.settings import DEFAULT_NODE_TTL  # noqa: F401 (re-exported)
from elasticctl.job.options import RecoveryMode
from elasticctl.job.settings import parse_rdzv_options
from elasticctl.job.snapshot import MAX_HEARTBEAT_LOOKUPS, JobSnapshot, Part
from elasticctl.job.spec import JobSpec, validate_name

log = logging.getLogger(__name__)

def _untimed(request: str, call):
    return call()


def spare_nodes(max_nodes: int, nodes: Iterable[str], members: Mapping[str, dict], generation: Round | None) -> list[str]:
    """Live ``nodes`` waiting beside a full world (hot spares): their agent runs (restart mode)
    or their workers too (hot mode, ``generation`` given), and none of them is in the current
    round or generation. ``members``: the typed member records by node."""
    if generation is not None:
        in_world = {worker.rsplit(".", 1)[0] for worker in generation.members}
    else:
        rounds = [m.get("round") for m in members.values() if m.get("state") == MemberState.TRAINING]
        current = max(rounds) if rounds else None
        in_world = {n for n, m in members.items()
                    if m.get("round") == current and m.get("state") == MemberState.TRAINING}
    if len(in_world) < max_nodes:
        return []  # a node outside a world with room is joining, not spare
    waiting = (MemberState.JOINING.value, MemberState.TRAINING.value)
    return sorted(n for n in nodes if n not in in_world
                  and members.get(n, {}).get("state", MemberState.JOINING.value) in waiting)


def spares_expected(spec: JobSpec | None) -> int:
    """The spares a job's spec asks for (``--spares N``, rendezvous option ``spares``); 0 without
    a spec or with options that do not parse (a spec read from etcd is shown, not trusted)."""
    if spec is None:
        return 0
    try:
        return parse_rdzv_options(dict(spec.rdzv_conf)).spares
    except (ConfigError, TypeError, ValueError):
        return 0


@dataclasses.dataclass(frozen=True)
class JobView:
    """One read of a job, for ``status``."""

    name: str
    spec: JobSpec | None
    nodes: dict[str, dict]
    members: dict[str, dict]
    progress: dict | None
    down_requested: bool
    generation: Round | None = None  # the workers' current generation (hot recovery)

    @classmethod
    def of(cls, snapshot: JobSnapshot) -> JobView:
        """``status``'s reading of ``snapshot`` (read with :attr:`Part.STATUS`)."""
        return cls(
            name=snapshot.job, spec=snapshot.spec,
            nodes={node: typed_record(raw, NODE_FIELDS) for node, raw in snapshot.nodes.items()},
            members={node: typed_record(raw, MEMBER_FIELDS) for node, raw in snapshot.members.items()},
            progress=None if snapshot.progress is None else typed_record(snapshot.progress, PROGRESS_FIELDS),
            down_requested=snapshot.down_requested, generation=snapshot.generation,
        )

    @property
    def recovery(self) -> RecoveryMode:
        """The job's recovery mode: hot where its workers form generations (a plain torchrun run
        has no spec to say so), else its spec's."""
        if self.generation is not None or self.spec is None:
            return RecoveryMode.HOT if self.generation is not None else RecoveryMode.RESTART
        return self.spec.options.recovery

    @property
    def round(self) -> int | None:
        if self.generation is not None:
            return self.generation.number
        rounds = [m.get("round") for m in self.members.values() if m.get("state") == MemberState.TRAINING]
        return max(rounds) if rounds else None

    def _generation_ranks(self) -> dict[str, int]:
        """Hot recovery: each node's lowest worker rank in the current generation."""
        ranks: dict[str, int] = {}
        for rank, worker in enumerate(self.generation.members if self.generation else ()):
            ranks.setdefault(worker.rsplit(".", 1)[0], rank)
        return ranks

    @property
    def world_size(self) -> int:
        if self.generation is not None:
            return len(self._generation_ranks())
        current = self.round
        return len([m for m in self.members.values() if m.get("round") == current and m.get("state") == MemberState.TRAINING])

    def spares(self) -> list[str]:
        """Live nodes waiting beside a full world (hot spares): see :func:`spare_nodes`."""
        if self.spec is None:
            return []
        return spare_nodes(self.spec.max_nodes, self.nodes, self.members, self.generation)

    def spares_expected(self) -> int:
        return spares_expected(self.spec)

    def to_dict(self) -> dict:
        ranks = self._generation_ranks()
        spares = set(self.spares())
        return {
            "job": self.name,
            "spec": None if self.spec is None else self.spec.to_dict(),
            "round": self.round,
            "world_size": self.world_size,
            "nodes": [
                {**record, **{k: v for k, v in self.members.get(node, {}).items() if k in ("round", "rank", "restarts")},
                 **({"round": self.generation.number, "rank": ranks[node]} if node in ranks else {}),
                 "id": node, "rendezvous": "spare" if node in spares
                 else self.members.get(node, {}).get("state", MemberState.JOINING.value)}
                for node, record in sorted(self.nodes.items())
            ],
            "spares": sorted(spares),
            "spares_expected": self.spares_expected(),
            "progress": self.progress,
            "down_requested": self.down_requested,
            "recovery": self.recovery.value,
        }


class Registry:
    """Reads and writes one job's records."""

    def __init__(self, client: EtcdClient, job: str, key_prefix: str = DEFAULT_KEY_PREFIX) -> None:
        validate_name(job, "job name")  # a '/' would reach into another job's keys
        self.client = client
        self.job = job
        self.key_prefix = key_prefix
        self.keys = JobKeys(job, key_prefix)

    # -- spec --------------------------------------------------------------------------

    def read_spec(self) -> JobSpec | None:
        kv = self.client.get(self.keys.spec)
        return None if kv is None else JobSpec.from_dict(json_object(kv.value))

    def run_identity(self) -> str | None:
        """This run of the job: its spec's create revision (a new one after `down` and `up`), or
        None without a spec. Records signed with the job secret are bound to it."""
        kv = self.client.get(self.keys.spec)
        return None if kv is None or not kv.create_revision else f"r{kv.create_revision}"

    def publish_spec(self, spec: JobSpec) -> bool:
        """Publish ``spec``; True if it was new, False if an identical one was there.

        A different spec of a job that still has live nodes is an error; one whose
        nodes are all gone belongs to a finished run, whose keys are cleared first.
        """
        key = self.keys.spec
        for _ in range(3):
            ok, current, _ = self.client.compare_and_swap(key, record_json(spec.to_dict()), 0)
            if ok:
                return True
            existing = JobSpec.from_dict(json_object(current.value)) if current else None
            finished = self._rendezvous_closed()
            if existing == spec and not finished:
                return False
            if self.live_nodes():
                if finished:
                    raise ConfigError(
                        f"The job '{spec.name}' has finished and its last nodes are still stopping; "
                        "run it again in a few seconds."
                    )
                raise ConfigError(
                    f"The job '{spec.name}' is already running with a different spec "
                    f"({existing.describe_difference(spec) if existing else 'unreadable'}); "
                    f"use another --job, or stop it first with 'elasticctl down --job {spec.name}'."
                )
            log.info("clearing the finished run of job %s", spec.name)
            self.client.delete_prefix(self.keys.everything)
        raise ElasticctlError(f"Could not publish the spec of job '{spec.name}': it kept changing under us.")

    def _rendezvous_closed(self) -> bool:
        # torch closes the rendezvous when a job finishes; a new run needs a fresh one.
        return self.client.get(self.keys.finished) is not None

    # -- nodes -------------------------------------------------------------------------

    def register_node(self, record: dict, lease: int, wanted_id: str | None = None) -> str:
        """Claim a node id (``wanted_id``, else the host name, suffixed while taken)."""
        base = validate_name(wanted_id, "node id") if wanted_id else _host_node_id()
        for attempt in range(1, 1000):
            node = base if attempt == 1 else f"{base}-{attempt}"
            ok, _, _ = self.client.compare_and_swap(
                self.keys.node(node), record_json({**record, "id": node}), 0, lease=lease
            )
            if ok:
                return node
            if wanted_id:
                raise ConfigError(f"The node id '{wanted_id}' is already taken in job '{self.job}'.")
        raise ElasticctlError(f"No free node id for '{base}' in job '{self.job}'.")

    def update_node(self, node: str, record: dict, lease: int) -> None:
        self.client.put(self.keys.node(node), record_json({**record, "id": node}), lease=lease)

    def live_nodes(self) -> dict[str, dict]:
        return self._records(self.keys.nodes, NODE_FIELDS)

    def members(self) -> dict[str, dict]:
        return self._records(self.keys.members, MEMBER_FIELDS)

    def _records(self, start: str, fields: dict) -> dict[str, dict]:
        return {name_under(start, kv.key): typed_record(kv.value, fields)
                for kv in self.client.get_prefix(start)}

    def write_member(self, node: str, record: dict, lease: int) -> None:
        """The record of ``node``'s torchrun agent (``members/<node>``), bound to ``lease``."""
        self.client.put(self.keys.member(node), record_json(record), lease=lease)

    # -- requests ----------------------------------------------------------------------

    @classmethod
    def from_environment(cls, environment) -> Registry | None:
        """The registry of a worker's job (``environment``: its decoded
        :class:`~elasticctl.job.environment.WorkerEnvironment`), or None outside elasticctl."""
        settings = environment.etcd_settings(retry_timeout=5.0)
        return None if settings is None else cls(EtcdClient(settings), environment.job, environment.key_prefix)

    def request_leave(self, node: str) -> None:
        validate_name(node, "node id")
        self.client.put(self.keys.control_for(node), "leave")

    def request_down(self) -> None:
        self.client.put(self.keys.control_for(JOB_CONTROL), "down")

    def requested(self, node: str) -> str | None:
        """'down' for the whole job, 'leave' for this node, else None."""
        start = self.keys.control
        return request_for({name_under(start, kv.key): kv.value
                            for kv in self.client.get_prefix(start)}, node)

    def watch_requests(self, on_controls) -> WatchedKeys:
        """Follow the requests (started): ``on_controls`` gets every name under ``control/`` and
        its value, at once and after each change (:func:`request_for` reads them for a node)."""
        return WatchedKeys(self.client, self.keys.control, on_controls).start()

    def clear_request(self, node: str) -> None:
        self.client.delete(self.keys.control_for(node))

    def delete_job(self) -> int:
        """Delete the job's keys but its event history (which expires with its own lease)."""
        root, deleted = self.keys.everything, 0
        children = set()
        for kv in self.client.get_prefix(root):
            name, slash, _ = name_under(root, kv.key).partition("/")
            children.add(name + slash)
        for child in sorted(children - {name_under(root, self.keys.history)}):
            if child.endswith("/"):
                deleted += self.client.delete_prefix(root + child)
            else:
                deleted += int(self.client.delete(root + child))
        return deleted

    # -- checkpoint marker ---------------------------------------------------------------

    def claim_checkpoint_marker(self, token: str) -> tuple[bool, str | None]:
        """Store ``token`` as the job's checkpoint marker unless one is there.

        Returns (True, token) when this call stored it, else (False, the marker in etcd).
        """
        ok, current, _ = self.client.compare_and_swap(self.keys.checkpoint_marker, token, 0)
        if ok:
            return True, token
        return False, None if current is None else current.value.decode(errors="replace")

    def checkpoint_marker(self) -> str | None:
        """The job's checkpoint marker in etcd, if one was claimed (read only: ``doctor``)."""
        kv = self.client.get(self.keys.checkpoint_marker)
        return None if kv is None else kv.value.decode(errors="replace")

    def release_checkpoint_marker(self, token: str) -> None:
        """Take back the marker ``token`` this process claimed (for an `up` that did not run)."""
        kv = self.client.get(self.keys.checkpoint_marker)
        if kv is not None and kv.value == token.encode():
            self.client.delete(self.keys.checkpoint_marker)

    # -- progress ----------------------------------------------------------------------

    # -- the rounds' failures, the end, the agents' stores ---------------------------------

    def record_failure(self, round_number: int, node: str, lease: int) -> None:
        """``node``'s workers failed in round ``round_number``; bound to its member lease, so a
        node cut off from etcd cannot leave a failure behind it (the verdicts rely on that)."""
        self.client.put(self.keys.failure(round_number, node), record_json({"time": now()}), lease=lease)

    def failures_of_round(self, round_number: int) -> list[str]:
        """The nodes that recorded a failure in round ``round_number``, in the order they did."""
        prefix = self.keys.failures(round_number)
        return [name_under(prefix, kv.key)
                for kv in sorted(self.client.get_prefix(prefix), key=lambda kv: kv.mod_revision)]

    def record_finished(self, node: str, lease: int) -> None:
        """``node``'s workers all succeeded: the job is done (a new `up` starts a fresh run)."""
        self.client.put(self.keys.finished, record_json({"node": node, "time": now()}), lease=lease)

    def delete_round_store(self, round_number: int) -> int:
        """Delete the agents' c10d store of round ``round_number``; how many keys went."""
        return self.client.delete_prefix(self.keys.store(round_number))

    # -- progress ----------------------------------------------------------------------

    def progress(self) -> dict | None:
        kv = self.client.get(self.keys.progress)
        return None if kv is None else typed_record(kv.value, PROGRESS_FIELDS)

    def generation(self) -> Round | None:
        """The workers' current generation of a hot-recovery job, if there is one (shown, not
        trusted: a signature is not checked here)."""
        key = self.keys.generations().rdzv_round
        kv = self.client.get(key)
        return None if kv is None else Round.from_json(kv.value, kv.mod_revision, key)

    def view(self) -> JobView:
        return JobView.of(self.snapshot(Part.STATUS))

    def snapshot(self, parts: Part = Part.NONE, timed=_untimed) -> JobSnapshot:
        """One read of the job for a reader: nodes, members, progress and ``parts``.

        ``timed(request, call)`` makes each etcd request (``"range"`` or ``"lease"``): the
        dashboard times them for its metrics.
        """
        def by_node(prefix: str):
            kvs = timed("range", lambda: self.client.get_prefix(prefix))
            return {name_under(prefix, kv.key): kv for kv in kvs}

        spec = timed("range", self.read_spec) if Part.SPEC in parts else None
        nodes, members = by_node(self.keys.nodes), by_node(self.keys.members)
        heartbeats = {}
        if Part.HEARTBEATS in parts:
            for node, kv in sorted(nodes.items())[:MAX_HEARTBEAT_LOOKUPS]:
                if kv.lease:
                    remaining, granted = timed("lease", lambda lease=kv.lease: self.client.lease_ttl(lease))
                    if remaining >= 0:  # the lease's keep-alive resets it to its granted TTL
                        heartbeats[node] = float(granted - remaining)
        progress = timed("range", lambda: self.client.get(self.keys.progress))
        history = Part.HISTORY in parts
        return JobSnapshot(
            job=self.job,
            nodes={node: kv.value for node, kv in nodes.items()},
            node_leases={node: kv.lease for node, kv in nodes.items()},
            members={node: kv.value for node, kv in members.items()},
            progress=None if progress is None else progress.value,
            spec=spec,
            down_requested=Part.REQUESTS in parts and timed("range", lambda: self.requested("")) == "down",
            generation=timed("range", self.generation) if Part.GENERATION in parts else None,
            heartbeats=heartbeats,
            events=[kv.value for kv in timed("range", lambda: self.client.get_prefix(self.keys.events))]
            if history else [],
            samples=[kv.value for kv in timed("range", lambda: self.client.get_prefix(self.keys.progress_samples))]
            if history else [],
            counters=[kv.value for kv in timed("range", lambda: self.client.get_prefix(self.keys.counters))]
            if history else [],
        )

    def withdraw_spec(self, spec: JobSpec) -> bool:
        """Delete the spec this process published, for an `up` that failed before its node ran.

        Only while the spec is still ``spec`` and the only key of the job (no node record,
        no rendezvous, no progress: nothing else uses it). True if it was deleted. A node
        that registers between the check and the delete loses the spec it has already
        read: a window of one etcd round trip, and only after a failed `up`.
        """
        key = self.keys.spec
        if self.client.count_prefix(self.keys.everything) != 1:
            return False
        kv = self.client.get(key)
        if kv is None or JobSpec.from_dict(json_object(kv.value)) != spec:
            return False
        return bool(self.client.delete(key))


def request_for(controls: dict[str, bytes], node: str) -> str | None:
    """What the keys under ``control/`` (by name) ask of ``node``: 'down', 'leave' or None."""
    if controls.get(JOB_CONTROL) == b"down":
        return "down"
    return "leave" if controls.get(node) == b"leave" else None


def job_has_keys(client: EtcdClient, keys: JobKeys) -> bool:
    """Whether the job has any key in etcd: it runs, or its history outlived its `down`."""
    return client.count_prefix(keys.everything) > 0


def list_jobs(client: EtcdClient, key_prefix: str = DEFAULT_KEY_PREFIX) -> dict[str, int]:
    """Jobs with a published spec, and how many live nodes each has."""
    root = jobs_root(key_prefix)
    specs: set[str] = set()
    nodes: dict[str, int] = {}
    for kv in client.get_prefix(root):
        key = kv.key.decode(errors="replace")
        job = job_of(key, key_prefix)
        keys = JobKeys(job, key_prefix)
        if key == keys.spec:
            specs.add(job)
        elif key.startswith(keys.nodes) and "/" not in keys.node_of(key):
            nodes[job] = nodes.get(job, 0) + 1
    return {job: nodes.get(job, 0) for job in sorted(specs)}


def shown_jobs(keys: Iterable[bytes | str], key_prefix: str = DEFAULT_KEY_PREFIX) -> list[str]:
    """The jobs the dashboard shows, from the keys under :func:`jobs_root`: those with a spec (a
    run) or a history (a run that is down keeps it for an hour), by name. A key under a name
    that no job can have (planted) names no job."""
    shown = set()
    for key in keys:
        job = job_of(key, key_prefix)
        try:
            validate_name(job, "job name")
        except ConfigError:
            continue
        job_keys = JobKeys(job, key_prefix)
        text = key.decode(errors="replace") if isinstance(key, bytes) else key
        if text == job_keys.spec or text.startswith(job_keys.history):
            shown.add(job)
    return sorted(shown)


def jobs_to_show(client: EtcdClient, key_prefix: str = DEFAULT_KEY_PREFIX) -> list[str]:
    """:func:`shown_jobs` of what etcd holds now (one read of the keys alone)."""
    return shown_jobs(client.keys_prefix(jobs_root(key_prefix)), key_prefix)


def resolve_job(client: EtcdClient, job: str | None, key_prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The job named, or the only job in etcd when none is named."""
    jobs = list_jobs(client, key_prefix)
    if job is not None:
        if job not in jobs:
            known = ", ".join(jobs) or "none"
            raise ConfigError(f"The job '{job}' does not exist in etcd (jobs: {known}).")
        return job
    if len(jobs) == 1:
        return next(iter(jobs))
    if not jobs:
        raise ConfigError("There is no job in etcd; start one with 'elasticctl up'.")
    raise ConfigError(f"There are {len(jobs)} jobs in etcd ({', '.join(jobs)}); name one with --job.")


def read_probe(client: EtcdClient, key_prefix: str = DEFAULT_KEY_PREFIX) -> None:
    """One read of a key nothing writes: what ``doctor`` times when there is no job to read."""
    client.get(probe_key(key_prefix))


def _host_node_id() -> str:
    """The host name as a node id: its first label, with characters ids may not hold replaced."""
    label = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname().split(".")[0])[:50].lstrip("-_.")
    return label or "node"


def now() -> float:
    return round(time.time(), 3)
