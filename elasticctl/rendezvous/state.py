"""torch's rendezvous state as it lies in etcd: a sealed, sequenced envelope, checked before use.

torch unpickles the state it reads, so whoever can write to etcd could run code on
every agent. Before torch sees any bytes, :func:`open_state`:

1. checks the seal: an HMAC-SHA256 when the job has a secret (only holders of the
   secret can write a state), else a SHA-256 checksum (catches corruption only);
2. unpickles the state with an allow-list of exactly the classes torch's state is
   made of, and checks its shape; anything else is refused, secret or not.

The sealed part carries a sequence number that every write increments, so a node
can tell a replayed or rolled-back state (a lower sequence than one it has already
seen) from a new one; with a secret the sequence cannot be forged.

Envelope::

    elasticctl-rdzv/2\\n
    <sha256|hmac-sha256>:<hex digest of the rest>\\n
    seq:<n>\\n
    <torch's pickled _RendezvousState>
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import io
import pickle
from typing import NamedTuple

from torch.distributed.elastic.rendezvous import RendezvousStateError

MAGIC = b"elasticctl-rdzv/2\n"
CHECKSUM = b"sha256"
SIGNATURE = b"hmac-sha256"
# A state of 1,000 nodes is ~150 KB; etcd refuses values over 1.5 MiB anyway.
MAX_STATE_BYTES = 1 << 20

_TORCH_MODULE = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
# Exactly what torch's _RendezvousState pickles into (checked with pickletools).
ALLOWED_GLOBALS = frozenset({
    (_TORCH_MODULE, "_RendezvousState"),
    (_TORCH_MODULE, "_NodeDesc"),
    ("datetime", "datetime"),
    ("datetime", "timezone"),
    ("datetime", "timedelta"),
})
_STATE_FIELDS = frozenset({
    "round", "complete", "deadline", "closed", "participants", "wait_list", "redundancy_list",
    "last_heartbeats",
})
_NODE_FIELDS = {"addr": str, "pid": int, "local_id": int}


class OpenedState(NamedTuple):
    seq: int
    state: bytes


def _digest(body: bytes, secret: bytes | None) -> bytes:
    if secret:
        return SIGNATURE + b":" + hmac.new(secret, body, hashlib.sha256).hexdigest().encode()
    return CHECKSUM + b":" + hashlib.sha256(body).hexdigest().encode()


def seal_state(state: bytes, seq: int, secret: bytes | None) -> bytes:
    """Wrap torch's encoded state and its sequence number in a checksum, or an HMAC with a secret."""
    body = b"seq:%d\n" % seq + state
    return MAGIC + _digest(body, secret) + b"\n" + body


def open_state(sealed: bytes, secret: bytes | None, where: str) -> OpenedState:
    """Return the sequence and state inside ``sealed`` once seal, classes and shape check out.

    Raises :class:`RendezvousStateError` naming ``where`` (the key) otherwise.
    """
    if not isinstance(sealed, bytes) or not sealed.startswith(MAGIC):
        raise RendezvousStateError(
            f"The rendezvous state at '{where}' was not written by this version of elasticctl."
        )
    if len(sealed) > MAX_STATE_BYTES:
        raise RendezvousStateError(f"The rendezvous state at '{where}' is too large ({len(sealed)} bytes).")
    tag, newline, body = sealed[len(MAGIC):].partition(b"\n")
    kind = tag.partition(b":")[0]
    if not newline or kind not in (CHECKSUM, SIGNATURE):
        raise RendezvousStateError(f"The rendezvous state at '{where}' has no valid integrity tag.")
    if kind == SIGNATURE and not secret:
        raise RendezvousStateError(
            f"The rendezvous state at '{where}' is signed, but this node has no job secret."
        )
    if kind == CHECKSUM and secret:
        raise RendezvousStateError(
            f"The rendezvous state at '{where}' is not signed, and this node requires a signature."
        )
    if not hmac.compare_digest(tag, _digest(body, secret)):
        raise RendezvousStateError(
            f"The rendezvous state at '{where}' failed its integrity check (altered, or another secret)."
        )
    seq_line, newline, state = body.partition(b"\n")
    seq_text = seq_line[4:] if seq_line.startswith(b"seq:") else b""
    if not newline or not seq_text.isdigit() or len(seq_text) > 19:
        raise RendezvousStateError(f"The rendezvous state at '{where}' has no valid sequence number.")
    check_state(state, where)
    return OpenedState(int(seq_text), state)


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"'{module}.{name}' is not part of a rendezvous state")
        return super().find_class(module, name)


def check_state(state: bytes, where: str) -> None:
    """Refuse ``state`` unless it unpickles, allow-listed classes only, into torch's state shape."""
    try:
        value = _AllowListUnpickler(io.BytesIO(state)).load()
        problem = _shape_problem(value)
    except Exception as exc:  # noqa: BLE001 - any failure of untrusted bytes is one verdict
        problem = f"{type(exc).__name__}: {exc}"[:200]
    if problem:
        raise RendezvousStateError(f"The rendezvous state at '{where}' was refused: {problem}.")


def _shape_problem(value: object) -> str | None:
    """What makes ``value`` not a torch rendezvous state, or None."""
    # Compared by name: the unpickler could only have made these classes from the allow-list.
    def is_a(obj: object, name: str) -> bool:
        return type(obj).__module__ == _TORCH_MODULE and type(obj).__qualname__ == name

    def is_node(node: object) -> bool:
        fields = getattr(node, "__dict__", None)
        return (is_a(node, "_NodeDesc") and isinstance(fields, dict) and set(fields) == set(_NODE_FIELDS)
                and all(type(fields[k]) is t for k, t in _NODE_FIELDS.items()))

    def is_time(moment: object) -> bool:
        return type(moment) is datetime.datetime

    if not is_a(value, "_RendezvousState"):
        return f"it is a {type(value).__name__}, not a rendezvous state"
    fields = vars(value)
    if set(fields) != _STATE_FIELDS:
        return f"its fields are {sorted(fields)}"
    if type(fields["round"]) is not int or fields["round"] < 0:
        return "its round is not a whole number"
    if type(fields["complete"]) is not bool or type(fields["closed"]) is not bool:
        return "its complete/closed flags are not booleans"
    if fields["deadline"] is not None and not is_time(fields["deadline"]):
        return "its deadline is not a time"
    participants = fields["participants"]
    if type(participants) is not dict or not all(
            is_node(node) and type(rank) is int and rank >= 0 for node, rank in participants.items()):
        return "its participants are not nodes with ranks"
    for name in ("wait_list", "redundancy_list"):
        if type(fields[name]) is not set or not all(is_node(node) for node in fields[name]):
            return f"its {name} is not a set of nodes"
    heartbeats = fields["last_heartbeats"]
    if type(heartbeats) is not dict or not all(is_node(n) and is_time(t) for n, t in heartbeats.items()):
        return "its heartbeats are not nodes with times"
    return None
