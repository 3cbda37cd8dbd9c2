"""The etcd-native rendezvous, decided: records of a round and pure functions over them.

Protocol (keys under ``<prefix>/<run>/rdzv/``; I/O lives in :mod:`elasticctl.rdzv_view`):

* ``nodes/<node>`` — a :class:`Declaration`: "this node wants to be in round ``wants``",
  one put bound to the node's own lease. Liveness is the lease (keep-alives only);
  leaving is deleting the key. A node declares once per round: O(n) writes.
* ``ctl/sealer`` — a :class:`Claim`: the node that seals the next round, bound to its
  lease. Taken by one compare-and-swap when nobody holds it; only the holder needs
  to follow every declaration.
* ``ctl/round`` — the sealed :class:`Round`: its number and members in rank order,
  written (and the claim released) by one transaction on the previous round's
  revision. Every node learns it from a watch.
* ``ctl/closed`` — the job is done; no round is sealed after it.

A round is sealed when enough nodes want it and there is nobody left worth waiting
for (:func:`seal_due`); its members are chosen by :func:`next_members`. Every
function here is pure: the view and the clock come in as arguments.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
from collections.abc import Iterable, Mapping

from elasticctl.registry import json_object
from elasticctl.spec import validate_name


@dataclasses.dataclass(frozen=True)
class Declaration:
    """A live node and the round it wants to join (``nodes/<node>``)."""

    node: str
    addr: str
    wants: int
    pid: int = 0
    port: int = 0  # a free port on this node for the workers' store, should it be rank 0
    revision: int = 0  # etcd's mod_revision of the key: the order of declarations

    def to_json(self, key: str = "", secret: bytes | None = None) -> str:
        return _signed({"node": self.node, "addr": self.addr, "wants": self.wants, "pid": self.pid,
                        "port": self.port}, key, secret)

    @classmethod
    def from_json(cls, raw: bytes, revision: int, key: str = "", secret: bytes | None = None) -> Declaration | None:
        """The declaration in ``raw``, or None if it is malformed or, with a secret, not signed."""
        data = _verified(json_object(raw), key, secret)
        try:
            declaration = cls(node=validate_name(data["node"], "node id"), addr=_text(data["addr"]),
                              wants=_whole(data["wants"]), pid=_whole(data.get("pid", 0)),
                              port=_port(data.get("port", 0)), revision=revision)
        except (KeyError, TypeError, ValueError):
            return None
        return declaration


@dataclasses.dataclass(frozen=True)
class Round:
    """A sealed round: its number and its members, rank = position (``round``)."""

    number: int
    members: tuple[str, ...]
    addrs: tuple[str, ...] = ()
    master_port: int = 0  # rank 0's free port for the workers' store (0: agree on one in the store)
    revision: int = 0  # etcd's mod_revision: the fencing token for sealing the next one

    @property
    def world_size(self) -> int:
        return len(self.members)

    def rank_of(self, node: str) -> int | None:
        return self.members.index(node) if node in self.members else None

    def to_json(self, key: str = "", secret: bytes | None = None) -> str:
        return _signed({"round": self.number, "members": list(self.members), "addrs": list(self.addrs),
                        "master_port": self.master_port}, key, secret)

    @classmethod
    def from_json(cls, raw: bytes, revision: int, key: str = "", secret: bytes | None = None) -> Round | None:
        """The round in ``raw``, or None if it is malformed or, with a secret, not signed."""
        data = _verified(json_object(raw), key, secret)
        try:
            members = tuple(validate_name(m, "node id") for m in data["members"])
            addrs = tuple(_text(a) for a in data.get("addrs", ()))
            if len(set(members)) != len(members) or (addrs and len(addrs) != len(members)):
                return None
            return cls(number=_whole(data["round"]), members=members, addrs=addrs,
                       master_port=_port(data.get("master_port", 0)), revision=revision)
        except (KeyError, TypeError, ValueError):
            return None


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
class Settings:
    min_nodes: int
    max_nodes: int
    last_call: float  # seconds to wait for more nodes once min_nodes want a round


def next_number(current: Round | None) -> int:
    return 1 if current is None else current.number + 1


def wanting(current: Round | None, live: Iterable[Declaration]) -> list[Declaration]:
    """The live nodes that want the next round, in the order they declared."""
    target = next_number(current)
    return sorted((d for d in live if d.wants == target), key=lambda d: d.revision)


def next_members(current: Round | None, candidates: list[Declaration], max_nodes: int) -> tuple[str, ...]:
    """Who is in the next round, rank order: the current round's members keep their order
    (rank 0 stays rank 0 when it can), then newcomers by arrival; at most ``max_nodes``."""
    names = {d.node for d in candidates}
    kept = [m for m in (current.members if current else ()) if m in names]
    newcomers = [d.node for d in candidates if d.node not in kept]
    return tuple((kept + newcomers)[:max_nodes])


def seal_due(current: Round | None, live: list[Declaration], settings: Settings,
             quorum_since: float | None, now: float) -> bool:
    """Whether the next round should be sealed now.

    ``quorum_since``: when this node first saw ``min_nodes`` nodes want the next round.
    Never while only newcomers want it and members of the running round are alive:
    those members re-form with the newcomers as soon as they see them waiting (a round
    of newcomers alone would supersede a training job). Otherwise sealed at once when
    the round is full, or, once a round has run, when every live node wants the next
    one (nobody is left to wait for: the usual re-forming after a failure or a join);
    otherwise after ``last_call`` seconds of quorum, so that nodes still starting up
    make the first round.
    """
    candidates = wanting(current, live)
    if current is not None and not any(d.node in current.members for d in candidates):
        live_names = {d.node for d in live}
        if any(member in live_names for member in current.members):
            return False
    if len(candidates) < settings.min_nodes:
        return False
    if len(candidates) >= settings.max_nodes:
        return True
    if current is not None and len(candidates) == len(live):
        return True
    return quorum_since is not None and now - quorum_since >= settings.last_call


@dataclasses.dataclass(frozen=True)
class Change:
    """Why a member of a round must re-form: counts for torch's ``num_nodes_waiting``."""

    lost: tuple[str, ...] = ()        # members whose key is gone (lease expired, left)
    moved_on: tuple[str, ...] = ()    # members that want a later round (their workers failed)
    waiting: tuple[str, ...] = ()     # newcomers that fit in the next round
    superseded: bool = False          # a later round was sealed without this node

    @property
    def count(self) -> int:
        return len(self.lost) + len(self.moved_on) + len(self.waiting) + int(self.superseded)


def change_for(node: str, my_round: int, current: Round | None, live: Mapping[str, Declaration],
               max_nodes: int) -> Change:
    """What changed for ``node``, a member of round ``my_round``, in the watched view."""
    if current is None or current.number != my_round or node not in current.members:
        return Change(superseded=True)
    lost = tuple(m for m in current.members if m not in live)
    moved_on = tuple(m for m in current.members if m in live and live[m].wants > my_round)
    room = max_nodes - current.world_size
    waiting = tuple(d.node for d in sorted(live.values(), key=lambda d: d.revision)
                    if d.node not in current.members and d.wants > my_round)[:max(0, room)]
    return Change(lost=lost, moved_on=moved_on, waiting=waiting)


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
    if not isinstance(signature, str) or not hmac.compare_digest(signature, _signature(fields, key, secret)):
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
