"""The rendezvous options of a job (torchrun's ``--rdzv-conf``), parsed and validated in one place.

The CLI validates a job's options with :func:`parse_rdzv_options` before it launches
anything; the handler inside torchrun parses the same options with the same
function. Imports no torch, so the CLI stays fast.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Callable, Mapping

from elasticctl.errors import ConfigError, quote
from elasticctl.job.keys import DEFAULT_KEY_PREFIX
from elasticctl.numbers import decimal_number, whole_number

log = logging.getLogger(__name__)

DEFAULT_NODE_TTL = 5
# Longer than this, a lost node would hold a job for an hour; etcd's own bound is 9e9 s.
MAX_NODE_TTL = 3600
DEFAULT_RUN_TTL = 7200
MAX_SECONDS = 30 * 24 * 3600

RECOVERY_MODES = ("restart", "hot")

# Options torch's launchers pass, or torch's other backends take, that mean nothing to etcd3:
# accepted and ignored (a debug line), as torch's own handlers ignore each other's options, so
# that code written for c10d or etcd runs unchanged. Where each comes from, in torch's sources:
TORCH_ONLY_OPTIONS = {
    "timeout": "torch's launcher (launcher/api.py LaunchConfig) adds its rendezvous timeout for every backend",
    "rank": "torchrun (run.py) passes --node-rank for the static backend",
    "is_host": "the c10d backend's choice of store host (c10d_rendezvous_backend.py)",
    "store_type": "the c10d backend's store kind (c10d_rendezvous_backend.py)",
    "etcd_prefix": "torch's etcd v2 handler's key prefix (etcd_rendezvous.py); etcd3 has key_prefix",
}
DEFAULT_QUARANTINE_AFTER = 2
MAX_STRAGGLER_RATIO = 1000.0
MAX_STRAGGLER_STEPS = 1_000_000

_KEY_PREFIX_RE = re.compile(r"(?:/[A-Za-z0-9_.-]+)+")


@dataclasses.dataclass(frozen=True)
class RdzvOptions:
    """Every ``--rdzv-conf`` option of the ``etcd3`` rendezvous, with its default."""

    # How to reach etcd (aliases: torch's etcd-v2 names ca_cert, ssl_cert, ssl_cert_key).
    protocol: str | None = None
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    read_timeout: float = 5.0
    retry_timeout: float = 30.0
    connect_timeout: float = 10.0
    # Where the run's keys live, and how long an abandoned run's keys survive.
    key_prefix: str = DEFAULT_KEY_PREFIX
    ttl: int = DEFAULT_RUN_TTL
    secret: str | None = dataclasses.field(default=None, repr=False)
    # The run's identity: signed records of another run of the same job are refused.
    # `elasticctl up`/`join` set it (the job spec's etcd create revision).
    run: str | None = None
    # Liveness, restart budget, quarantine.
    node_ttl: int = DEFAULT_NODE_TTL
    max_restarts: int | None = None
    quarantine_after: int | None = None  # None: DEFAULT_QUARANTINE_AFTER where quarantine applies
    quarantine_window: float = 600.0
    quarantine_seconds: float = 60.0
    # torch's dynamic rendezvous timing.
    join_timeout: int | None = None
    last_call_timeout: int | None = None
    close_timeout: int | None = None
    heartbeat_timeout: int | None = None
    keep_alive_interval: int = 5
    keep_alive_max_attempt: int = 3
    # restart: a membership change restarts every worker; hot: workers re-form in process
    # (scripts on elasticctl.train; others behave as in restart mode).
    recovery: str = "restart"
    # Stragglers (elasticctl.train.stragglers): a node slow (above straggler_ratio x the others'
    # median) at more than half of its newest straggler_window steps, and at straggler_window of
    # its newest 2 x straggler_window, is named; with evict_stragglers R (0: never) the slowest
    # the same rule names at R is asked to leave.
    straggler_ratio: float = 1.5
    straggler_window: int = 50
    straggler_interval: int = 10
    evict_stragglers: float = 0.0
    # Hot spares: nodes beyond --nnodes MAX wait warm (workers started, no share of the data) and
    # take a lost member's place at the survivors' re-formation. This says how many the job
    # expects (status and the dashboard show the count and the shortfall); any node beyond MAX
    # is a spare, counted or not.
    spares: int = 0


# The rendezvous options that `elasticctl up` also takes as flags of their own: an error names both.
_OPTIONS_WITH_FLAGS = frozenset({"straggler_ratio", "straggler_window", "straggler_interval",
                                 "evict_stragglers", "spares"})


def _named(name: str) -> str:
    """How an error names the option ``name``: ``spares (--spares)`` where `up` has a flag for it."""
    return f"{name} (--{name.replace('_', '-')})" if name in _OPTIONS_WITH_FLAGS else name


def _seconds(name: str, text: str) -> float:
    value = decimal_number(text)
    if value is None or not 0 < value <= MAX_SECONDS:
        raise ConfigError(
            f"The rendezvous option {_named(name)} ({quote(text)}) must be a positive number of seconds "
            f"up to {MAX_SECONDS}."
        )
    return value


def _whole(minimum: int, maximum: int, what: str = "whole number") -> Callable[[str, str], int]:
    def parse(name: str, text: str) -> int:
        value = whole_number(text)
        if value is None or not minimum <= value <= maximum:
            raise ConfigError(
                f"The rendezvous option {_named(name)} ({quote(text)}) must be a {what} "
                f"from {minimum} to {maximum}."
            )
        return value

    return parse


def _ratio(allow_zero: bool) -> Callable[[str, str], float]:
    def parse(name: str, text: str) -> float:
        value = decimal_number(text)
        if value is None or not (1 < value <= MAX_STRAGGLER_RATIO or (allow_zero and value == 0)):
            raise ConfigError(
                f"The rendezvous option {_named(name)} ({quote(text)}) must be a ratio above 1 and up to "
                f"{MAX_STRAGGLER_RATIO:g}{' (0: never)' if allow_zero else ''}."
            )
        return value

    return parse


_steps = _whole(1, MAX_STRAGGLER_STEPS, what="whole number of steps")


def _protocol(name: str, text: str) -> str:
    if text.lower() not in ("http", "https"):
        raise ConfigError(f"The rendezvous option {name} ({quote(text)}) must be http or https.")
    return text.lower()


def parse_key_prefix(what: str, text: str) -> str:
    """``text`` as a key prefix (no trailing '/'), else a ConfigError naming ``what`` and it."""
    # A prefix is a path of plain segments: no '..', no empty segment, nothing a run id
    # could escape into another job's keys with.
    if not _KEY_PREFIX_RE.fullmatch(text) or "/../" in f"{text}/" or "/./" in f"{text}/":
        raise ConfigError(
            f"The {what} ({text!r}) must be an absolute key path of "
            "letters, digits, '.', '_' and '-' segments, such as /elasticctl/jobs."
        )
    return text.rstrip("/")


def _key_prefix(name: str, text: str) -> str:
    return parse_key_prefix(f"rendezvous option {name}", text)


def _recovery(name: str, text: str) -> str:
    if text.lower() not in RECOVERY_MODES:
        raise ConfigError(f"The rendezvous option {name} ({quote(text)}) must be one of: "
                          f"{', '.join(RECOVERY_MODES)}.")
    return text.lower()


def _text(name: str, text: str) -> str:
    if not text or "\n" in text:
        raise ConfigError(f"The rendezvous option {name} must be a non-empty single line.")
    return text


# option name -> (field, parser); several names may map onto one field.
_OPTIONS: dict[str, tuple[str, Callable[[str, str], object]]] = {
    "protocol": ("protocol", _protocol),
    "cacert": ("cacert", _text),
    "ca_cert": ("cacert", _text),
    "cert": ("cert", _text),
    "ssl_cert": ("cert", _text),
    "key": ("key", _text),
    "ssl_cert_key": ("key", _text),
    "user": ("user", _text),
    "password": ("password", _text),
    "read_timeout": ("read_timeout", _seconds),
    "retry_timeout": ("retry_timeout", _seconds),
    "connect_timeout": ("connect_timeout", _seconds),
    "key_prefix": ("key_prefix", _key_prefix),
    "ttl": ("ttl", _whole(2, MAX_SECONDS)),
    "secret": ("secret", _text),
    "run": ("run", _text),
    "node_ttl": ("node_ttl", _whole(2, MAX_NODE_TTL)),
    "max_restarts": ("max_restarts", _whole(0, 1_000_000)),
    "quarantine_after": ("quarantine_after", _whole(1, 1_000_000)),
    "quarantine_window": ("quarantine_window", _seconds),
    "quarantine_seconds": ("quarantine_seconds", _seconds),
    "join_timeout": ("join_timeout", _whole(1, MAX_SECONDS)),
    "last_call_timeout": ("last_call_timeout", _whole(1, MAX_SECONDS)),
    "close_timeout": ("close_timeout", _whole(1, MAX_SECONDS)),
    "heartbeat_timeout": ("heartbeat_timeout", _whole(1, MAX_SECONDS)),
    "keep_alive_interval": ("keep_alive_interval", _whole(1, MAX_SECONDS)),
    "keep_alive_max_attempt": ("keep_alive_max_attempt", _whole(1, 1_000_000)),
    "recovery": ("recovery", _recovery),
    "straggler_ratio": ("straggler_ratio", _ratio(allow_zero=False)),
    "straggler_window": ("straggler_window", _steps),
    "straggler_interval": ("straggler_interval", _steps),
    "evict_stragglers": ("evict_stragglers", _ratio(allow_zero=True)),
    "spares": ("spares", _whole(0, 1_000_000)),
}

KNOWN_OPTIONS = frozenset(_OPTIONS)


def parse_rdzv_options(conf: Mapping[str, object]) -> RdzvOptions:
    """Validate ``conf`` (``--rdzv-conf`` as a mapping) into :class:`RdzvOptions`.

    Raises :class:`ConfigError` (a ``ValueError``) naming the first bad key or value.
    Empty values mean "the default", as torch treats them.
    """
    values: dict[str, object] = {}
    for raw_key, raw_value in conf.items():
        key = str(raw_key)
        if key in TORCH_ONLY_OPTIONS:
            log.debug("Ignoring the rendezvous option %s=%r: %s.", key, raw_value, TORCH_ONLY_OPTIONS[key])
            continue
        if key not in _OPTIONS:
            raise ConfigError(
                f"The rendezvous option {quote(key)} is unknown; known options: "
                f"{', '.join(sorted(_OPTIONS))}."
            )
        text = "" if raw_value is None else str(raw_value).strip()
        if not text:
            continue
        field, parse = _OPTIONS[key]
        values[field] = parse(key, text)
    options = RdzvOptions(**values)
    if (options.cert is None) != (options.key is None):
        raise ConfigError("The rendezvous options cert and key must be given together.")
    if options.straggler_interval > options.straggler_window:
        raise ConfigError(f"The straggler interval ({options.straggler_interval} steps) must not be above "
                          f"the straggler window ({options.straggler_window} steps).")
    return options


def _numbers_in(settings: type, text: str, what: str, where: str, where_when_not_a_number: bool = True) -> dict:
    """The ``name=value,...`` pairs of ``text`` as the numbers (int or float) the fields of the
    dataclass ``settings`` are; a ConfigError naming the ``what`` that is unknown or not a number
    (and ``where`` the text came from; the hot settings' sentence for a bad number omits it)."""
    types = {field.name: field.type for field in dataclasses.fields(settings)}
    values: dict[str, object] = {}
    for item in text.split(","):
        name, _, raw = item.partition("=")
        name = name.strip()
        if name not in types:
            raise ConfigError(f"The {what} {name!r} in {where} is unknown.")
        value = whole_number(raw) if types[name] in ("int", int) else decimal_number(raw)
        if value is None:
            source = f" in {where}" if where_when_not_a_number else ""
            raise ConfigError(f"The {what} {name} ({raw!r}){source} is not a number.")
        values[name] = value
    return values


@dataclasses.dataclass(frozen=True)
class HotSettings:
    """What the workers of a hot-recovery job need to form their generations
    (written by the node's rendezvous handler for its workers, read by :mod:`elasticctl.train`:
    see :mod:`elasticctl.job.environment`). Counts are nodes, as in ``--nnodes``."""

    min_nodes: int
    max_nodes: int
    node_ttl: int = DEFAULT_NODE_TTL
    last_call: float = 1.0          # the first generation: wait for workers still starting
    reform_last_call: float = 0.5   # later ones: a live worker re-declares within ms of a fault
    join_timeout: float = 600.0
    run_ttl: int = DEFAULT_RUN_TTL  # the run lease's ttl (job/run_lease.py), which workers renew too

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ConfigError(f"The hot-recovery node counts ({self.min_nodes}:{self.max_nodes}) "
                              "must be 1 or more, the minimum not above the maximum.")
        for name in ("node_ttl", "last_call", "reform_last_call", "join_timeout", "run_ttl"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
                raise ConfigError(f"The hot-recovery setting {name} ({value!r}) must be a positive "
                                  f"number of seconds up to {MAX_SECONDS}.")

    def encode(self) -> str:
        return ",".join(f"{field.name}={getattr(self, field.name)}" for field in dataclasses.fields(self))

    @classmethod
    def decode(cls, text: str, where: str = "the hot-recovery settings") -> HotSettings:
        """The settings in ``text`` (``name=value,...``); a ConfigError naming what is wrong
        (``where``: what carried them)."""
        values = _numbers_in(cls, text, "hot-recovery setting", where, where_when_not_a_number=False)
        try:
            return cls(**values)
        except TypeError:
            raise ConfigError(f"The hot-recovery settings ({text!r}) miss min_nodes or max_nodes.") from None


@dataclasses.dataclass(frozen=True)
class StragglerSettings:
    """How the workers of a job watch for stragglers (written by the node's rendezvous handler
    for its workers from the rendezvous options, read by :mod:`elasticctl.train.stragglers`):
    every ``interval`` steps the workers exchange their step times; a node slower than
    ``ratio`` x the others' median for ``window`` steps is named, and with ``evict`` (a ratio;
    0: never) one slower than ``evict`` x for as long is asked to leave, unless fewer than
    ``min_nodes`` would be left."""

    ratio: float = 1.5
    window: int = 50
    interval: int = 10
    evict: float = 0.0
    min_nodes: int = 1

    def __post_init__(self) -> None:
        for name, allow_zero in (("ratio", False), ("evict", True)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and (1 < value <= MAX_STRAGGLER_RATIO or (allow_zero and value == 0))):
                raise ConfigError(f"The straggler setting {name} ({value!r}) must be a ratio above 1 and up to "
                                  f"{MAX_STRAGGLER_RATIO:g}{' (0: never)' if allow_zero else ''}.")
        for name in ("window", "interval", "min_nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_STRAGGLER_STEPS:
                raise ConfigError(f"The straggler setting {name} ({value!r}) must be a whole number "
                                  f"from 1 to {MAX_STRAGGLER_STEPS}.")
        if self.interval > self.window:
            raise ConfigError(f"The straggler interval ({self.interval} steps) must not be above "
                              f"the window ({self.window} steps).")

    @classmethod
    def of(cls, options: RdzvOptions, min_nodes: int) -> StragglerSettings:
        return cls(ratio=options.straggler_ratio, window=options.straggler_window,
                   interval=options.straggler_interval, evict=options.evict_stragglers, min_nodes=min_nodes)

    def encode(self) -> str:
        return ",".join(f"{field.name}={getattr(self, field.name)}" for field in dataclasses.fields(self))

    @classmethod
    def decode(cls, text: str, where: str = "the straggler settings") -> StragglerSettings:
        """The settings in ``text`` (``name=value,...``); a ConfigError naming what is wrong."""
        return cls(**_numbers_in(cls, text, "straggler setting", where))
