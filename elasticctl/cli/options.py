"""What every ``elasticctl`` command shares: the etcd options and settings, the checked
option types, and the one-line error exit."""

from __future__ import annotations

import math
import sys

import click

from elasticctl.errors import ConfigError
from elasticctl.etcd.client import EtcdSettings
from elasticctl.job import environment
from elasticctl.job.registry import DEFAULT_KEY_PREFIX
from elasticctl.job.spec import quote, validate_name


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


# Port 0 lets the system pick a free port.
class _Whole(click.IntRange):
    """click's IntRange, written in ASCII digits: int() also reads other scripts' digits
    ('٢٣٧٩' is 2379), which no one types as a port or a count on purpose."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.isascii():
            self.fail(f"{quote(value)} is not a whole number written with the digits 0-9.", param, ctx)
        return super().convert(value, param, ctx)


_PORT = _Whole(0, 65535)


class _Seconds(click.FloatRange):
    """A finite number of seconds in a range (click's FloatRange lets nan and inf through)."""

    def convert(self, value, param, ctx):
        seconds = super().convert(value, param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{quote(value)} is not a finite number of seconds.", param, ctx)
        return seconds



# -- options shared by every command that talks to etcd ----------------------------------

def etcd_options(func):
    """--etcd and the TLS/auth options; the password only from the environment (environment.ETCD_PASSWORD)."""
    options = [
        click.option("--etcd", "etcd_endpoints", envvar=environment.ETCD, default=None, metavar="HOST:PORT[,...]",
                     help="etcd endpoints (default: the embedded etcd `elasticctl up` runs on this host)."),
        click.option("--etcd-cacert", default=None, help="CA bundle that signed etcd's certificate (enables TLS)."),
        click.option("--etcd-cert", default=None, help="Client certificate for etcd."),
        click.option("--etcd-key", default=None, help="Client key for etcd."),
        click.option("--etcd-user", default=None, help=f"etcd user; the password comes from {environment.ETCD_PASSWORD}."),
        click.option("--key-prefix", default=DEFAULT_KEY_PREFIX, show_default=True, help="Where jobs live in etcd."),
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
