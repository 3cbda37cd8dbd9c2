"""What every ``elasticctl`` command shares: the etcd options and settings, the checked
option types, and the one-line error exit."""

from __future__ import annotations

import contextlib
import sys

import click

from elasticctl.errors import ConfigError
from elasticctl.etcd.client import EtcdSettings
from elasticctl.job import environment
from elasticctl.job.options import (
    BY_FLAG,
    OPTIONS,
    Home,
    Kind,
    Option,
    RecoveryMode,
    describe_default,
    number_text,
)
from elasticctl.job.settings import parse_key_prefix
from elasticctl.job.spec import quote, validate_name
from elasticctl.numbers import decimal_number, integer


# ELASTICCTL_ETCD, ELASTICCTL_JOB, ... for every command, not ELASTICCTL_UP_ETCD.
_FLAT_ENV = {"auto_envvar_prefix": "ELASTICCTL"}


def torchrun_spellings(args: list[str], options: dict[str, bool]) -> list[str]:
    """``args`` with torchrun's underscore spellings of this command's long options
    (``--nproc_per_node``, ``--max_restarts=3``) written as the command's own, up to the script:
    what follows the script (the first argument that is no option, or ``--``) is the script's.
    ``options``: each long option of the command and whether it takes a value. An unknown option
    is left as it is, for the parser to refuse with its suggestion."""
    out: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "--" or not arg.startswith("-") or arg == "-":
            return out + args[index:]
        name, equals, value = arg.partition("=")
        if name.startswith("--") and "_" in name and name.replace("_", "-") in options:
            name = name.replace("_", "-")
        out.append(name + equals + value)
        if options.get(name) and not equals and index + 1 < len(args):
            index += 1
            out.append(args[index])  # the option's value, whatever it looks like
        index += 1
    return out


class TorchrunStyleCommand(click.Command):
    """A command that launches torchrun (``up``, ``join``): torchrun's underscore spellings of its
    options are taken before the script, and an unknown option is refused with a suggestion
    (never taken for the script)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        options = {name: not (param.is_flag or param.count)
                   for param in self.params if isinstance(param, click.Option)
                   for name in (*param.opts, *param.secondary_opts) if name.startswith("--")}
        return super().parse_args(ctx, torchrun_spellings(list(args), options))


def worker_log_options(func):
    """torchrun's options for the workers' output, passed through (``up`` and ``join``: each
    node's own, not the job's)."""
    for flag, help_text in reversed((
            ("--log-dir", "As torchrun's: a directory on this host for the workers' logs."),
            ("--tee", "As torchrun's: also copy the workers' streams to a log (0-3, or LOCAL_RANK:CODE,...)."),
            ("--redirects", "As torchrun's: send the workers' streams to a log only (0-3, or LOCAL_RANK:CODE,...)."),
            ("--local-ranks-filter", "As torchrun's: show only these local ranks' output (e.g. 0,1)."))):
        func = click.option(flag, default=None, help=help_text)(func)
    return func


def worker_logs_from(params: dict):
    """The :class:`elasticctl.launcher.WorkerLogs` of the flags in ``params`` (removed from it);
    a bad value is a usage error naming it."""
    from elasticctl.launcher import WorkerLogs

    values = {name: params.pop(name) for name in ("log_dir", "tee", "redirects", "local_ranks_filter")}
    try:
        return WorkerLogs(**values)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


def _fail(message: str, code: int = 1) -> None:
    click.echo(f"elasticctl: error: {message}", err=True)
    sys.exit(code)


def _checked_name(what: str):
    """A click callback applying the one naming rule (spec.validate_name) to an option's value."""

    def check(_ctx, _param, value):
        with read_as_usage():
            return value if value is None else validate_name(value, what)

    return check


def _not_empty(ctx, param, value):
    """A click callback: an option given an empty value (``--spares ''``, ``checkpoint_dir: ""``
    in a job file) is refused naming it; taken as given, it would be read as "not given" here and
    as a broken setting further on (torchrun refuses ``spares=`` in its --rdzv-conf)."""
    if isinstance(value, str) and not value.strip():
        raise click.BadParameter("it is empty; give it a value, or leave the option out for its default.",
                                 ctx=ctx, param=param)
    return value


def _checked_key_prefix(ctx, param, value):
    """A click callback: --key-prefix as the rendezvous option key_prefix takes it (the workers'
    handler refuses any other, after the spec was published under it)."""
    try:
        return parse_key_prefix("etcd key prefix", value)
    except ConfigError as exc:
        message = str(exc)
        raise click.BadParameter(message[:1].lower() + message[1:], ctx=ctx, param=param) from None


class _Whole(click.IntRange):
    """click's IntRange, read by the one strict reading of numbers (elasticctl.numbers): int()
    also reads other scripts' digits ('٢٣٧٩' is 2379) and underscores ('1_0' is 10), which no one
    types as a port or a count on purpose."""

    def convert(self, value, param, ctx):
        if isinstance(value, str):
            number = integer(value.strip())
            if number is None:
                self.fail(f"{quote(value)} is not a whole number written with the digits 0-9.", param, ctx)
            value = number  # signed or huge: IntRange's sentence, or the caller's, names the range
        return super().convert(value, param, ctx)

    def _describe_range(self) -> str:
        # Unbounded here (the spec checks the range, in its own sentence): no "x<=None" in --help.
        return "" if self.min is None and self.max is None else super()._describe_range()


# Port 0 lets the system pick a free port.
_PORT = _Whole(0, 65535)


class _Seconds(click.FloatRange):
    """A finite number of seconds in a range, in ASCII (click's FloatRange lets nan and inf through,
    and float() reads '1_5' as 15 and full-width digits as digits)."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and decimal_number(value.strip()) is None:
            self.fail(f"{quote(value)} is not a finite number of seconds written with the digits 0-9.",
                      param, ctx)
        return super().convert(value, param, ctx)



# -- the options of the one table of settings (elasticctl.job.options) --------------------

_METAVARS = {Kind.RATIO: "R", Kind.RATIO_OR_ZERO: "R", Kind.STEPS: "STEPS", Kind.WHOLE: "N"}


def param_name(option: Option) -> str:
    """The name click gives the value of ``option``'s flag (``--etcd-cacert``: etcd_cacert)."""
    return option.flag[2:].replace("-", "_")


def setting_help(option: Option) -> str:
    """A flag's help: the table's line, its default, and `up`'s default where that differs from
    the one plain torchrun gets."""
    text = option.help
    if option.home is Home.SPEC and option.kind is Kind.WHOLE:
        text += f" ({option.low} to {number_text(option.high)})"
    if option.up_default is not None:
        torch = option.torch_default
        text += (f" (`up`'s default; plain torchrun's: {describe_default(option)}"
                 f"{'' if torch is None else '; torch: ' + describe_default(option, torch)})")
    elif option.default is not None and not _shows_default(option):
        text += f" (default: {describe_default(option)})"
    return text


def _shows_default(option: Option) -> bool:
    """Whether click shows the flag's default itself (the value the flag starts from)."""
    return option.home is not Home.RDZV_CONF


def setting_option(flag: str):
    """The click option of a flag in the table, made from its row (one declaration)."""
    option = BY_FLAG[flag]
    common = {"help": setting_help(option)}
    if option.home is Home.SPEC:
        default = option.up_default if option.up_default is not None else option.default
        return click.option(flag, type=_Whole(), default=default, show_default=True, **common)
    if option.kind is Kind.RECOVERY:
        return click.option(flag, type=click.Choice([mode.value for mode in RecoveryMode]), default=None, **common)
    if option.kind is Kind.KEY_PREFIX:
        return click.option(flag, default=option.default, show_default=True, callback=_checked_key_prefix, **common)
    if option.kind is Kind.SECONDS:
        return click.option(flag, type=_Seconds(min=0, min_open=True, max=option.high), default=option.default,
                            show_default=True, **common)
    # Read as text, then by the table's parser (one sentence naming the flag and the value).
    return click.option(flag, default=None, metavar=_METAVARS.get(option.kind), callback=_not_empty,
                        show_default=option.home is Home.NODE and option.default is not None, **common)


# The flags of `up` that set a setting of the job (the spec's or its rendezvous options').
JOB_SETTING_FLAGS = tuple(option.flag for option in OPTIONS if option.flag and option.home is not Home.NODE)
# The flags of every command that talks to etcd: how this node reaches it.
ETCD_SETTING_FLAGS = tuple(option.flag for option in OPTIONS if option.flag and option.home is Home.NODE)


def job_setting_options(func):
    """`up`'s flags for the job's settings, made from the table."""
    for flag in reversed(JOB_SETTING_FLAGS):
        func = setting_option(flag)(func)
    return func


# -- options shared by every command that talks to etcd ----------------------------------

def etcd_options(func):
    """--etcd and the TLS/auth options; the password only from the environment (environment.ETCD_PASSWORD)."""
    options = [
        click.option("--etcd", "etcd_endpoints", envvar=environment.ETCD, default=None, metavar="HOST:PORT[,...]",
                     callback=_not_empty,
                     help="etcd endpoints (default: the embedded etcd `elasticctl up` runs on this host)."),
        *(setting_option(flag) for flag in ETCD_SETTING_FLAGS),
    ]
    for option in reversed(options):
        func = option(func)
    return func


@contextlib.contextmanager
def read_as_usage():
    """A value refused while the command line is read, before the command reaches etcd or starts
    anything, is a usage error (exit 2, like click's own): every retry would fail alike. What is
    refused later (the job's state, etcd's answer) stays a runtime error (exit 1)."""
    try:
        yield
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


def _settings(params: dict, endpoints: str | None = None) -> EtcdSettings:
    """How this command reaches etcd, from its flags (a bad value: a usage error)."""
    with read_as_usage():
        return _settings_from(params, endpoints)


def _settings_from(params: dict, endpoints: str | None) -> EtcdSettings:
    from elasticctl.embedded_etcd import embedded_endpoint

    endpoints = endpoints or params["etcd_endpoints"] or embedded_endpoint()
    if not endpoints:
        raise ConfigError("No --etcd was given and no embedded etcd runs on this host; pass --etcd HOST:PORT.")
    password = environment.etcd_password() if params["etcd_user"] else None
    return EtcdSettings.from_string(
        endpoints, protocol="https" if params["etcd_cacert"] else None, cacert=params["etcd_cacert"],
        cert=params["etcd_cert"], key=params["etcd_key"], user=params["etcd_user"], password=password,
        connect_timeout=params["connect_timeout"],
    )
