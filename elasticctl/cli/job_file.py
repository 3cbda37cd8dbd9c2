"""``--config job.yaml``: a job file's keys become the command's defaults (job files are
untrusted input: every value is checked against what its option takes)."""

from __future__ import annotations

import re

import click
import yaml

from elasticctl.errors import quote_path
from elasticctl.job.spec import quote


class _JobFileLoader(yaml.SafeLoader):
    """YAML 1.1 reads ``nnodes: 2:4`` as the base-60 integer 124; job files mean "2:4"."""


_JobFileLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_JobFileLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?[0-9]+$"), list("-+0123456789"))
_JobFileLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?$"), list("-+0123456789.")
)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    problem, mark = getattr(exc, "problem", None), getattr(exc, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
    if isinstance(exc, yaml.reader.ReaderError):
        return f"the unprintable character #x{exc.character:04x} at position {exc.position}"
    return " ".join(str(exc).split())


def _is_scalar(value) -> bool:
    return isinstance(value, (str, int, float)) and not isinstance(value, bool)


def _described(value) -> str:
    """How a job-file value is named in an error: "the string 'abc'", "a list", "the number 5"."""
    if value is None:
        return "nothing"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return f"the string {quote(value)}"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return f"the number {value}"
    return f"{quote(value)} (a {type(value).__name__}; quote it to make it a string)"


def _config_value(path: str, key: str, param: click.Parameter, value):
    """A job-file value checked against what its option takes (job files are untrusted input)."""
    where = f"the key {quote(key)} in {quote_path(path)}"
    name = param.name
    if name == "script_args":
        if not isinstance(value, list) or not all(_is_scalar(v) for v in value):
            raise click.BadParameter(f"{where} must be a list of arguments such as [--epochs, 3], "
                                     f"not {_described(value)}.")
        return [str(v) for v in value]
    if name in ("env", "rdzv_conf") and isinstance(value, dict):
        for k, v in value.items():
            if not _is_scalar(k) or not _is_scalar(v):
                raise click.BadParameter(
                    f"{where} must map names to single values (quote true/false), but "
                    f"{quote(k)} maps to {_described(v)}."
                )
            if name == "rdzv_conf" and ("," in f"{k}{v}" or "=" in str(k)):
                raise click.BadParameter(
                    f"{where}: the rendezvous option {quote(k)} must not hold ',' or '='."
                )
        if name == "env":
            return [f"{k}={v}" for k, v in value.items()]
        return ",".join(f"{k}={v}" for k, v in value.items())
    if param.multiple or param.nargs == -1:
        if not isinstance(value, list) or not all(_is_scalar(v) for v in value):
            raise click.BadParameter(f"{where} must be a list of values, not {_described(value)}.")
        return [str(v) for v in value]
    if isinstance(param, click.Option) and param.is_flag:
        if not isinstance(value, bool):
            raise click.BadParameter(f"{where} must be true or false, not {_described(value)}.")
        return value
    if not _is_scalar(value):
        raise click.BadParameter(f"{where} must be a single value, not {_described(value)}.")
    if isinstance(param.type, (click.types.IntParamType, click.types.FloatParamType)):
        return value  # click converts and range-checks it as it does a flag's value
    return str(value)


def _load_config(ctx: click.Context, _param, path: str | None):
    """``--config job.yaml``: its keys become the command's defaults; flags still win."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise click.BadParameter(f"cannot read {quote_path(path)}: {exc.strerror}.") from exc
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise click.BadParameter(
            f"{quote_path(path)} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})."
        ) from exc
    try:
        data = yaml.load(text, Loader=_JobFileLoader)
    except yaml.YAMLError as exc:
        raise click.BadParameter(f"{quote_path(path)} is not valid YAML: {_yaml_problem(exc)}.") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise click.BadParameter(f"{quote_path(path)} must hold a mapping of option names to values.")
    params = {p.name: p for p in ctx.command.params}
    aliases = {"etcd": "etcd_endpoints", "args": "script_args"}
    defaults = {}
    for key, value in data.items():
        name = aliases.get(str(key).replace("-", "_"), str(key).replace("-", "_"))
        if name not in params or name == "config":
            raise click.BadParameter(f"{quote_path(path)} has the unknown key {quote(key)}.")
        defaults[name] = _config_value(path, str(key), params[name], value)
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return path
