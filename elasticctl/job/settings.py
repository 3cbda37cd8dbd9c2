"""The settings of a job as the code reads them, made from the one table (:mod:`elasticctl.job.options`).

* :class:`RdzvOptions` and :func:`parse_rdzv_options`: a job's rendezvous options (torchrun's
  ``--rdzv-conf``), parsed and validated in one place. The CLI validates a job's options with
  it before it launches anything; the handler inside torchrun parses the same options with it.
* :class:`WorkerSettings`: what a node's rendezvous handler hands its workers (the recovery
  mode, hot recovery's settings, straggler detection's, the replica check's), one typed, versioned JSON document in
  one environment variable (:mod:`elasticctl.job.environment`), decoded and validated once.

Imports no torch, so the CLI stays fast.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping

from elasticctl.errors import ConfigError, quote
from elasticctl.job.keys import DEFAULT_KEY_PREFIX
from elasticctl.job.options import (
    BY_KEY,
    BY_NAME,
    DEFAULT_QUARANTINE_AFTER,
    MAX_COUNT,
    MAX_NODE_TTL,
    MAX_REPLICA_CHECK_STEPS,
    MAX_SECONDS,
    MAX_STRAGGLER_RATIO,
    MAX_STRAGGLER_STEPS,
    OPTIONS,
    REFORM_LAST_CALL,
    TORCH_ONLY_OPTIONS,
    Kind,
    Option,
    RecoveryMode,
    parse_key_prefix,
    shown_value,
)

log = logging.getLogger(__name__)

# Re-exported for their readers: each is declared once, in the table's module.
__all__ = ["DEFAULT_KEY_PREFIX", "DEFAULT_QUARANTINE_AFTER", "MAX_NODE_TTL", "MAX_SECONDS", "MAX_STRAGGLER_RATIO",
           "MAX_STRAGGLER_STEPS", "MAX_REPLICA_CHECK_STEPS", "TORCH_ONLY_OPTIONS", "RecoveryMode", "parse_key_prefix", "RdzvOptions",
           "parse_rdzv_options", "KNOWN_OPTIONS", "HotSettings", "StragglerSettings",
           "ReplicaCheckSettings", "WorkerSettings",
           "DEFAULT_NODE_TTL", "DEFAULT_RUN_TTL", "WORKER_SETTINGS_VERSION"]

DEFAULT_NODE_TTL: int = BY_NAME["node_ttl"].default
DEFAULT_RUN_TTL: int = BY_NAME["ttl"].default

# The type of an option's value, by the kind of its text.
_PYTHON_TYPES = {Kind.SECONDS: float, Kind.WHOLE: int, Kind.STEPS: int, Kind.RATIO: float, Kind.RATIO_OR_ZERO: float,
                 Kind.TEXT: str, Kind.PROTOCOL: str, Kind.KEY_PREFIX: str, Kind.RECOVERY: RecoveryMode}


def _field(option: Option) -> tuple[str, type, dataclasses.Field]:
    kind = _PYTHON_TYPES[option.kind]
    annotation = kind if option.default is not None else kind | None
    return option.name, annotation, dataclasses.field(default=option.default, repr=not option.secret)


# Every ``--rdzv-conf`` option of the ``etcd3`` rendezvous, with its default: one field per row
# of the table, in its order.
RdzvOptions = dataclasses.make_dataclass(
    "RdzvOptions", [_field(option) for option in OPTIONS], frozen=True)
RdzvOptions.__module__ = __name__
RdzvOptions.__doc__ = ("Every ``--rdzv-conf`` option of the ``etcd3`` rendezvous, with its default "
                       "(made from elasticctl.job.options.OPTIONS).")

KNOWN_OPTIONS = frozenset(BY_KEY)


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
        option = BY_KEY.get(key)
        if option is None:
            raise ConfigError(
                f"The rendezvous option {quote(key)} is unknown; known options: "
                f"{', '.join(sorted(BY_KEY))}."
            )
        text = "" if raw_value is None else str(raw_value).strip()
        if not text:
            continue
        values[option.name] = option.parse(key, text)
    options = RdzvOptions(**values)
    if (options.cert is None) != (options.key is None):
        raise ConfigError("The rendezvous options cert and key must be given together.")
    if options.skip_non_finite and not options.check_non_finite:
        raise ConfigError("skip_non_finite 1 (--skip-non-finite) needs the check it acts on: not with "
                          "check_non_finite 0 (--check-non-finite).")
    if options.straggler_interval > options.straggler_window:
        raise ConfigError(f"The straggler interval ({options.straggler_interval} steps) must not be above "
                          f"the straggler window ({options.straggler_window} steps).")
    return options


# Each worker setting that carries an option of the table -> that option: the option's range is
# the setting's (seconds that are whole in --rdzv-conf may be fractions here, as the handler
# hands on float seconds). reform_last_call, a constant (options.REFORM_LAST_CALL), has the
# range of last_call_timeout.
HOT_SETTING_OPTIONS = {"node_ttl": "node_ttl", "last_call": "last_call_timeout", "join_timeout": "join_timeout",
                       "run_ttl": "ttl"}
STRAGGLER_SETTING_OPTIONS = {"ratio": "straggler_ratio", "window": "straggler_window",
                             "interval": "straggler_interval", "evict": "evict_stragglers"}
REPLICA_SETTING_OPTIONS = {"interval": "replica_check", "evict": "evict_diverged"}
_WHOLE_HOT_SETTINGS = ("node_ttl", "run_ttl")


def _check_nodes(what: str, *counts: object) -> None:
    if not all(type(count) is int for count in counts) or not 1 <= counts[0] <= counts[-1] <= MAX_COUNT:
        shown = ":".join(shown_value(count, 20) for count in counts)
        raise ConfigError(f"The {what} ({shown}) must be whole numbers from 1 to {MAX_COUNT}, "
                          "the minimum not above the maximum.")


@dataclasses.dataclass(frozen=True)
class HotSettings:
    """What the workers of a hot-recovery job need to form their generations (the hot section of
    :class:`WorkerSettings`, read by :mod:`elasticctl.train`). Counts are nodes, as in
    ``--nnodes``. The defaults are those of a job `elasticctl up` starts (the table's)."""

    min_nodes: int
    max_nodes: int
    node_ttl: int = BY_NAME["node_ttl"].default
    # The first generation waits for workers still starting; later ones re-form among running workers.
    last_call: float = float(BY_NAME["last_call_timeout"].up_default)
    reform_last_call: float = REFORM_LAST_CALL
    join_timeout: float = float(BY_NAME["join_timeout"].default)
    run_ttl: int = BY_NAME["ttl"].default  # the run lease's ttl (job/run_lease.py), which workers renew too

    def __post_init__(self) -> None:
        _check_nodes("hot-recovery node counts", self.min_nodes, self.max_nodes)
        for name, option in (*HOT_SETTING_OPTIONS.items(), ("reform_last_call", "last_call_timeout")):
            BY_NAME[option].check_number(getattr(self, name), f"The hot-recovery setting {name}",
                                         whole=name in _WHOLE_HOT_SETTINGS)


@dataclasses.dataclass(frozen=True)
class StragglerSettings:
    """How the workers of a job watch for stragglers (the straggler section of
    :class:`WorkerSettings`, read by :mod:`elasticctl.train.watches.stragglers`): every ``interval``
    steps the workers exchange their step times; a node slower than ``ratio`` x the others'
    median for ``window`` steps is named, and with ``evict`` (a ratio; 0: never) one slower than
    ``evict`` x for as long is asked to leave, unless fewer than ``min_nodes`` would be left.
    The defaults are the table's."""

    ratio: float = BY_NAME["straggler_ratio"].default
    window: int = BY_NAME["straggler_window"].default
    interval: int = BY_NAME["straggler_interval"].default
    evict: float = BY_NAME["evict_stragglers"].default
    min_nodes: int = 1

    def __post_init__(self) -> None:
        for name, option in STRAGGLER_SETTING_OPTIONS.items():
            BY_NAME[option].check_number(getattr(self, name), f"The straggler setting {name}")
        _check_nodes("straggler setting min_nodes", self.min_nodes)
        if self.interval > self.window:
            raise ConfigError(f"The straggler interval ({self.interval} steps) must not be above "
                              f"the window ({self.window} steps).")

    @classmethod
    def of(cls, options: RdzvOptions, min_nodes: int) -> StragglerSettings:
        return cls(**{name: getattr(options, option) for name, option in STRAGGLER_SETTING_OPTIONS.items()},
                   min_nodes=min_nodes)


@dataclasses.dataclass(frozen=True)
class ReplicaCheckSettings:
    """How the workers of a job compare their replicas (the replicas section of
    :class:`WorkerSettings`, read by :mod:`elasticctl.train.watches.replica_check`): every ``interval``
    steps (0: never) each worker's parameter checksum goes to every worker; a node whose copy
    differs from its replicas' majority is named, and with ``evict`` (1) asked to leave, unless
    fewer than ``min_nodes`` would be left (as a straggler's eviction). The defaults are the table's."""

    interval: int = BY_NAME["replica_check"].default
    evict: int = BY_NAME["evict_diverged"].default
    min_nodes: int = 1

    def __post_init__(self) -> None:
        for name, option in REPLICA_SETTING_OPTIONS.items():
            BY_NAME[option].check_number(getattr(self, name), f"The replica-check setting {name}")
        _check_nodes("replica-check setting min_nodes", self.min_nodes)

    @classmethod
    def of(cls, options: RdzvOptions, min_nodes: int) -> ReplicaCheckSettings:
        return cls(**{name: getattr(options, option) for name, option in REPLICA_SETTING_OPTIONS.items()},
                   min_nodes=min_nodes)


@dataclasses.dataclass(frozen=True)
class NonFiniteSettings:
    """What the workers of a job do with a step whose gradients are not finite (the non_finite
    section of :class:`WorkerSettings`, read by :mod:`elasticctl.train.watches.non_finite_watch`): name the
    ranks that produced them with ``check`` (1, the default; 0: no check at all), and with ``skip`` (1)
    skip the step on every rank."""

    check: int = BY_NAME["check_non_finite"].default
    skip: int = BY_NAME["skip_non_finite"].default

    def __post_init__(self) -> None:
        BY_NAME["check_non_finite"].check_number(self.check, "The non-finite setting check")
        BY_NAME["skip_non_finite"].check_number(self.skip, "The non-finite setting skip")
        if self.skip and not self.check:
            raise ConfigError("skip_non_finite 1 (--skip-non-finite) needs the check it acts on: not with "
                              "check_non_finite 0 (--check-non-finite).")

    @classmethod
    def of(cls, options: RdzvOptions) -> NonFiniteSettings:
        return cls(check=options.check_non_finite, skip=options.skip_non_finite)


# 2: the replica check's section (a worker of version 1 would refuse it as unknown); 3: non_finite's.
WORKER_SETTINGS_VERSION = 3
# An environment variable is no place for more: a longer one is refused before it is parsed.
_MAX_DOCUMENT = 4096


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    """What a node's rendezvous handler hands each start of its workers, decided from the job's
    rendezvous options (:meth:`of`): the recovery mode, straggler detection's settings (always,
    from the handler; None: no detection), and in hot mode hot recovery's (present exactly then),
    the replica check's (always, from the handler; None: no check).

    Travels as one versioned JSON document (:meth:`to_json`, :meth:`from_json`) in one
    variable (``environment.WORKER_SETTINGS``), decoded and validated once per worker."""

    recovery: RecoveryMode
    stragglers: StragglerSettings | None = None
    hot: HotSettings | None = None
    replicas: ReplicaCheckSettings | None = None
    non_finite: NonFiniteSettings | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.recovery, RecoveryMode):
            raise ConfigError(f"The recovery mode {quote(self.recovery)} of the worker settings "
                              "is no RecoveryMode.")
        if not isinstance(self.stragglers, (StragglerSettings, type(None))):
            raise ConfigError(f"The straggler settings {quote(self.stragglers)} are no StragglerSettings.")
        if not isinstance(self.replicas, (ReplicaCheckSettings, type(None))):
            raise ConfigError(f"The replica-check settings {quote(self.replicas)} are no ReplicaCheckSettings.")
        if not isinstance(self.non_finite, (NonFiniteSettings, type(None))):
            raise ConfigError(f"The non-finite settings {quote(self.non_finite)} are no NonFiniteSettings.")
        if (self.hot is not None) != (self.recovery is RecoveryMode.HOT) or not isinstance(
                self.hot, (HotSettings, type(None))):
            raise ConfigError(f"The worker settings of {self.recovery.value} mode "
                              f"{'need' if self.recovery is RecoveryMode.HOT else 'take no'} hot-recovery settings.")

    @classmethod
    def of(cls, options: RdzvOptions, min_nodes: int, max_nodes: int) -> WorkerSettings:
        """The workers' settings of a job with ``options`` and ``--nnodes MIN:MAX``."""
        hot = None
        if options.recovery is RecoveryMode.HOT:
            hot = HotSettings(min_nodes=min_nodes, max_nodes=max_nodes, node_ttl=options.node_ttl,
                              last_call=float(options.last_call_timeout), reform_last_call=REFORM_LAST_CALL,
                              join_timeout=float(options.join_timeout), run_ttl=options.ttl)
        return cls(options.recovery, StragglerSettings.of(options, min_nodes=min_nodes), hot,
                   ReplicaCheckSettings.of(options, min_nodes=min_nodes), NonFiniteSettings.of(options))

    def to_json(self) -> str:
        return json.dumps({
            "version": WORKER_SETTINGS_VERSION, "recovery": self.recovery.value,
            "stragglers": None if self.stragglers is None else dataclasses.asdict(self.stragglers),
            "hot": None if self.hot is None else dataclasses.asdict(self.hot),
            "replicas": None if self.replicas is None else dataclasses.asdict(self.replicas),
            "non_finite": None if self.non_finite is None else dataclasses.asdict(self.non_finite),
        }, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str = "the worker settings") -> WorkerSettings:
        """The settings in ``text`` (untrusted); a ConfigError naming what is wrong (``where``:
        what carried them)."""
        if len(text) > _MAX_DOCUMENT:
            raise ConfigError(f"The worker settings in {where} are longer than {_MAX_DOCUMENT} characters.")
        try:
            data = json.loads(text, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            data = None
        if not isinstance(data, dict):
            raise ConfigError(f"The worker settings in {where} ({quote(text)}) are not a JSON object.")
        version = data.get("version")
        if type(version) is not int or version != WORKER_SETTINGS_VERSION:
            raise ConfigError(f"The worker settings in {where} have the version {quote(version)}; this "
                              f"elasticctl reads version {WORKER_SETTINGS_VERSION} (is every node on one version?).")
        sections = {"recovery", "stragglers", "hot", "replicas", "non_finite"}
        _known("worker setting", data, {"version", *sections}, where)
        missing = sorted(sections - set(data))
        if missing:
            raise ConfigError(f"The worker settings in {where} miss {missing[0]}.")
        try:
            recovery = RecoveryMode(data["recovery"])
        except (ValueError, TypeError):
            raise ConfigError(f"The recovery mode {quote(data['recovery'])} in {where} must be one of: "
                              f"{', '.join(mode.value for mode in RecoveryMode)}.") from None
        stragglers, hot, replicas, non_finite = data["stragglers"], data["hot"], data["replicas"], data["non_finite"]
        if stragglers is not None:
            stragglers = StragglerSettings(**_section(StragglerSettings, "straggler setting", stragglers, where))
        if hot is not None:
            hot = HotSettings(**_section(HotSettings, "hot-recovery setting", hot, where))
        if replicas is not None:
            replicas = ReplicaCheckSettings(**_section(ReplicaCheckSettings, "replica-check setting", replicas, where))
        if non_finite is not None:
            non_finite = NonFiniteSettings(**_section(NonFiniteSettings, "non-finite setting", non_finite, where))
        return cls(recovery, stragglers, hot, replicas, non_finite)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is no number")


def _known(what: str, data: dict, names: set[str], where: str) -> None:
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"The {what} {quote(unknown[0])} in {where} is unknown.")


def _section(settings: type, what: str, data: object, where: str) -> dict:
    """A section of the document as the keyword arguments of ``settings``; each value then
    meets the dataclass's own checks (the table's ranges)."""
    if not isinstance(data, dict):
        raise ConfigError(f"The {what}s in {where} are not a JSON object.")
    names = {field.name for field in dataclasses.fields(settings)}
    _known(what, data, names, where)
    missing = sorted(names - set(data))
    if missing:
        raise ConfigError(f"The {what}s in {where} miss {missing[0]}.")
    return data
