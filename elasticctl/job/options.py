"""The one table of a job's settings: each declared once, with everything that names or reads it.

A setting has a name (its ``--rdzv-conf`` key and its field of
:class:`~elasticctl.job.settings.RdzvOptions`), a kind (how its text is read and checked), a
default, a range, a help line, and, where it has them: the flag of ``elasticctl up``, the
job.yaml key (a flag's name, or a key under ``rdzv_conf:``), an environment variable, torch's
own default, and ``up``'s default where it differs from the rendezvous handler's.

Everything else is made from this table, and a unit test fails where something differs:
the parser of ``--rdzv-conf`` and :class:`RdzvOptions` (``settings.py``), the click options
of ``up`` and ``join`` that set a setting (``cli/options.py``), the checks of the
:class:`~elasticctl.job.spec.JobSpec` fields a setting lives in, the worker settings
(``settings.WorkerSettings``) and the reference page ``docs/reference/options.md``
(``python -m elasticctl.cli.reference``).

**One home per value** (:class:`Home`). A setting lives in exactly one place of a job:

* ``SPEC``: a field of the job spec (``node_ttl``, ``max_restarts``). ``--node-ttl 3`` and
  ``--rdzv-conf node_ttl=30`` are two ways of writing it; given both with different values
  they are refused in one sentence naming both (:func:`settle`); the spec never carries the
  key in its rendezvous options too.
* ``RDZV_CONF``: the spec's rendezvous options (``--rdzv-conf``, and the flags that write one
  key of it, with the same refusal when both are given and differ).
* ``NODE``: each node's own (how it reaches etcd: its TLS files and user, the key prefix; the
  run's identity): given by the node's flags or environment, never by the spec, which every
  node shares; ``up`` and ``join`` hand them to torchrun.

Imports no torch and no click: the CLI stays fast and the worker reads the same table.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Mapping

from elasticctl.errors import ConfigError, quote
from elasticctl.job.keys import DEFAULT_KEY_PREFIX
from elasticctl.numbers import decimal_number, whole_number

# Longer than this, a lost node would hold a job for an hour; etcd's own bound is 9e9 s.
MAX_NODE_TTL = 3600
MAX_SECONDS = 30 * 24 * 3600
MAX_COUNT = 1_000_000
MAX_STRAGGLER_RATIO = 1000.0
MAX_STRAGGLER_STEPS = 1_000_000
MAX_REPLICA_CHECK_STEPS = 1_000_000
# Quarantine's default where it applies (rendezvous/verdicts.py quarantine_by_default): the
# setting's own default is "none given".
DEFAULT_QUARANTINE_AFTER = 2

_KEY_PREFIX_RE = re.compile(r"(?:/[A-Za-z0-9_.-]+)+")


class RecoveryMode(enum.Enum):
    """What a membership change does to a job's workers; one value from the flag to the worker."""

    RESTART = "restart"  # torchrun's agent restarts every worker (one generation per process)
    HOT = "hot"          # the workers re-form in process (scripts on elasticctl.train)


class Kind(enum.Enum):
    """How a setting's text is read and checked (each a sentence of its own when it is not)."""

    SECONDS = "a positive number of seconds"
    WHOLE = "a whole number"
    STEPS = "a whole number of steps"
    RATIO = "a ratio above 1"
    RATIO_OR_ZERO = "a ratio above 1, or 0 (never)"
    TEXT = "text"
    PROTOCOL = "http or https"
    KEY_PREFIX = "an absolute key path"
    RECOVERY = "a recovery mode"


class Home(enum.Enum):
    """Where a setting's one value lives (see the module docstring)."""

    SPEC = "the job spec's field"
    RDZV_CONF = "the job spec's rendezvous options"
    NODE = "each node's own flags or environment"


@dataclasses.dataclass(frozen=True)
class Option:
    """One setting of a job: see the module docstring."""

    name: str
    kind: Kind
    default: object
    help: str
    home: Home = Home.RDZV_CONF
    low: float | None = None
    high: float | None = None
    aliases: tuple[str, ...] = ()  # other --rdzv-conf keys for it (torch's etcd-v2 names)
    flag: str | None = None        # `elasticctl up`'s flag (`join` takes the NODE ones too)
    up_default: object = None      # what `up` sets where that differs from `default` (None: the same)
    torch_default: object = None   # torch's own default, for the options that are torch's
    environment: str | None = None  # a variable that sets it (besides ELASTICCTL_<FLAG>)
    used: bool = True              # False: accepted for torch's handlers; elasticctl's does not use it
    secret: bool = False           # never shown (repr, logs)

    @property
    def job_file_key(self) -> str | None:
        """Its key in a job file: the flag's name, or ``rdzv_conf: {name: ...}`` (None: a node's own
        setting without a flag, which no job file gives)."""
        if self.flag:
            return self.flag[2:].replace("-", "_")
        return None if self.home is Home.NODE else f"rdzv_conf.{self.name}"

    @property
    def given_by(self) -> str:
        """How a node gives a setting of its own (NODE), for the sentence that refuses it elsewhere."""
        if self.flag:
            return f"give it with {self.flag} (to `up` and `join` alike)"
        if self.environment:
            return f"give it in {self.environment}"
        return "`up` and `join` set it from their own flags"

    @property
    def flag_environment(self) -> str | None:
        """The variable click reads the flag from (``auto_envvar_prefix`` ELASTICCTL)."""
        return "ELASTICCTL_" + self.flag[2:].upper().replace("-", "_") if self.flag else None

    @property
    def flag_text_is_parsed_here(self) -> bool:
        """Whether the flag's text reaches :meth:`parse` (so its sentence names the flag): the flags
        of rendezvous options that click does not read itself (a choice, a path, a whole number
        of the spec are click's)."""
        return (self.flag is not None and self.home is Home.RDZV_CONF
                and self.kind in (Kind.WHOLE, Kind.STEPS, Kind.RATIO, Kind.RATIO_OR_ZERO))

    def named(self, key: str) -> str:
        """How a sentence names it when given as ``key``: ``spares (--spares)`` where the flag's
        text is read here."""
        return f"{key} ({self.flag})" if self.flag_text_is_parsed_here else key

    def parse(self, key: str, text: str) -> object:
        """``text`` (given as ``key``) as this setting's value, else a ConfigError naming both."""
        where = f"The rendezvous option {self.named(key)} ({quote(text)})"
        if self.kind is Kind.SECONDS:
            value = decimal_number(text)
            if value is None or not 0 < value <= self.high:
                raise ConfigError(f"{where} must be a positive number of seconds up to {number_text(self.high)}.")
            return value
        if self.kind in (Kind.WHOLE, Kind.STEPS):
            value = whole_number(text)
            if value is None or not self.low <= value <= self.high:
                raise ConfigError(f"{where} must be {self.kind.value} from {self.low} to {self.high}.")
            return value
        if self.kind in (Kind.RATIO, Kind.RATIO_OR_ZERO):
            value = decimal_number(text)
            zero = self.kind is Kind.RATIO_OR_ZERO
            if value is None or not (1 < value <= self.high or (zero and value == 0)):
                raise ConfigError(f"{where} must be a ratio above 1 and up to {number_text(self.high)}"
                                  f"{' (0: never)' if zero else ''}.")
            return value
        if self.kind is Kind.PROTOCOL:
            if text.lower() not in ("http", "https"):
                raise ConfigError(f"The rendezvous option {key} ({quote(text)}) must be http or https.")
            return text.lower()
        if self.kind is Kind.KEY_PREFIX:
            return parse_key_prefix(f"rendezvous option {key}", text)
        if self.kind is Kind.RECOVERY:
            try:
                return RecoveryMode(text.lower())
            except ValueError:
                raise ConfigError(f"The rendezvous option {key} ({quote(text)}) must be one of: "
                                  f"{', '.join(mode.value for mode in RecoveryMode)}.") from None
        if not text or "\n" in text:
            raise ConfigError(f"The rendezvous option {key} must be a non-empty single line.")
        return text

    def check_number(self, value: object, where: str, whole: bool | None = None) -> None:
        """A number that arrived typed (JSON, a dataclass field) within this setting's range, else
        a ConfigError naming ``where`` and it. ``whole``: the value must be an int (default: as the
        kind says)."""
        whole = self.kind in (Kind.WHOLE, Kind.STEPS) if whole is None else whole
        # An int of any size compares exactly; a float must be finite (JSON's ints may be huge).
        number = (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and math.isfinite(value))
        shown = shown_value(value)
        if self.kind in (Kind.RATIO, Kind.RATIO_OR_ZERO):
            zero = self.kind is Kind.RATIO_OR_ZERO
            if not number or not (1 < value <= self.high or (zero and value == 0)):
                raise ConfigError(f"{where} ({shown}) must be a ratio above 1 and up to {number_text(self.high)}"
                                  f"{' (0: never)' if zero else ''}.")
        elif whole:
            if not number or not isinstance(value, int) or not self.low <= value <= self.high:
                what = self.kind.value if self.kind is Kind.STEPS else "a whole number"
                raise ConfigError(f"{where} ({shown}) must be {what} from {self.low} to {self.high}.")
        elif not number or not 0 < value <= self.high:
            raise ConfigError(f"{where} ({shown}) must be a positive number of seconds up to "
                              f"{number_text(self.high)}.")


def shown_value(value: object, limit: int = 40) -> str:
    """A typed value as a sentence shows it: its repr ('x', 1.0, True), shortened."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def number_text(value: float) -> str:
    """A bound as a sentence writes it: 2592000, 1000, 1.5 (never 2.592e+06)."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _seconds(name: str, default: float, help: str, **more) -> Option:
    return Option(name, Kind.SECONDS, default, help, low=0, high=MAX_SECONDS, **more)


def _whole(name: str, default: int | None, help: str, low: int, high: int, **more) -> Option:
    return Option(name, Kind.WHOLE, default, help, low=low, high=high, **more)


# The table. Order: how to reach etcd, the run's keys, liveness and the restart budget, torch's
# rendezvous timing, the recovery mode, stragglers, replica checks, spares.
OPTIONS: tuple[Option, ...] = (
    Option("protocol", Kind.PROTOCOL, None, "http or https (also implied by https:// endpoints and by a CA bundle).",
           home=Home.NODE),
    Option("cacert", Kind.TEXT, None, "CA bundle that signed etcd's certificate (enables TLS).",
           home=Home.NODE, aliases=("ca_cert",), flag="--etcd-cacert"),
    Option("cert", Kind.TEXT, None, "Client certificate for etcd.", home=Home.NODE, aliases=("ssl_cert",),
           flag="--etcd-cert"),
    Option("key", Kind.TEXT, None, "Client key for etcd.", home=Home.NODE, aliases=("ssl_cert_key",),
           flag="--etcd-key"),
    Option("user", Kind.TEXT, None, "etcd user; the password comes from ELASTICCTL_ETCD_PASSWORD.",
           home=Home.NODE, flag="--etcd-user"),
    Option("password", Kind.TEXT, None, "etcd password (from the environment: a flag would show in `ps`).",
           home=Home.NODE, environment="ELASTICCTL_ETCD_PASSWORD", secret=True),
    _seconds("read_timeout", 5.0, "Seconds per etcd request."),
    _seconds("retry_timeout", 30.0, "Seconds an etcd operation keeps retrying across endpoints before failing."),
    _seconds("connect_timeout", 10.0, "Seconds this command (and the node's torchrun agent, as it starts) waits "
             "for etcd to answer before it gives up with one sentence.", home=Home.NODE, flag="--connect-timeout"),
    Option("key_prefix", Kind.KEY_PREFIX, DEFAULT_KEY_PREFIX, "Where jobs live in etcd.", home=Home.NODE,
           flag="--key-prefix"),
    _whole("ttl", 7200, "Seconds an abandoned run's keys survive its last process.", 2, MAX_SECONDS),
    Option("secret", Kind.TEXT, None, "The job secret that signs the rendezvous records (prefer the "
           "environment: the spec is readable in etcd).", environment="ELASTICCTL_RDZV_SECRET", secret=True),
    Option("run", Kind.TEXT, None, "The run's identity: records signed in another run of the job are refused "
           "(`up` and `join` set it: the spec's etcd revision).", home=Home.NODE),
    _whole("node_ttl", 5, "Seconds a silent node is given before the others re-form without it (its lease's "
           "TTL; keep it 5 or more on a loaded machine).", 2, MAX_NODE_TTL, home=Home.SPEC, flag="--node-ttl"),
    _whole("max_restarts", None, "Failures of this node's own workers tolerated (a lost peer never counts); "
           "over it the node stops and the others go on. Unset under plain torchrun: torch's --max-restarts "
           "counts every failure.", 0, MAX_COUNT, home=Home.SPEC, flag="--max-restarts", up_default=3),
    _whole("quarantine_after", None, "Own failures within quarantine_window that put a node aside (default "
           f"{DEFAULT_QUARANTINE_AFTER} where quarantine applies: with max_restarts, or MIN < MAX).", 1, MAX_COUNT),
    _seconds("quarantine_window", 600.0, "Seconds in which quarantine_after failures count."),
    _seconds("quarantine_seconds", 60.0, "Seconds a quarantined node sits out while the others train."),
    _whole("join_timeout", 600, "Seconds a node waits for a round to complete.", 1, MAX_SECONDS,
           torch_default=600),
    _whole("last_call_timeout", 30, "Seconds a round waits for more nodes once MIN want it (not when every "
           "live node does).", 1, MAX_SECONDS, torch_default=30, up_default=1),
    _whole("close_timeout", 30, "torch's dynamic-rendezvous close timeout.", 1, MAX_SECONDS, torch_default=30,
           used=False),
    _whole("heartbeat_timeout", 5, "torch's dynamic-rendezvous heartbeat timeout (liveness is node_ttl here).",
           1, MAX_SECONDS, torch_default=5, used=False),
    _whole("keep_alive_interval", 5, "torch's heartbeat period (liveness is node_ttl here).", 1, MAX_SECONDS,
           torch_default=5, used=False),
    _whole("keep_alive_max_attempt", 3, "torch's missed heartbeats before a node counts as dead (liveness is "
           "node_ttl here).", 1, MAX_COUNT, torch_default=3, used=False),
    Option("recovery", Kind.RECOVERY, RecoveryMode.RESTART, "restart: a membership change restarts every worker "
           "from the newest checkpoint; hot: survivors re-form in process and joiners get the state from them "
           "(scripts on elasticctl.train; others behave as in restart mode).", flag="--recovery"),
    Option("straggler_ratio", Kind.RATIO, 1.5, "Name a node a straggler when its own step time is above this "
           "times the others' median at most of its steps (an event, a dashboard mark, a metric).",
           high=MAX_STRAGGLER_RATIO, flag="--straggler-ratio"),
    Option("straggler_window", Kind.STEPS, 50, "The straggler rule's window: a node is named when it is slow at "
           "more than half of its newest STEPS steps, and at STEPS of its newest 2 x STEPS.",
           low=1, high=MAX_STRAGGLER_STEPS, flag="--straggler-window"),
    Option("straggler_interval", Kind.STEPS, 10, "Workers exchange their step times every STEPS steps (at most "
           "the window).", low=1, high=MAX_STRAGGLER_STEPS, flag="--straggler-interval"),
    Option("evict_stragglers", Kind.RATIO_OR_ZERO, 0.0, "Ask a node whose step time stays above this times the "
           "others' for the window to leave, as `elasticctl leave` does (0: never).", high=MAX_STRAGGLER_RATIO,
           flag="--evict-stragglers"),
    Option("replica_check", Kind.STEPS, 100, "Every STEPS steps the workers compare a checksum of their "
           "parameters with their replicas' and name a node whose copy differs from its replicas' majority "
           "(silent corruption: an event, a metric); replicas with no majority stop the job (0: never check).",
           low=0, high=MAX_REPLICA_CHECK_STEPS, flag="--replica-check"),
    # A whole number 0/1, not a switch: every rendezvous option is a key=value of --rdzv-conf and
    # the table has no on/off kind; 1 reads as evict_stragglers' "a ratio, 0: never" does.
    _whole("evict_diverged", 0, "1: ask a node whose parameters differ from its replicas' majority to leave, "
           "as `elasticctl leave` does (once per node and run); 0: only name it.", 0, 1, flag="--evict-diverged"),
    _whole("check_non_finite", 1, "1: each worker checks its loss and its own gradients before the all-reduce "
           "and names the ranks that produced a NaN or infinity (a min/max pass over the gradients twice a step, "
           "on their device); 0: no check, no pass.", 0, 1, flag="--check-non-finite"),
    _whole("skip_non_finite", 0, "1: skip a step whose gradients are not finite on every rank (the same decision "
           "everywhere); 0: apply it. Either way the ranks that produced the NaN or infinity are named (an event, "
           "a metric). Off with a GradScaler, which skips such steps itself.", 0, 1, flag="--skip-non-finite"),
    _whole("spares", 0, "Hot spares the job expects: nodes beyond --nnodes MAX start their workers and wait "
           "warm, and one takes a lost node's place at once (status shows the count and any shortfall).",
           0, MAX_COUNT, flag="--spares"),
)

BY_NAME: dict[str, Option] = {option.name: option for option in OPTIONS}
# Every --rdzv-conf key, aliases included -> its option.
BY_KEY: dict[str, Option] = {key: option for option in OPTIONS for key in (option.name, *option.aliases)}
BY_FLAG: dict[str, Option] = {option.flag: option for option in OPTIONS if option.flag}

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

# Worker settings that are no option of a job: constants, declared here beside the table.
# Later generations re-form among running workers, which re-declare within milliseconds of a
# fault: their last call is short (the first generation waits the job's last call).
REFORM_LAST_CALL = 0.5


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


def up_defaults() -> dict[str, str]:
    """The rendezvous options `up` sets where its default differs from the handler's (and so from
    torch's, for torch's options): the rendezvous options of the torchrun command it builds
    start from these. A setting of the SPEC is not here: the spec always gives its value."""
    return {option.name: str(option.up_default) for option in OPTIONS
            if option.up_default is not None and option.home is Home.RDZV_CONF}


def describe_default(option: Option, value: object = dataclasses.MISSING) -> str:
    """A default as the help and the reference write it."""
    value = option.default if value is dataclasses.MISSING else value
    if value is None:
        return "none"
    if isinstance(value, RecoveryMode):
        return value.value
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def refusal_of_node_setting(option: Option, key: str, text: str) -> str:
    """The sentence that refuses a node's own setting among a job's rendezvous options."""
    given = key if option.secret else f"{key}={text}"
    return (f"The rendezvous option {given} is each node's own, not the job's: {option.given_by}, "
            "and leave it out of the job's --rdzv-conf.")


def settle(flags: Mapping[str, str], conf: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """One value per setting from the flags a user gave (``flags``: option name -> the flag's text,
    only those given) and ``--rdzv-conf`` (``conf``, key -> text as given).

    Returns (the values of the SPEC settings given either way, the rendezvous options): a
    setting given both ways with different values is a ConfigError naming both; a NODE setting
    in ``conf`` is one naming the flag or variable that gives it (each node gives its own)."""
    spec: dict[str, str] = {}
    options: dict[str, str] = {}
    for key, text in conf.items():
        if not str(text).strip():
            raise ConfigError(f"The rendezvous option {quote(key)} is empty; give it a value, "
                              "or leave it out for its default.")
        option = BY_KEY.get(key)
        if option is None:
            options[key] = text  # unknown or torch's own: the spec's check names it
            continue
        if option.home is Home.NODE:
            raise ConfigError(refusal_of_node_setting(option, key, text))
        target = spec if option.home is Home.SPEC else options
        target[option.name if option.home is Home.SPEC else key] = text
    for name, text in flags.items():
        option = BY_NAME[name]
        target = spec if option.home is Home.SPEC else options
        given = next(((key, target[key]) for key in (option.name, *option.aliases) if key in target), None)
        if given is not None and option.parse(given[0], given[1].strip()) != option.parse(
                option.name, str(text).strip()):
            raise ConfigError(f"{option.flag} {text} and --rdzv-conf {given[0]}={given[1]} disagree; "
                              "give the setting once.")
        if given is not None:
            del target[given[0]]
        target[option.name] = str(text).strip()
    return spec, options
