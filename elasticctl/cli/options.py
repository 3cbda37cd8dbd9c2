"""What every ``elasticctl`` command shares: the etcd options and settings, the checked
option types, and the one-line error exit."""

from __future__ import annotations

import sys

import click

from elasticctl.errors import ConfigError
from elasticctl.etcd.client import EtcdSettings
from elasticctl.job import environment
from elasticctl.job.registry import DEFAULT_KEY_PREFIX
from elasticctl.job.settings import parse_key_prefix
from elasticctl.job.spec import quote, validate_name
from elasticctl.numbers import decimal_number, integer


# ELASTICCTL_ETCD, ELASTICCTL_JOB, ... for every command, not ELASTICCTL_UP_ETCD.
_FLAT_ENV = {"auto_envvar_prefix": "ELASTICCTL"}


def _fail(message: str, code: int = 1) -> None:
    click.echo(f"elasticctl: error: {message}", err=True)
    sys.exit(code)


def _checked_name(what: str):
    """A click callback applying the one naming rule (spec.validate_name) to an option's value."""

    def check(_ctx, _param, value):
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



# -- options shared by every command that talks to etcd ----------------------------------

def etcd_options(func):
    """--etcd and the TLS/auth options; the password only from the environment (environment.ETCD_PASSWORD)."""
    options = [
        click.option("--etcd", "etcd_endpoints", envvar=environment.ETCD, default=None, metavar="HOST:PORT[,...]",
                     callback=_not_empty,
                     help="etcd endpoints (default: the embedded etcd `elasticctl up` runs on this host)."),
        click.option("--etcd-cacert", default=None, callback=_not_empty,
                     help="CA bundle that signed etcd's certificate (enables TLS)."),
        click.option("--etcd-cert", default=None, callback=_not_empty, help="Client certificate for etcd."),
        click.option("--etcd-key", default=None, callback=_not_empty, help="Client key for etcd."),
        click.option("--etcd-user", default=None, callback=_not_empty,
                     help=f"etcd user; the password comes from {environment.ETCD_PASSWORD}."),
        click.option("--key-prefix", default=DEFAULT_KEY_PREFIX, show_default=True, callback=_checked_key_prefix,
                     help="Where jobs live in etcd."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _settings(params: dict, endpoints: str | None = None) -> EtcdSettings:
    from elasticctl.embedded_etcd import embedded_endpoint

    endpoints = endpoints or params["etcd_endpoints"] or embedded_endpoint()
    if not endpoints:
        raise ConfigError("No --etcd was given and no embedded etcd runs on this host; pass --etcd HOST:PORT.")
    password = environment.etcd_password() if params["etcd_user"] else None
    return EtcdSettings.from_string(
        endpoints, protocol="https" if params["etcd_cacert"] else None, cacert=params["etcd_cacert"],
        cert=params["etcd_cert"], key=params["etcd_key"], user=params["etcd_user"], password=password,
    )
