"""What a worker whose script raised tells its node: :class:`WorkerFailure`, and how it is made.

torch's agent learns only that a worker exited non-zero. For the rule that stops a node whose
script fails the same way before its first step (:func:`elasticctl.rendezvous.policy.repeated_failure`),
the worker entry (:mod:`elasticctl.train.entry`) writes the facts as one small JSON mark,
``failure-<LOCAL_RANK>``, beside its other marks, and the rendezvous handler reads it back.

What is read back is not trusted: at most :data:`MAX_BYTES` are read, and a mark that is not a
JSON object with the expected fields, types and bounds is no record at all (:meth:`WorkerFailure.parse`):
the node then keeps its usual restart policy.

The worker's side is pure too: :func:`failure_site` (which frame is the script's own) and
:func:`describe` (the record of an exception).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence

MAX_BYTES = 4096       # the most of a mark the node reads
MAX_TEXT = 300         # the longest message kept (its first line, whitespace collapsed)
MAX_PATH = 1024        # the longest file name kept
MAX_KIND = 200         # the longest exception type name kept


@dataclasses.dataclass(frozen=True)
class WorkerFailure:
    """A script's exception, as the node needs it.

    ``file``/``line``: where it was raised in the script's own code (the innermost frame outside
    Python's library, installed packages and elasticctl). ``in_script``: the script's own doing,
    which a restart of the same script repeats; False for what its peers or the job may have
    caused (a collective with peers, elasticctl's runtime giving up on them). ``trained``: the
    worker had trained a step (or may have: a script that counts its own steps and had joined).
    """

    kind: str
    message: str
    file: str
    line: int
    in_script: bool
    trained: bool

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def parse(cls, text: str) -> WorkerFailure | None:
        """The record in ``text``, or None if it is not one (malformed, oversized, wrong types)."""
        if len(text) > MAX_BYTES:
            return None
        try:
            raw = json.loads(text)
        except ValueError:
            return None
        if not isinstance(raw, dict):
            return None
        kinds = {"kind": str, "message": str, "file": str, "line": int, "in_script": bool, "trained": bool}
        for name, kind in kinds.items():
            value = raw.get(name)
            # bool is an int: a line must be a real number, a flag a real bool
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                return None
        if (not 0 < len(raw["kind"]) <= MAX_KIND or len(raw["message"]) > MAX_TEXT
                or not 0 < len(raw["file"]) <= MAX_PATH or raw["line"] < 0):
            return None
        if not all(value.isprintable() for value in (raw["kind"], raw["message"], raw["file"])):
            return None  # it is printed in the node's one line
        return cls(**{name: raw[name] for name in kinds})


def _under(file: str, directories: Sequence[str]) -> bool:
    return any(file == d or file.startswith(d.rstrip(os.sep) + os.sep) for d in directories if d)


def failure_site(frames: Sequence[tuple[str, int]], library: Sequence[str]) -> tuple[str, int] | None:
    """Where the script's own code raised: the innermost of ``frames`` (file, line; outermost
    first) outside the ``library`` directories and Python's frozen modules; else the innermost
    frame of all (a script run from an installed package); None without frames."""
    own = [(file, line) for file, line in frames if not file.startswith("<") and not _under(file, library)]
    if own:
        return own[-1]
    return frames[-1] if frames else None


def one_line(text: str, limit: int = MAX_TEXT) -> str:
    """``text`` on one printable line of at most ``limit`` characters."""
    flat = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


def peers_involved(innermost: str, *, distributed_error: bool, config_error: bool, distributed_dir: str,
                   package_dir: str) -> bool:
    """Whether a failure may be its peers' or the job's doing rather than the script's own, so that
    its repetition proves nothing: torch's distributed errors (``distributed_error``: a
    ``torch.distributed.DistError``), anything raised inside ``torch.distributed`` (a collective, a
    store, a rendezvous: ``innermost`` is the innermost frame's file), and what elasticctl's own
    code raised (``package_dir``: its runtime giving up on a generation, a peer leaving), except a
    ``ConfigError`` (``config_error``: a value the script passed, which a restart passes again)."""
    if distributed_error or _under(innermost, [distributed_dir]):
        return True
    return _under(innermost, [package_dir]) and not config_error


def describe(kind: str, message: str, frames: Sequence[tuple[str, int]], *, library: Sequence[str],
             peers_involved: bool, trained: bool, syntax_at: tuple[str, int] | None = None) -> WorkerFailure | None:
    """The record of an exception of type ``kind`` raised through ``frames``; None without a place.

    ``peers_involved``: it may be its peers' or the job's doing (the worker entry decides, from
    the exception's type and where it was raised). ``syntax_at``: a SyntaxError's own file and
    line (its frames are the compiler's caller's, not the script's).
    """
    site = syntax_at or failure_site(frames, library)
    if site is None:
        return None
    file, line = site
    return WorkerFailure(kind=one_line(kind, MAX_KIND), message=one_line(message), file=one_line(file, MAX_PATH),
                         line=max(int(line or 0), 0), in_script=not peers_involved, trained=trained)
