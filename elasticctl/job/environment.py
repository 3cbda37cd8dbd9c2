"""Every environment variable elasticctl hands across a process boundary, encoded and decoded here.

A job's variables travel down a chain of processes:

1. The node (``elasticctl up``) knows the job, its own id, how to reach etcd and the
   checkpoint directory; it starts torchrun with ``WorkerEnvironment(...).to_env()``.
2. The rendezvous handler inside torchrun's agent decodes that once (:meth:`WorkerEnvironment.from_env`),
   adds what changes with every start of its workers (restarts spent, where they mark,
   the worker settings: recovery mode, hot recovery's and straggler detection's, the address
   they are reached at, the key their run's records are signed with) and exports the result for the workers in one function
   (``EtcdRendezvousHandler._export_worker_environment``).
3. Every worker decodes it once (:meth:`WorkerEnvironment.from_env`) and passes the object down.

Nothing else in elasticctl reads or names an ``ELASTICCTL_*`` variable: the few read outside
that chain (the etcd binary, the state directory, the CLI's etcd password) have their
typed readers below. (Every CLI flag can also come from ``ELASTICCTL_<FLAG>``: click derives
those from the flag names.) Everything in an environment is untrusted: a bad value is a
:class:`~elasticctl.errors.ConfigError` naming the variable and the value, in one sentence.

The variables of torch (and of the libraries under it) that elasticctl sets are named at the end
of this module, each with why.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, MutableMapping

from elasticctl.errors import ConfigError
from elasticctl.job.keys import DEFAULT_KEY_PREFIX
from elasticctl.job.options import RecoveryMode
from elasticctl.job.settings import WorkerSettings, parse_key_prefix
from elasticctl.job.spec import quote, validate_name

NODE = "ELASTICCTL_NODE"                  # this node's id in the job
NODE_ADDR = "ELASTICCTL_NODE_ADDR"        # the address this node's workers are reached at
RESTARTS = "ELASTICCTL_RESTARTS"          # restarts this node's own failures have spent
WORKER_MARKS = "ELASTICCTL_WORKER_MARKS"  # where workers mark started-N / done-N (elasticctl.train.entry)
JOB = "ELASTICCTL_JOB"
KEY_PREFIX = "ELASTICCTL_KEY_PREFIX"
ETCD = "ELASTICCTL_ETCD"                  # etcd endpoints, with their scheme
ETCD_CACERT = "ELASTICCTL_ETCD_CACERT"
ETCD_CERT = "ELASTICCTL_ETCD_CERT"
ETCD_KEY = "ELASTICCTL_ETCD_KEY"
ETCD_USER = "ELASTICCTL_ETCD_USER"
ETCD_PASSWORD = "ELASTICCTL_ETCD_PASSWORD"  # never a flag: it would show in `ps`
CHECKPOINT_DIR = "ELASTICCTL_CHECKPOINT_DIR"
RDZV_SECRET = "ELASTICCTL_RDZV_SECRET"    # never a flag either
WORKER_SETTINGS = "ELASTICCTL_WORKER_SETTINGS"  # settings.WorkerSettings, one versioned JSON document

# Read outside the node -> agent -> worker chain (typed readers below).
ETCD_BINARY = "ELASTICCTL_ETCD_BINARY"
STATE_DIR = "ELASTICCTL_STATE_DIR"
# "1": a hot-mode worker builds a new process group per generation even where it could
# reconfigure its one in place (train/groups/reconfigure.py): the benchmark's baseline, and a way out.
REBUILD_GROUPS = "ELASTICCTL_REBUILD_GROUPS"
# A file where the framework integrations (elasticctl.integrations) append, per rank and step,
# the sample indices trained: an audit that every sample of an epoch was trained once.
SAMPLE_LEDGER = "ELASTICCTL_SAMPLE_LEDGER"

MAX_RESTARTS = 10**9 - 1
_RESTARTS_RE = re.compile(r"[0-9]{1,9}")
# A host name or an address as torch's stores take it: one token, no space, no list.
_ADDRESS_RE = re.compile(r"[^\s,]{1,253}")


@dataclasses.dataclass(frozen=True)
class WorkerEnvironment:
    """What a worker (and the agent above it) gets from elasticctl; every field empty outside it.

    Strings are "" when unset. ``rdzv_secret``: the job's secret where the node gave it to
    torchrun; in a worker's environment, the key its run's records are signed with
    (the handler derives it, :func:`elasticctl.job.records.run_secret`).
    """

    node: str = ""
    node_addr: str = ""
    restarts: int | None = None      # None: not under elasticctl's handler (torch's count applies)
    marks_dir: str = ""
    job: str = ""
    key_prefix: str = DEFAULT_KEY_PREFIX
    etcd: str = ""                   # endpoints; validated by etcd_settings() (it needs the etcd client)
    etcd_cacert: str = ""
    etcd_cert: str = ""
    etcd_key: str = ""
    etcd_user: str = ""
    etcd_password: str = dataclasses.field(default="", repr=False)
    checkpoint_dir: str = ""
    rdzv_secret: str = dataclasses.field(default="", repr=False)
    settings: WorkerSettings | None = None  # None: not under elasticctl's handler (restart mode, no stragglers)

    def __post_init__(self) -> None:
        # Whatever built it (a decode, the node, the handler), an environment is valid, so that
        # what to_env() writes from_env() reads back.
        if self.node:
            validate_name(self.node, f"node id in {NODE}")
        if self.job:
            validate_name(self.job, f"job name in {JOB}")
        if self.node_addr and not _ADDRESS_RE.fullmatch(self.node_addr):
            raise ConfigError(f"The node address {quote(self.node_addr)} in {NODE_ADDR} is not a host name or address.")
        if self.restarts is not None and (type(self.restarts) is not int or not 0 <= self.restarts <= MAX_RESTARTS):
            raise ConfigError(f"The restarts spent {quote(self.restarts)} in {RESTARTS} must be a whole number "
                              f"from 0 to {MAX_RESTARTS}.")
        if self.marks_dir and not os.path.isabs(self.marks_dir):
            raise ConfigError(f"The worker marks directory {quote(self.marks_dir)} in {WORKER_MARKS} "
                              "must be an absolute path.")
        parse_key_prefix(f"key prefix in {KEY_PREFIX}", self.key_prefix)
        if bool(self.etcd_cert) != bool(self.etcd_key):
            raise ConfigError(f"{ETCD_CERT} and {ETCD_KEY} must be given together.")
        if self.settings is not None and not isinstance(self.settings, WorkerSettings):
            raise ConfigError(f"The worker settings {quote(self.settings)} in {WORKER_SETTINGS} "
                              "are not WorkerSettings.")

    # -- the codec ---------------------------------------------------------------------

    def to_env(self) -> dict[str, str]:
        """The variables that carry this environment; unset (empty, default) fields are left out."""
        env = {name: getattr(self, field) for name, field in _STRINGS.items() if getattr(self, field)}
        if self.key_prefix != DEFAULT_KEY_PREFIX:
            env[KEY_PREFIX] = self.key_prefix
        if self.restarts is not None:
            env[RESTARTS] = str(self.restarts)
        if self.settings is not None:
            env[WORKER_SETTINGS] = self.settings.to_json()
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> WorkerEnvironment:
        """Decode ``environ``; a ConfigError naming the first bad value."""
        values: dict[str, object] = {field: environ.get(name, "") for name, field in _STRINGS.items()}
        prefix = environ.get(KEY_PREFIX, "")
        if prefix:
            values["key_prefix"] = prefix
        restarts = environ.get(RESTARTS, "")
        if restarts:
            if not _RESTARTS_RE.fullmatch(restarts):
                raise ConfigError(f"The restarts spent {quote(restarts)} in {RESTARTS} must be a whole number "
                                  f"from 0 to {MAX_RESTARTS}.")
            values["restarts"] = int(restarts)
        settings = environ.get(WORKER_SETTINGS, "")
        if settings:
            values["settings"] = WorkerSettings.from_json(settings, where=WORKER_SETTINGS)
        return cls(**values)

    # -- what the fields mean to a worker -----------------------------------------------

    @property
    def recovery(self) -> RecoveryMode:
        """This worker's recovery mode: its settings', restart mode outside elasticctl's handler."""
        return RecoveryMode.RESTART if self.settings is None else self.settings.recovery

    @property
    def in_job(self) -> bool:
        """Whether this process belongs to an elasticctl job it can reach (etcd and job known)."""
        return bool(self.etcd and self.job)

    def etcd_settings(self, retry_timeout: float):
        """How this worker reaches its job's etcd (like its node does), or None outside elasticctl."""
        if not self.in_job:
            return None
        from elasticctl.etcd.client import EtcdSettings  # grpc only when it is used

        return EtcdSettings.from_string(
            self.etcd, cacert=self.etcd_cacert or None, cert=self.etcd_cert or None, key=self.etcd_key or None,
            user=self.etcd_user or None, password=self.etcd_password or None, retry_timeout=retry_timeout)

    def job_keys(self):
        """The keys of this worker's job, or None outside elasticctl."""
        from elasticctl.job.keys import JobKeys

        return JobKeys(self.job, self.key_prefix) if self.job else None

    def secret_bytes(self) -> bytes | None:
        return self.rdzv_secret.encode() if self.rdzv_secret else None


# Variable -> field, for the fields that are plain strings.
_STRINGS = {
    NODE: "node", NODE_ADDR: "node_addr", WORKER_MARKS: "marks_dir", JOB: "job", ETCD: "etcd",
    ETCD_CACERT: "etcd_cacert", ETCD_CERT: "etcd_cert", ETCD_KEY: "etcd_key", ETCD_USER: "etcd_user",
    ETCD_PASSWORD: "etcd_password", CHECKPOINT_DIR: "checkpoint_dir", RDZV_SECRET: "rdzv_secret",
}
WORKER_VARIABLES = (*_STRINGS, KEY_PREFIX, RESTARTS, WORKER_SETTINGS)


def export(environment: WorkerEnvironment, environ: MutableMapping[str, str] = os.environ) -> None:
    """Make ``environ`` carry exactly ``environment``: its variables set, the others of it removed
    (a value left from an earlier start must not reach the next one)."""
    env = environment.to_env()
    for name in WORKER_VARIABLES:
        if name in env:
            environ[name] = env[name]
        else:
            environ.pop(name, None)


# -- variables read outside the worker chain -------------------------------------------

def etcd_binary(environ: Mapping[str, str] = os.environ) -> str | None:
    """The etcd server binary the user named, if any (checked by elasticctl.embedded_etcd)."""
    return environ.get(ETCD_BINARY) or None


def rebuild_groups(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``REBUILD_GROUPS`` asks for a new process group per generation ("1"; unset, "" or
    "0": no; anything else is a ConfigError naming it)."""
    value = environ.get(REBUILD_GROUPS, "")
    if value not in ("", "0", "1"):
        raise ConfigError(f"{REBUILD_GROUPS} must be 0 or 1, got {quote(value)}.")
    return value == "1"


def sample_ledger(environ: Mapping[str, str] = os.environ) -> str | None:
    """The file the framework integrations append their sample ledger to, if one was asked for."""
    return environ.get(SAMPLE_LEDGER) or None


def state_dir(environ: Mapping[str, str] = os.environ) -> str | None:
    """Where this host keeps elasticctl's state (the embedded etcd's address), if the user moved it."""
    return environ.get(STATE_DIR) or None


def rdzv_secret(environ: Mapping[str, str] = os.environ) -> str | None:
    """The job secret this node was given in its environment (kept out of the spec), if any."""
    return environ.get(RDZV_SECRET) or None


def etcd_password(environ: Mapping[str, str] = os.environ) -> str | None:
    """The etcd password: only from the environment, never a flag (a flag would show in ``ps``)."""
    return environ.get(ETCD_PASSWORD) or None


# -- torch's variables (and its libraries') that elasticctl sets -----------------------

# gloo binds to whatever the host name resolves to (often 127.0.0.1 or Debian's 127.0.1.1)
# and tells its peers that address, so a multi-host job never forms: the node sets the
# interface of --local-addr for torchrun and its workers (unless the user set one).
GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"

# Hot recovery, on NCCL: a lost peer must raise in the surviving workers, not end them. With
# blocking waits a collective throws on its timeout (the node TTL), and error handling 2
# (CleanUpOnly) makes NCCL's watchdog abort the communicator instead of tearing the process
# down (torch's default). Set with setdefault: a user's own choice wins.
NCCL_HOT_RECOVERY = {
    "TORCH_NCCL_BLOCKING_WAIT": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
}

# Read, not set: torch's DynamicRendezvousHandler shares the agent's TCPStore with the workers
# unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE is set; elasticctl's handler never shares it (its
# use_agent_store is False) and leaves the variable alone (see rendezvous/backend.py).
