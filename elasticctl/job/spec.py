"""What a job is: the settings every node of it shares, validated into whole-sentence errors."""

from __future__ import annotations

import dataclasses
import re

from elasticctl.errors import ConfigError, quote
from elasticctl.job.options import BY_KEY, BY_NAME, MAX_NODE_TTL, Home, refusal_of_node_setting
from elasticctl.job.settings import RdzvOptions, parse_rdzv_options
from elasticctl.numbers import whole_number

# The one rule for every name that becomes part of an etcd key (job, run id, node id):
# matched with fullmatch, so that no trailing newline slips through as it does with '$'.
_JOB_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A sha256 as the spec keeps it (elasticctl.doctor.code makes them; etcd's copy is untrusted).
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
MAX_CODE_PATHS = 64
MAX_CODE_PATH_CHARS = 4096


def parse_nnodes(text: str) -> tuple[int, int]:
    """Parse ``"N"`` or ``"MIN:MAX"`` into (min, max)."""
    parts = [whole_number(p.strip()) for p in str(text).split(":")]
    if len(parts) not in (1, 2) or None in parts:
        raise ConfigError(f"The node count {quote(text)} must be N or MIN:MAX with whole numbers, e.g. 1:4.")
    low, high = parts[0], parts[-1]
    if low < 1:
        raise ConfigError(f"The minimum number of nodes ({low}) in {quote(text)} must be at least 1.")
    if high < low:
        raise ConfigError(f"The maximum number of nodes ({high}) in {quote(text)} must not be below the minimum ({low}).")
    return low, high


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """Parse torchrun's ``k1=v1,k2=v2`` rendezvous options."""
    conf: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"The rendezvous option {quote(item)} must be of the form key=value.")
        conf[key.strip()] = value.strip()
    return conf


def parse_env(items: tuple[str, ...] | list[str]) -> tuple[tuple[str, str], ...]:
    """Parse repeated ``NAME=VALUE`` options into sorted pairs."""
    pairs: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not _ENV_NAME_RE.fullmatch(name):
            raise ConfigError(f"The environment setting {quote(item)} must be of the form NAME=VALUE.")
        pairs[name] = value
    return tuple(sorted(pairs.items()))


def validate_name(value: str, what: str) -> str:
    """``value`` if it is a valid ``what`` (job name, run id, node id), else a ConfigError naming it.

    Names become etcd key segments: 1-63 letters, digits, '.', '_' or '-', starting
    with a letter or digit (no '/', no whitespace, no trailing newline).
    """
    if not isinstance(value, str) or not _JOB_NAME_RE.fullmatch(value):
        raise ConfigError(
            f"The {what} {quote(value)} must be 1-63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit."
        )
    return value


def validate_job_name(name: str) -> str:
    return validate_name(name, "job name")


# How each JobSpec field looks in its JSON form in etcd.
_SPEC_JSON_TYPES = {
    "name": str, "script": str, "script_args": "strings", "min_nodes": int, "max_nodes": int,
    "nproc_per_node": str, "max_restarts": int, "rdzv_conf": "mapping", "checkpoint_dir": (str, type(None)),
    "module": bool, "env": "mapping", "legacy_local_rank": bool, "node_ttl": int,
    "script_sha256": (str, type(None)), "code_paths": "strings", "code_sha256": (str, type(None)),
}


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """Everything a node needs to launch its part of the job; identical on every node."""

    name: str
    script: str
    script_args: tuple[str, ...] = ()
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: str = "1"
    max_restarts: int = BY_NAME["max_restarts"].up_default
    rdzv_conf: tuple[tuple[str, str], ...] = ()
    checkpoint_dir: str | None = None
    module: bool = False
    env: tuple[tuple[str, str], ...] = ()
    legacy_local_rank: bool = False
    node_ttl: int = BY_NAME["node_ttl"].default
    # What the job runs, as `up` found it on its host (elasticctl.doctor.code): every joining node
    # compares its own files (the `code` admission check). The digests are facts of one host, not
    # settings: two specs that differ only in them are the same job's (compare=False), and a host
    # with other code is refused by that check, naming both digests, not as a spec conflict. The
    # paths hashed (`up --code-hash`) are a setting of the job, compared as any other.
    script_sha256: str | None = dataclasses.field(default=None, compare=False)
    code_paths: tuple[str, ...] = ()
    code_sha256: str | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        # Canonical order, so that specs from flags, YAML and etcd compare equal.
        object.__setattr__(self, "rdzv_conf", tuple(sorted(dict(self.rdzv_conf).items())))
        object.__setattr__(self, "env", tuple(sorted(dict(self.env).items())))
        object.__setattr__(self, "script_args", tuple(self.script_args))
        object.__setattr__(self, "code_paths", tuple(self.code_paths))
        validate_job_name(self.name)
        self._check_code_digests()
        # torchrun's words (what each means is the node's to say: elasticctl.launcher.local_world_size)
        if self.nproc_per_node not in ("auto", "cpu", "gpu") and not (whole_number(self.nproc_per_node) or 0) > 0:
            raise ConfigError(
                f"The processes per node {quote(self.nproc_per_node)} must be a positive whole number, "
                "'auto', 'cpu' or 'gpu'."
            )
        restarts = BY_NAME["max_restarts"]
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int):
            raise ConfigError(f"The maximum number of restarts {quote(self.max_restarts)} must be a whole number.")
        if self.max_restarts < 0:
            raise ConfigError(f"The maximum number of restarts ({self.max_restarts}) must not be negative.")
        if self.max_restarts > restarts.high:
            raise ConfigError(f"The maximum number of restarts ({self.max_restarts}) must not be above "
                              f"{restarts.high}.")
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ConfigError(f"The node count {self.min_nodes}:{self.max_nodes} must be 1 <= MIN <= MAX.")
        # Every rendezvous option is checked here, before anything is published or launched.
        # An empty one too: torchrun refuses `key=` in its --rdzv-conf with a traceback, after
        # the spec was published (parse_rdzv_options reads it as the default, as the handler may).
        for key, value in self.rdzv_conf:
            if not str(value).strip():
                raise ConfigError(f"The rendezvous option {quote(key)} is empty; give it a value, "
                                  "or leave it out for its default.")
        self._settle_fields_given_as_options()
        parse_rdzv_options(dict(self.rdzv_conf))
        if isinstance(self.node_ttl, bool) or not isinstance(self.node_ttl, int):
            raise ConfigError(f"The node liveness TTL {quote(self.node_ttl)} must be a whole number of seconds.")
        if not BY_NAME["node_ttl"].low <= self.node_ttl <= MAX_NODE_TTL:
            raise ConfigError(
                f"The node liveness TTL ({self.node_ttl} s) must be between {BY_NAME['node_ttl'].low} "
                f"and {MAX_NODE_TTL} seconds."
            )
        for name, _ in self.env:
            if not _ENV_NAME_RE.fullmatch(name):
                raise ConfigError(f"The environment variable name {quote(name)} is not valid.")

    def _check_code_digests(self) -> None:
        for field in ("script_sha256", "code_sha256"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, str) and _SHA256_RE.fullmatch(value)):
                raise ConfigError(f"The job's {field} {quote(value)} must be 64 lowercase hex digits.")
        if len(self.code_paths) > MAX_CODE_PATHS:
            raise ConfigError(f"The job names {len(self.code_paths)} code paths to hash; at most "
                              f"{MAX_CODE_PATHS}.")
        for path in self.code_paths:
            if not isinstance(path, str) or not path or len(path) > MAX_CODE_PATH_CHARS or "\0" in path:
                raise ConfigError(f"The code path {quote(path)} must be a path.")
        if bool(self.code_paths) != (self.code_sha256 is not None):
            raise ConfigError("The job's code paths and their sha256 (code_sha256) come together: "
                              "give both or neither.")

    def _settle_fields_given_as_options(self) -> None:
        """One home per value: a setting that is a field of the spec (node_ttl, max_restarts) is not
        kept among the rendezvous options too; the same value there is dropped, another refused.
        Settings each node gives itself (its TLS files, the key prefix, the etcd password) are
        refused there: every node reads the spec, and etcd keeps it readable."""
        conf = dict(self.rdzv_conf)
        for key, text in self.rdzv_conf:
            option = BY_KEY.get(key)
            if option is None or option.home is Home.RDZV_CONF:
                continue
            if option.home is Home.NODE:
                raise ConfigError(refusal_of_node_setting(option, key, text))
            if option.home is Home.SPEC:
                value, field = option.parse(key, str(text).strip()), getattr(self, option.name)
                if value != field:
                    raise ConfigError(f"The job's {option.name} ({field}) and its rendezvous option "
                                      f"{key}={text} disagree; give the setting once.")
                del conf[key]
        object.__setattr__(self, "rdzv_conf", tuple(sorted(conf.items())))

    @property
    def options(self) -> RdzvOptions:
        """Every rendezvous option of this job as its nodes' handlers read them (the spec's
        fields included), typed."""
        return parse_rdzv_options({**dict(self.rdzv_conf), "node_ttl": str(self.node_ttl),
                                   "max_restarts": str(self.max_restarts)})

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["script_args"] = list(self.script_args)
        data["code_paths"] = list(self.code_paths)
        data["rdzv_conf"] = dict(self.rdzv_conf)
        data["env"] = dict(self.env)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> JobSpec:
        """Rebuild a spec read from etcd (untrusted): every field is type-checked, then validated.

        Fields this version does not know are ignored; anything malformed is a ConfigError.
        """
        values = {}
        for field in dataclasses.fields(cls):
            if field.name not in data:
                continue
            value, kind = data[field.name], _SPEC_JSON_TYPES[field.name]
            if kind == "strings":
                ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
                value = tuple(value) if ok else value
            elif kind == "mapping":
                ok = isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
                value = tuple(sorted(value.items())) if ok else value
            else:
                ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
            if not ok:
                raise ConfigError(f"The job spec in etcd is unreadable: its field '{field.name}' is malformed.")
            values[field.name] = value
        try:
            return cls(**values)
        except TypeError as exc:
            raise ConfigError(f"The job spec in etcd is unreadable: {exc}.") from exc

    def describe_difference(self, other: JobSpec) -> str:
        """'nnodes 1:3 != 1:4, script a.py != b.py': what makes two specs differ."""
        ours, theirs = self.to_dict(), other.to_dict()
        compared = {field.name for field in dataclasses.fields(self) if field.compare}
        diffs = [f"{key} {ours[key]!r} != {theirs[key]!r}" for key in ours
                 if key in compared and ours[key] != theirs[key]]
        return ", ".join(diffs) or "no difference"

    @property
    def nnodes(self) -> str:
        return str(self.min_nodes) if self.min_nodes == self.max_nodes else f"{self.min_nodes}:{self.max_nodes}"

    @property
    def restart_budget(self) -> int:
        """Restarts each node may spend on its own failures: ``max_restarts``, its one home
        (given as ``--max-restarts`` or ``--rdzv-conf max_restarts=``)."""
        return self.max_restarts
