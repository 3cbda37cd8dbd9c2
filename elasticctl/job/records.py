"""The records a job keeps in etcd: JSON (never pickle), typed, validated when read.

Another process or person can write any of these keys, so every reader treats the
bytes as untrusted: a record that does not parse, has a field of the wrong type, or
(with the job secret) is not signed for its own key reads as absent, never as a
crash. Keys: :mod:`elasticctl.job.keys`.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import json
import math

from elasticctl.errors import ConfigError
from elasticctl.job.spec import validate_name


class MemberState(str, enum.Enum):
    """Where a node's torchrun agent is (``members/<node>``)."""

    JOINING = "joining"          # no record yet: in the rendezvous (shown, never written)
    TRAINING = "training"
    FAILED = "failed"            # stopped (its cause says how), or its agent crashed
    DONE = "done"                # its workers finished the script
    LEFT = "left"                # left gracefully (leave, down, SIGTERM)
    QUARANTINED = "quarantined"  # sitting out a cooldown after repeated own failures


class FailureCause(str, enum.Enum):
    """Why a member record is FAILED (its ``cause``); the ``reason`` beside it is for people."""

    AGENT_CRASHED = "agent_crashed"  # torchrun's agent ended on an exception: its log says why
    STOPPED = "stopped"              # the handler stopped the node (over budget, a finished group, ...)


class NodeState(str, enum.Enum):
    """Where a node's elasticctl process is (``nodes/<node>``)."""

    RUNNING = "running"  # its torchrun runs: the member record says more
    LEAVING = "leaving"  # asked to leave or stop (leave, down)


def record_json(value: object) -> str:
    """A record as compact JSON, keys sorted (the same record, the same bytes)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def json_object(raw: bytes) -> dict:
    """The JSON object in ``raw`` (untrusted), or {} for anything else."""
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


_NUMBER = (int, float)
# The fields of each record kind and their JSON types; anything else read from etcd is
# dropped, so that a malformed or planted record can confuse no reader.
NODE_FIELDS = {"id": str, "host": str, "addr": str, "pid": int, "nproc": int, "gpus": int,
               "joined_at": _NUMBER, "state": str, "torch": str}
MEMBER_FIELDS = {"node": str, "addr": str, "pid": int, "state": str, "round": int, "rank": int,
                 "world_size": int, "restarts": int, "since": _NUMBER, "until": _NUMBER, "reason": str,
                 "cause": str}
PROGRESS_FIELDS = {"step": int, "epoch": int, "loss": _NUMBER, "samples_per_s": _NUMBER, "world_size": int,
                   "last_checkpoint_step": int, "time": _NUMBER, "rank": int,
                   # set while checkpoints fail: the newest failure's sentence, how many in a row
                   "checkpoint_error": str, "checkpoint_failures": int}


def typed_record(raw: bytes, fields: dict[str, type | tuple[type, ...]]) -> dict:
    """The fields of the JSON object in ``raw`` that have their documented type (finite numbers)."""
    record = {}
    for key, value in json_object(raw).items():
        kind = fields.get(key)
        if kind is None or isinstance(value, bool) or not isinstance(value, kind):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            continue
        record[key] = value
    return record


@dataclasses.dataclass(frozen=True)
class Declaration:
    """A live node and the round it wants to join (``nodes/<node>``)."""

    node: str
    addr: str
    wants: int
    pid: int = 0
    port: int = 0  # a free port on this node for the workers' store, should it be rank 0
    # A port the declaring process listens on while it lives (0: none): a connection to it that
    # is refused proves the process gone, long before its lease ends (rendezvous/liveness.py).
    alive_port: int = 0
    revision: int = 0  # etcd's mod_revision of the key: the order of declarations
    # A worker of a sharded job's generations (``<node>.<local rank>``): how many workers its node
    # brings. A round admits such a node whole or not at all (rendezvous/rounds.py: whole_nodes),
    # since an HSDP mesh needs every node's workers. 0: admitted on its own (agents, a DDP job).
    node_workers: int = 0
    # A worker of a job's generations (``<node>.<local rank>``), sharded or not: how many workers its
    # node brings. The generations count MIN and MAX in nodes (rendezvous/rounds.py: counted_by) and
    # call a round full only once every node in it has all of them. 0: not a node's worker (an agent).
    node_size: int = 0

    def to_json(self, key: str = "", secret: bytes | None = None) -> str:
        fields = {"node": self.node, "addr": self.addr, "wants": self.wants, "pid": self.pid,
                  "port": self.port, "alive_port": self.alive_port}
        if self.node_workers:
            fields["node_workers"] = self.node_workers
        if self.node_size:
            fields["node_size"] = self.node_size
        return _signed(fields, key, secret)

    @classmethod
    def from_json(cls, raw: bytes, revision: int, key: str = "", secret: bytes | None = None) -> Declaration | None:
        """The declaration in ``raw``, or None if it is malformed or, with a secret, not signed."""
        data = _verified(json_object(raw), key, secret)
        try:
            declaration = cls(node=validate_name(data["node"], "node id"), addr=_text(data["addr"]),
                              wants=_whole(data["wants"]), pid=_whole(data.get("pid", 0)),
                              port=_port(data.get("port", 0)), alive_port=_port(data.get("alive_port", 0)),
                              revision=revision, node_workers=_node_workers(data.get("node_workers", 0)),
                              node_size=_node_workers(data.get("node_size", 0)))
        except (KeyError, TypeError, ValueError):
            return None
        for workers in (declaration.node_workers, declaration.node_size):
            if workers:
                worker = worker_of(declaration.node)
                if worker is None or worker[1] >= workers:
                    return None  # a node's worker must be named <node>.<local rank below its node's workers>
        return declaration


MAX_NODE_WORKERS = 1024  # workers per node a declaration may claim (torchrun's --nproc-per-node)


def _node_workers(value: object) -> int:
    if _whole(value) > MAX_NODE_WORKERS:
        raise ValueError(value)
    return value


def worker_of(name: str) -> tuple[str, int] | None:
    """The node and local rank in a worker's name ``<node>.<local rank>`` (None: not such a name)."""
    node, _, local = name.rpartition(".")
    if not node or not local.isdigit() or not local.isascii():
        return None
    return node, int(local)


@dataclasses.dataclass(frozen=True)
class Round:
    """A sealed round: its number and its members, rank = position (``round``)."""

    number: int
    members: tuple[str, ...]
    addrs: tuple[str, ...] = ()
    master_port: int = 0  # rank 0's free port for the workers' store (0: agree on one in the store)
    revision: int = 0  # etcd's mod_revision: the fencing token for sealing the next one
    # When it was sealed (the sealer's wall clock). Two different records of one round number
    # can meet only after the record was deleted or forged: the one sealed first is the round
    # its members run, and every node settles on it (see :func:`preferred_round`).
    sealed_at: float | None = None

    @property
    def world_size(self) -> int:
        return len(self.members)

    def same_round(self, other: Round | None) -> bool:
        """Whether ``other`` is this very round (its etcd revision aside: a restored copy is)."""
        return other is not None and dataclasses.replace(other, revision=self.revision) == self

    def rank_of(self, node: str) -> int | None:
        return self.members.index(node) if node in self.members else None

    def to_json(self, key: str = "", secret: bytes | None = None) -> str:
        fields = {"round": self.number, "members": list(self.members), "addrs": list(self.addrs),
                  "master_port": self.master_port}
        if self.sealed_at is not None:
            fields["sealed_at"] = self.sealed_at
        return _signed(fields, key, secret)

    @classmethod
    def from_json(cls, raw: bytes, revision: int, key: str = "", secret: bytes | None = None) -> Round | None:
        """The round in ``raw``, or None if it is malformed or, with a secret, not signed."""
        data = _verified(json_object(raw), key, secret)
        try:
            members = tuple(validate_name(m, "node id") for m in data["members"])
            addrs = tuple(_text(a) for a in data.get("addrs", ()))
            if len(set(members)) != len(members) or (addrs and len(addrs) != len(members)):
                return None
            sealed_at = data.get("sealed_at")
            if sealed_at is not None and not (_finite(sealed_at) and 0 <= sealed_at < 1e11):
                return None
            return cls(number=_whole(data["round"]), members=members, addrs=addrs,
                       master_port=_port(data.get("master_port", 0)), revision=revision,
                       sealed_at=None if sealed_at is None else float(sealed_at))
        except (KeyError, TypeError, ValueError):
            return None


def preferred_round(known: Round | None, candidate: Round | None) -> Round | None:
    """Which of two records of the round key to believe: rounds only go forward, and of two
    different records with one number the one sealed first (a record without a seal time,
    as a forger or an older version writes it, never wins a tie). None only if both are."""
    if candidate is None:
        return known
    if known is None or candidate.number > known.number or known.same_round(candidate):
        return candidate  # a restored copy too: it carries the key's current revision
    if candidate.number < known.number:
        return known
    def order(r: Round) -> tuple:
        return (r.sealed_at is None, r.sealed_at or 0.0, r.members, r.addrs, r.master_port)
    return candidate if order(candidate) < order(known) else known


@dataclasses.dataclass(frozen=True)
class Claim:
    """The node that seals round ``round`` (``ctl/sealer``, bound to that node's lease)."""

    node: str
    round: int

    def to_json(self, key: str = "", secret: bytes | None = None) -> str:
        return _signed({"node": self.node, "round": self.round}, key, secret)

    @classmethod
    def from_json(cls, raw: bytes, key: str = "", secret: bytes | None = None) -> Claim | None:
        """The claim in ``raw``, or None if it is malformed or, with a secret, not signed."""
        data = _verified(json_object(raw), key, secret)
        try:
            return cls(node=validate_name(data["node"], "node id"), round=_whole(data["round"]))
        except (KeyError, TypeError, ValueError):
            return None


@dataclasses.dataclass(frozen=True)
class Reform:
    """Round ``round`` must re-form, and why (``ctl/reform``), written by a member that follows
    the declarations (:func:`elasticctl.rendezvous.rounds.publishes_changes`): what every other
    member of the round reads instead of following each declaration itself.

    ``lost`` is complete (a member's agent reads each lost member's record: lost or finished);
    ``moved_on`` and ``waiting`` name the ones seen when it was written (that there are any is
    what counts: the round re-forms), so that a thousand members re-declaring do not rewrite it.
    """

    round: int
    lost: tuple[str, ...] = ()
    moved_on: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    seen_by: str = ""  # the member that wrote it, for the logs
    revision: int = 0  # etcd's mod_revision of the key: the token for rewriting it

    @property
    def count(self) -> int:
        return len(self.lost) + len(self.moved_on) + len(self.waiting)

    def to_json(self, key: str = "", secret: bytes | None = None) -> str:
        return _signed({"round": self.round, "lost": list(self.lost), "moved_on": list(self.moved_on),
                        "waiting": list(self.waiting), "seen_by": self.seen_by}, key, secret)

    @classmethod
    def from_json(cls, raw: bytes, revision: int, key: str = "", secret: bytes | None = None) -> Reform | None:
        """The record in ``raw``, or None if it is malformed or, with a secret, not signed."""
        data = _verified(json_object(raw), key, secret)
        try:
            names = {field: tuple(validate_name(m, "node id") for m in _names(data.get(field, [])))
                     for field in ("lost", "moved_on", "waiting")}
            seen_by = data.get("seen_by", "")
            return cls(round=_whole(data["round"]), seen_by=validate_name(seen_by, "node id") if seen_by != "" else "",
                       revision=revision, **names)
        except (KeyError, TypeError, ValueError, ConfigError):
            return None


def _names(value: object) -> list:
    if not isinstance(value, list):
        raise ValueError(value)
    return value


class EventKind(str, enum.Enum):
    """What happened (``history/events/...``)."""

    NODE_JOINED = "node_joined"            # an `up`/`join` process registered its node
    NODE_REFUSED = "node_refused"          # an admission check refused a node (it never registered): reason
    NODE_WAITING = "node_waiting"          # a node's agent asks for a round (start, or joining a running job)
    ROUND_FORMED = "round_formed"          # a round was sealed: round, members, world_size, duration
    MEMBER_LOST = "member_lost"            # a member of the previous round is gone without leaving
    WORKERS_FAILED = "workers_failed"      # a node's worker group failed (verdict follows)
    FAILURE_JUDGED = "failure_judged"      # the verdict: charged (a restart spent) or free, and why
    QUARANTINED = "quarantined"            # a node sits out a cooldown after repeated own failures
    OVER_BUDGET = "over_budget"            # a node stops: more failures than --max-restarts
    LEAVE_REQUESTED = "leave_requested"    # a node leaves its round (`elasticctl leave`, SIGTERM)
    DOWN_REQUESTED = "down_requested"      # a node leaves its round because the job goes down
    NODE_LEFT = "node_left"                # an `up`/`join` process ended: reason says how
    RECOVERY_FINISHED = "recovery_finished"  # the first step after a fault or change: duration, step
    CHECKPOINT_WRITTEN = "checkpoint_written"  # a checkpoint was committed: step, duration (the write)
    CHECKPOINT_FAILED = "checkpoint_failed"  # checkpoints started failing (or for a new reason): step, reason
    NO_STEP = "no_step"                    # a worker reached no step boundary for long, or trained none: reason
    JOB_DOWN = "job_down"                  # `elasticctl down` stopped every node
    STRAGGLER = "straggler"                # a node's own step time stays above R x the others': ratio, step
    STRAGGLER_CLEARED = "straggler_cleared"  # a node named a straggler is no longer one: ratio, step
    REPLICA_DIVERGED = "replica_diverged"  # a worker's parameters differ from its replicas' majority: step, reason
    NON_FINITE = "non_finite"  # a step's gradients (or a rank's loss) were not finite: step, the ranks, reason
    SCRIPT_WARNING = "script_warning"      # a worker's script cannot work across nodes (nn.DataParallel): reason


EVENT_REASON_MAX = 2000


@dataclasses.dataclass(frozen=True)
class Event:
    """One entry of a job's event history. ``node`` is "" for the job as a whole."""

    time: float
    kind: EventKind
    node: str = ""
    round: int | None = None
    members: tuple[str, ...] = ()
    world_size: int | None = None
    reason: str = ""
    charged: bool | None = None     # failure_judged: a restart was spent
    duration: float | None = None   # seconds: round_formed, recovery_finished, checkpoint_written
    step: int | None = None         # recovery_finished, checkpoint_written: the training step
    ratio: float | None = None      # straggler: the node's step time over the others' median

    def to_dict(self) -> dict:
        """The fields that are set, as JSON values."""
        data: dict = {"time": self.time, "kind": self.kind.value, "node": self.node}
        if self.round is not None:
            data["round"] = self.round
        if self.members:
            data["members"] = list(self.members)
        for name in ("world_size", "charged", "duration", "step", "ratio"):
            if getattr(self, name) is not None:
                data[name] = getattr(self, name)
        if self.reason:
            data["reason"] = self.reason
        return data

    def to_json(self) -> str:
        return record_json(self.to_dict())

    @classmethod
    def from_json(cls, raw: bytes) -> Event | None:
        """The event in ``raw`` (untrusted), or None if anything in it is malformed."""
        data = json_object(raw)
        try:
            time = data["time"]
            if isinstance(time, bool) or not isinstance(time, _NUMBER) or not 0 <= time < 1e11:
                return None
            node = data.get("node", "")
            members = data.get("members", [])
            reason = data.get("reason", "")
            charged = data.get("charged")
            duration = data.get("duration")
            ratio = data.get("ratio")
            if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, _NUMBER)
                                      or not 0 <= ratio < 1e9):
                return None
            if not isinstance(members, list) or not isinstance(reason, str) or len(reason) > EVENT_REASON_MAX:
                return None
            if charged is not None and not isinstance(charged, bool):
                return None
            if duration is not None and (isinstance(duration, bool) or not isinstance(duration, _NUMBER)
                                         or not 0 <= duration < 1e9):
                return None
            return cls(time=float(time), kind=EventKind(data["kind"]),
                       node="" if node == "" else validate_name(node, "node id"),
                       round=None if data.get("round") is None else _whole(data["round"]),
                       members=tuple(validate_name(m, "node id") for m in members),
                       world_size=None if data.get("world_size") is None else _whole(data["world_size"]),
                       reason=reason, charged=charged,
                       duration=None if duration is None else float(duration),
                       step=None if data.get("step") is None else _whole(data["step"]),
                       ratio=None if ratio is None else float(ratio))
        except (KeyError, TypeError, ValueError, ConfigError):
            return None


@dataclasses.dataclass(frozen=True)
class ProgressSample:
    """Rank 0's progress at one time (``history/progress/<time>``), for curves over time."""

    time: float
    step: int
    loss: float | None = None
    samples_per_s: float | None = None
    world_size: int | None = None

    def to_json(self) -> str:
        return record_json({k: v for k, v in dataclasses.asdict(self).items() if v is not None})

    @classmethod
    def from_json(cls, raw: bytes) -> ProgressSample | None:
        """The sample in ``raw`` (untrusted), or None if its time or step is missing or malformed;
        an optional field of the wrong type or out of range reads as absent."""
        data = json_object(raw)
        time, step = data.get("time"), data.get("step")
        if not _finite(time) or not 0 <= time < 1e11 or not _finite(step, int) or step < 0:
            return None
        loss, rate, world = data.get("loss"), data.get("samples_per_s"), data.get("world_size")
        return cls(time=float(time), step=step, loss=float(loss) if _finite(loss) else None,
                   samples_per_s=float(rate) if _finite(rate) and rate >= 0 else None,
                   world_size=world if _finite(world, int) and world > 0 else None)


def _finite(value: object, kind: type | tuple[type, ...] = _NUMBER) -> bool:
    """A JSON number of ``kind`` (never a bool), finite (an int within 64 bits: float() of a longer
    one can overflow)."""
    if isinstance(value, bool) or not isinstance(value, kind):
        return False
    return math.isfinite(value) if isinstance(value, float) else -(2**63) <= value < 2**63


def run_secret(secret: bytes | None, run: str | None) -> bytes | None:
    """The key that signs one run's records: the job secret bound to the run's identity.

    A record signed in an earlier run of the same job (same name, same secret) then fails
    verification in a later one, so that it cannot be replayed into it. Without ``run`` the
    job secret itself (plain torchrun: the rdzv id is the run's identity, as torch documents).
    """
    if not secret or not run:
        return secret or None
    return hmac.new(secret, b"elasticctl-run\n" + run.encode(), hashlib.sha256).hexdigest().encode()


def _signature(fields: dict, key: str, secret: bytes) -> str:
    # Bound to the key, so that a signed record cannot be moved to another node, round or run.
    message = key.encode() + b"\n" + json.dumps(fields, sort_keys=True).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def _signed(fields: dict, key: str, secret: bytes | None) -> str:
    """A record as JSON, with an HMAC of the job secret over key and fields when there is one."""
    if secret:
        fields = {**fields, "sig": _signature(fields, key, secret)}
    return json.dumps(fields, sort_keys=True)


def _verified(data: dict, key: str, secret: bytes | None) -> dict:
    """``data`` without its signature if the signature holds (or no secret is set), else {}."""
    if not secret:
        return data
    fields = {k: v for k, v in data.items() if k != "sig"}
    signature = data.get("sig")
    # As bytes: compare_digest refuses a str with non-ASCII characters (a planted signature).
    if not isinstance(signature, str) or not hmac.compare_digest(
            signature.encode(), _signature(fields, key, secret).encode()):
        return {}
    return fields


def _whole(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise ValueError(value)
    return value


def _port(value: object) -> int:
    if _whole(value) > 65535:
        raise ValueError(value)
    return value


def _text(value: object) -> str:
    if not isinstance(value, str) or not value or len(value) > 255 or "\n" in value:
        raise ValueError(value)
    return value
