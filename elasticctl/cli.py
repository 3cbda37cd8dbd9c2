"""The ``elasticctl`` command line: parse, call the library, map errors to exit codes.

Never imports torch: commands answer instantly, and torch loads only in torchrun.
Every option can also come from an ``ELASTICCTL_<OPTION>`` environment variable.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import re
import signal
import socket
import sys
import threading
import time

import click
import yaml

from elasticctl import __version__
from elasticctl.errors import ConfigError, ElasticctlError, EtcdUnavailableError
from elasticctl.etcd.client import Endpoint, EtcdSettings, connect
from elasticctl.etcd.retry import Backoff, poll, retry
from elasticctl.job import environment
from elasticctl.job.registry import DEFAULT_KEY_PREFIX, Registry, list_jobs, resolve_job
from elasticctl.job.spec import (
    MAX_NODE_TTL,
    JobSpec,
    parse_env,
    parse_nnodes,
    parse_rdzv_conf,
    quote,
    validate_name,
)

log = logging.getLogger("elasticctl")


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


@click.group(context_settings={"auto_envvar_prefix": "ELASTICCTL", "help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="elasticctl")
@click.option("-v", "--verbose", is_flag=True, help="Log what elasticctl does.")
def cli(verbose: bool) -> None:
    """Elastic multi-node PyTorch training on etcd v3: one command per host."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s elasticctl %(levelname)s %(message)s",
    )


@cli.command(context_settings=_FLAT_ENV)
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Where etcd keeps its data (default: a temporary directory).")
@click.option("--listen", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option("--advertise", default=None, help="Address other hosts use to reach this etcd.")
@click.option("--client-port", type=_PORT, default=2379, show_default=True, help="0: a free port.")
@click.option("--peer-port", type=_PORT, default=2380, show_default=True, help="0: a free port.")
@click.option("--name", default="elasticctl", show_default=True,
              callback=_checked_name("etcd member name"), help="The etcd member name.")
def etcd(data_dir, listen, advertise, client_port, peer_port, name) -> None:
    """Run a standalone single-member etcd (v3 API only) until interrupted."""
    from elasticctl.embedded_etcd import EmbeddedEtcd

    server = EmbeddedEtcd(
        data_dir=data_dir, listen_host=listen, advertise_host=advertise,
        client_port=client_port, peer_port=peer_port, name=name,
    )
    server.start()
    click.echo(f"etcd is serving at {server.endpoint} (pid {server.pid}); Ctrl-C stops it.", err=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            if server.exit_code() is not None:
                _fail(f"etcd exited unexpectedly with code {server.exit_code()}.")
    finally:
        server.stop()


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
    where = f"the key {quote(key)} in {quote(path)}"
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
        raise click.BadParameter(f"cannot read {quote(path)}: {exc.strerror}.") from exc
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise click.BadParameter(
            f"{quote(path)} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})."
        ) from exc
    try:
        data = yaml.load(text, Loader=_JobFileLoader)
    except yaml.YAMLError as exc:
        raise click.BadParameter(f"{quote(path)} is not valid YAML: {_yaml_problem(exc)}.") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise click.BadParameter(f"{quote(path)} must hold a mapping of option names to values.")
    params = {p.name: p for p in ctx.command.params}
    aliases = {"etcd": "etcd_endpoints", "args": "script_args"}
    defaults = {}
    for key, value in data.items():
        name = aliases.get(str(key).replace("-", "_"), str(key).replace("-", "_"))
        if name not in params or name == "config":
            raise click.BadParameter(f"{quote(path)} has the unknown key {quote(key)}.")
        defaults[name] = _config_value(path, str(key), params[name], value)
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return path


# -- up / join ------------------------------------------------------------------------------

@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False, **_FLAT_ENV})
@click.option("--config", type=click.Path(dir_okay=False), callback=_load_config, is_eager=True, expose_value=False,
              help="A YAML job file; any flag can be set there, and flags override it.")
@etcd_options
@click.option("--job", default="elastic-job", show_default=True, callback=_checked_name("job name"),
              help="The job name (torchrun's --rdzv-id).")
@click.option("--nnodes", default=None, help="Node count: N, or MIN:MAX for an elastic job.  [required]")
@click.option("--nproc-per-node", default="1", show_default=True, help="Workers per node, or 'auto' (one per GPU).")
@click.option("--max-restarts", type=_Whole(), default=3, show_default=True,
              help="Failures of this node's own workers tolerated (a lost peer never counts).")
@click.option("--checkpoint-dir", default=None, help=f"Where trainers checkpoint (handed to them as {environment.CHECKPOINT_DIR}).")
@click.option("--env", multiple=True, metavar="NAME=VALUE", help="Environment for the workers of every node (repeatable).")
@click.option("--node-ttl", type=_Whole(), default=5, show_default=True,
              help="Seconds a silent node is given before the others re-form without it "
                   f"(2 to {MAX_NODE_TTL}).")
@click.option("--rdzv-conf", default="", help="Extra rendezvous options k=v,... (timeouts, secret, quarantine).")
@click.option("--recovery", type=click.Choice(["restart", "hot"]), default=None,
              help="restart (default): a membership change restarts every worker from the newest checkpoint; "
                   "hot: survivors re-form in process and joiners get the state from them "
                   "(scripts on elasticctl.train).")
@click.option("--legacy-local-rank", is_flag=True, help="Hand each worker --local_rank=N, as torch.distributed.launch did.")
@click.option("--node-id", default=None, callback=_checked_name("node id"),
              help="This node's id in the job (default: the host name, made unique).")
@click.option("--local-addr", default=None, help="This node's address as other nodes see it.")
@click.option("--etcd-listen", default="0.0.0.0", show_default=True, help="Embedded etcd: address to listen on.")
@click.option("--etcd-port", type=_PORT, default=2379, show_default=True,
              help="Embedded etcd: client port (0: a free port).")
@click.option("--etcd-peer-port", type=_PORT, default=2380, show_default=True,
              help="Embedded etcd: peer port (0: a free port).")
@click.option("--etcd-data-dir", type=click.Path(file_okay=False), default=None,
              help="Embedded etcd: data directory (default: temporary).")
@click.option("-m", "--module", is_flag=True, help="SCRIPT is a Python module name, as with python -m.")
@click.option("--dry-run", is_flag=True, help="Print the torchrun command and exit.")
@click.argument("script", required=False)
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def up(job, nnodes, nproc_per_node, max_restarts, checkpoint_dir, env, node_ttl, rdzv_conf, recovery, legacy_local_rank,
       node_id, local_addr, etcd_listen, etcd_port, etcd_peer_port, etcd_data_dir, module, dry_run, script,
       script_args, **etcd_params) -> None:
    """Start a job (or join it with the same spec): publish it, register, run torchrun.

    Without --etcd, an embedded etcd starts on this host and the line for
    other hosts is printed.
    """
    from elasticctl import launcher
    from elasticctl.embedded_etcd import EmbeddedEtcd, check_listen_host, free_port

    if script is None:
        raise ConfigError("A training SCRIPT is required (on the command line or as 'script' in --config).")
    if nnodes is None:
        raise ConfigError("--nnodes N or MIN:MAX is required (on the command line or in --config).")
    low, high = parse_nnodes(nnodes)
    conf = parse_rdzv_conf(rdzv_conf)
    if recovery is not None:
        conf["recovery"] = recovery
    spec = JobSpec(
        name=job, script=script, script_args=tuple(script_args), min_nodes=low, max_nodes=high,
        nproc_per_node=str(nproc_per_node), max_restarts=max_restarts,
        rdzv_conf=tuple(conf.items()), checkpoint_dir=checkpoint_dir, module=module,
        env=parse_env(env), legacy_local_rank=legacy_local_rank, node_ttl=node_ttl,
    )
    launcher.check_script(spec)

    server = None
    if etcd_params["etcd_endpoints"] is None:
        check_listen_host(etcd_listen)
        if etcd_port == etcd_peer_port != 0:
            raise ConfigError(f"The etcd client and peer ports must differ (both are {etcd_port}).")
        # Chosen now, so that the endpoint (and --dry-run) names the real port.
        etcd_port = etcd_port or free_port(etcd_listen)
        etcd_peer_port = etcd_peer_port or free_port(etcd_listen)
        server = EmbeddedEtcd(
            data_dir=etcd_data_dir, listen_host=etcd_listen, client_port=etcd_port, peer_port=etcd_peer_port,
            advertise_host=None if launcher.is_loopback(etcd_listen) else launcher.primary_address(),
        )
        settings = _settings(etcd_params, server.endpoint)
        _warn_if_exposed(settings, listening=Endpoint(etcd_listen, etcd_port))
    else:
        settings = _settings(etcd_params)
        _warn_if_exposed(settings)
    local_addr = local_addr or launcher.local_address_for(settings.endpoints[0].host)
    if dry_run:
        from elasticctl.node import torchrun_for

        click.echo(launcher.format_command(torchrun_for(spec, settings, etcd_params["key_prefix"], local_addr)))
        return

    try:
        if server is not None:
            _start_embedded(server, job)
        client = connect(settings)
        registry = Registry(client, job, etcd_params["key_prefix"])
        published = registry.publish_spec(spec)
        if published:
            click.echo(f"published job {job} ({spec.nnodes} nodes, script {spec.script})", err=True)
        else:
            click.echo(f"job {job} already runs with this spec: joining it", err=True)
        marker = None
        try:
            marker = _quick_doctor(client, registry, spec, local_addr)
            _run_node(client, registry, spec, local_addr, node_id, hosts_etcd=server is not None)
        except SystemExit:
            raise  # the node ran: its outcome, and the spec stays like that of any run
        except BaseException:
            # Failed before the node could run (a doctor check, registration, lease, a bad
            # setting, Ctrl-C): take back the spec this `up` published, unless a node or a
            # round uses it.
            if published:
                if marker is not None:
                    _ignore_etcd_errors(lambda: registry.release_checkpoint_marker(marker))
                _withdraw_spec(registry, spec)
            raise
    finally:
        if server is not None:
            from elasticctl.embedded_etcd import forget_embedded

            forget_embedded(os.getpid())
            server.stop()


def _start_embedded(server, job: str) -> None:
    from elasticctl.embedded_etcd import remember_embedded

    server.start()
    try:
        remember_embedded(server.endpoint, os.getpid())
    except OSError as exc:
        log.warning("cannot record the embedded etcd for the other commands on this host: %s", exc)
    click.echo(f"Embedded etcd serving at {server.endpoint}. On every other host run:", err=True)
    click.echo(f"  elasticctl join --etcd {server.endpoint} --job {job}", err=True)
    click.echo("The job's etcd lives in this process: when this node stops, the job stops with it "
               "(run `elasticctl etcd` on a dedicated host for a job that must outlive any node).",
               err=True)


@cli.command(context_settings=_FLAT_ENV)
@etcd_options
@click.option("--job", default=None, callback=_checked_name("job name"),
              help="The job to join (default: the only job in etcd).")
@click.option("--wait", "wait_seconds", type=_Seconds(min=0), default=0.0, show_default=True,
              help="Wait this long for the job to be published (nodes started before `up`).")
@click.option("--node-id", default=None, callback=_checked_name("node id"),
              help="This node's id in the job (default: the host name, made unique).")
@click.option("--local-addr", default=None, help="This node's address as other nodes see it.")
@click.option("--dry-run", is_flag=True, help="Print the torchrun command and exit.")
def join(job, wait_seconds, node_id, local_addr, dry_run, **etcd_params) -> None:
    """Join a running job: read its spec from etcd, register, run the same torchrun."""
    from elasticctl import launcher

    settings = _settings(etcd_params)
    _warn_if_exposed(settings)
    client = connect(settings)
    # Nodes may start before `up` published the job: look for it until --wait has passed.
    job = retry(lambda: resolve_job(client, job, etcd_params["key_prefix"]), ConfigError, wait_seconds,
                Backoff(0.5))
    registry = Registry(client, job, etcd_params["key_prefix"])
    spec = registry.read_spec()
    local_addr = local_addr or launcher.local_address_for(settings.endpoints[0].host)
    if dry_run:
        from elasticctl.node import torchrun_for

        launcher.check_script(spec)
        click.echo(launcher.format_command(torchrun_for(spec, settings, etcd_params["key_prefix"], local_addr)))
        return
    _quick_doctor(client, registry, spec, local_addr)
    _run_node(client, registry, spec, local_addr, node_id, hosts_etcd=False)


def _quick_doctor(client, registry: Registry, spec: JobSpec, local_addr: str) -> str | None:
    """The doctor's quick checks before this node registers: warnings are printed, a failure
    refuses the node. Returns the checkpoint marker this node claimed as the job's first, if any."""
    from elasticctl import doctor

    report = doctor.run_checks(settings=client.settings, client=client, etcd_error=None, registry=registry,
                               checkpoint_dir=spec.checkpoint_dir, local_addr=local_addr, quick=True)
    for check in report.checks:
        if check.status is doctor.Status.WARN:
            click.echo(f"elasticctl: warning: doctor {check.name}: {check.detail}; fix: {check.fix}", err=True)
    for check in report.failed[1:]:
        click.echo(f"elasticctl: doctor FAIL {check.name}: {check.detail}; fix: {check.fix}", err=True)
    reason = doctor.refusal(report, spec.name)
    if reason is not None:
        if report.claimed_marker is not None:
            _ignore_etcd_errors(lambda: registry.release_checkpoint_marker(report.claimed_marker))
        raise ConfigError(reason)
    return report.claimed_marker


def _ignore_etcd_errors(action) -> None:
    try:
        action()
    except ElasticctlError as exc:
        log.warning("%s", exc)


def _withdraw_spec(registry: Registry, spec: JobSpec) -> None:
    try:
        if registry.withdraw_spec(spec):
            log.info("withdrew the spec of job %s, which no node runs", spec.name)
    except ElasticctlError as exc:
        log.warning("cannot withdraw the spec of job %s: %s", spec.name, exc)


def _warn_if_exposed(settings: EtcdSettings, listening: Endpoint | None = None) -> None:
    """One line when anyone on the network could read and alter the job through its etcd.

    ``listening`` is where an embedded etcd (plain http, no users) binds: 0.0.0.0 is
    reachable from other hosts whatever address this node uses to reach it.
    """
    from elasticctl.launcher import is_loopback

    if listening is not None:
        exposed = [] if is_loopback(listening.host) else [str(listening)]
    elif settings.protocol == "https" or settings.cacert or settings.user:
        exposed = []
    else:
        exposed = [str(ep) for ep in settings.endpoints if not is_loopback(ep.host)]
    if exposed:
        click.echo(f"elasticctl: warning: etcd at {','.join(exposed)} is reached without TLS or "
                   "authentication; anyone who can reach it can read and alter this job "
                   "(see SECURITY.md).", err=True)


def _run_node(client, registry, spec, local_addr, node_id, hosts_etcd: bool) -> None:
    from elasticctl.node import NodeSession, wait_for_other_nodes

    session = NodeSession(client, registry, spec, local_addr, node_id, echo=lambda m: click.echo(m, err=True))
    outcome = session.run()
    if hosts_etcd:
        # The others need this etcd to stop cleanly; down also clears the job's keys.
        wait_for_other_nodes(registry, session.node_id, timeout=60)
        if session.request == "down":
            registry.delete_job()
    click.echo(f"elasticctl: {outcome.reason}", err=True)
    sys.exit(outcome.code)


# -- doctor ----------------------------------------------------------------------------------

@cli.command(context_settings=_FLAT_ENV)
@etcd_options
@click.option("--job", default=None, callback=_checked_name("job name"),
              help="The job to compare this host with (default: the only job in etcd).")
@click.option("--checkpoint-dir", default=None, help="The checkpoint directory to check (default: the job's).")
@click.option("--local-addr", default=None,
              help="This node's address as other nodes see it (default: what up/join would use).")
@click.option("--deep", is_flag=True, help="Also import torch for its CUDA and NCCL versions (takes seconds).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of the checks.")
def doctor(job, checkpoint_dir, local_addr, deep, as_json, **etcd_params) -> None:
    """Can this host run a node? One line per check; exit status 1 when one fails.

    Checks versions (and that they agree with the job's nodes), GPUs, the network
    interface gloo would use, etcd latency, the clock against etcd's, a free port,
    /dev/shm, and that the checkpoint directory is writable and shared with the other nodes.
    """
    from elasticctl import doctor as checks
    from elasticctl import launcher
    from elasticctl.embedded_etcd import embedded_endpoint
    from elasticctl.job.registry import list_jobs

    settings = client = etcd_error = registry = None
    found: list = []
    endpoints = etcd_params["etcd_endpoints"] or embedded_endpoint()
    if endpoints:
        # A doctor answers quickly: a dead etcd is a failed check, not a 30 s wait.
        settings = dataclasses.replace(_settings(etcd_params, endpoints), retry_timeout=2.0)
        try:
            client = connect(settings, timeout=2.0)
        except ElasticctlError as exc:
            etcd_error = str(exc)[:1].lower() + str(exc)[1:].rstrip(".")
    try:
        if client is not None:
            job_check, job = checks.decide_job(job, list_jobs(client, etcd_params["key_prefix"]))
            found.append(job_check)
            if job is not None:
                registry = Registry(client, job, etcd_params["key_prefix"])
                spec = registry.read_spec()
                if checkpoint_dir is None and spec is not None:
                    checkpoint_dir = spec.checkpoint_dir
        if local_addr is None:
            local_addr = (launcher.local_address_for(settings.endpoints[0].host) if settings
                          else launcher.primary_address())
        report = checks.run_checks(settings=settings, client=client, etcd_error=etcd_error, registry=registry,
                                   checkpoint_dir=checkpoint_dir, local_addr=local_addr, quick=False, deep=deep,
                                   key_prefix=etcd_params["key_prefix"], prepare=False)
    finally:
        if client is not None:
            client.close()
    results = [*found, *report.checks]
    if as_json:
        click.echo(json.dumps([c.to_dict() for c in results], indent=2))
    else:
        for check in results:
            for line in check.lines():
                click.echo(line)
    if any(c.status is checks.Status.FAIL for c in results):
        sys.exit(1)


# -- status / jobs / leave / down -------------------------------------------------------------

@cli.command(context_settings=_FLAT_ENV)
@etcd_options
@click.option("--job", default=None, callback=_checked_name("job name"),
              help="The job (default: the only job in etcd).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.option("--watch", is_flag=True, help="Refresh until interrupted.")
@click.option("--interval", type=_Seconds(0.1, 3600), default=2.0, show_default=True,
              help="Seconds between refreshes with --watch (0.1 to 3600).")
def status(job, as_json, watch, interval, **etcd_params) -> None:
    """The job at a glance, from etcd alone: nodes, round, world size, trainer progress."""
    from elasticctl.status import render

    client = connect(_settings(etcd_params))
    job = resolve_job(client, job, etcd_params["key_prefix"])
    registry = Registry(client, job, etcd_params["key_prefix"])
    while True:
        view = registry.view()
        text = json.dumps(view.to_dict(), indent=2) if as_json else render(view)
        if watch and not as_json:
            click.clear()
        click.echo(text)
        if not watch:
            return
        time.sleep(interval)  # the refresh period the user asked for


class _Since(click.ParamType):
    """--since: seconds ago (a number), or an ISO 8601 time (local time unless it names a zone)."""

    name = "SECONDS|ISO-TIME"

    def convert(self, value, param, ctx):
        if isinstance(value, float):
            return value
        text = str(value).strip()
        try:
            seconds = float(text)
        except ValueError:
            seconds = None
        if seconds is not None:
            if not math.isfinite(seconds) or seconds < 0:
                self.fail(f"{quote(value)} is not a number of seconds ago (0 or more).", param, ctx)
            return time.time() - seconds
        try:
            return datetime.datetime.fromisoformat(text).timestamp()
        except (ValueError, OverflowError, OSError):
            self.fail(f"{quote(value)} is neither a number of seconds ago nor an ISO 8601 time "
                      "(such as 2026-01-31T12:00:00).", param, ctx)


@cli.command(context_settings=_FLAT_ENV)
@etcd_options
@click.option("--job", default=None, callback=_checked_name("job name"),
              help="The job (default: the only job in etcd); a job that is down keeps its history for an hour.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events as they are written, until Ctrl-C.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per event and line.")
@click.option("--since", type=_Since(), default=None,
              help="Only events from this many seconds ago, or from this ISO 8601 time, on.")
def events(job, follow, as_json, since, **etcd_params) -> None:
    """The job's event history: rounds, lost and joining nodes, failures and their verdicts, recoveries."""
    from elasticctl.job.events import event_records, follow_events, render_line
    from elasticctl.job.keys import JobKeys
    from elasticctl.job.records import Event

    client = connect(_settings(etcd_params))
    if job is None:
        job = resolve_job(client, job, etcd_params["key_prefix"])
    keys = JobKeys(job, etcd_params["key_prefix"])
    lock = threading.Lock()
    seen: set[bytes] = set()

    def show(kvs) -> None:
        with lock:
            for key, raw in sorted(kvs):
                if key in seen:
                    continue
                seen.add(key)
                event = Event.from_json(raw)
                if event is None or (since is not None and event.time < since):
                    continue
                click.echo(json.dumps(event.to_dict(), sort_keys=True) if as_json else render_line(event))

    if not follow:
        show(event_records(client, keys))
        return

    watch = follow_events(client, keys, show)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        watch.stop()


@cli.command(context_settings=_FLAT_ENV)
@etcd_options
@click.option("--job", default=None, callback=_checked_name("job name"),
              help="The job (default: the only job in etcd); a job that is down keeps its history for an hour.")
@click.option("--listen", default="127.0.0.1:8080", show_default=True, metavar="HOST:PORT",
              help="Address of the page and /metrics (port 0: a free port). Loopback by default.")
def dashboard(job, listen, **etcd_params) -> None:
    """A read-only live web page of the job (nodes, world size, steps/s, loss, events) and
    Prometheus metrics at /metrics, from etcd alone."""
    from elasticctl.dashboard.server import parse_listen, serve
    from elasticctl.job.keys import JobKeys
    from elasticctl.job.registry import job_has_keys

    host, port = parse_listen(listen)  # before etcd: a typo is reported at once
    client = connect(_settings(etcd_params))
    keys = JobKeys(job, etcd_params["key_prefix"]) if job else None
    if keys is None:
        keys = JobKeys(resolve_job(client, None, etcd_params["key_prefix"]), etcd_params["key_prefix"])
    elif not job_has_keys(client, keys):  # neither running nor a history left
        resolve_job(client, job, etcd_params["key_prefix"])  # raises: names the job and the known ones
    if not logging.getLogger().isEnabledFor(logging.INFO):
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request, once a second
    server = serve(client, keys, host, port)
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"elasticctl: dashboard of job {keys.job} at http://{shown}:{server.port}/ "
               "(metrics at /metrics); Ctrl-C stops it.", err=True)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    try:
        server.serve_forever()  # returns on Ctrl-C (werkzeug catches it) or after shutdown()
    finally:
        server.server_close()
        server.bound_socket.close()
        client.close()


@cli.command(context_settings=_FLAT_ENV)
@etcd_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def jobs(as_json, **etcd_params) -> None:
    """The jobs known to this etcd, with their live node counts."""
    client = connect(_settings(etcd_params))
    known = list_jobs(client, etcd_params["key_prefix"])
    if as_json:
        click.echo(json.dumps([{"job": name, "nodes": count} for name, count in known.items()]))
        return
    if not known:
        click.echo("no jobs")
    for name, count in known.items():
        click.echo(f"{name}\t{count} node{'s' if count != 1 else ''}")


@cli.command(context_settings=_FLAT_ENV)
@etcd_options
@click.option("--job", default=None, callback=_checked_name("job name"),
              help="The job (default: the only job in etcd).")
@click.option("--node", "node_id", default=None, callback=_checked_name("node id"),
              help="The node to remove (default: the one on this host).")
@click.option("--timeout", type=_Seconds(min=0), default=120.0, show_default=True,
              help="Seconds to wait for the node to go.")
@click.option("--no-wait", is_flag=True, help="Ask the node to leave and return at once.")
def leave(job, node_id, timeout, no_wait, **etcd_params) -> None:
    """Scale down by one node: it checkpoints, stops, and the others continue without a restart."""
    # Short retries: the leaving node may be the one whose embedded etcd we talk to.
    client = connect(dataclasses.replace(_settings(etcd_params), retry_timeout=5.0))
    job = resolve_job(client, job, etcd_params["key_prefix"])
    registry = Registry(client, job, etcd_params["key_prefix"])
    nodes = registry.live_nodes()
    if node_id is None:
        host = socket.gethostname()
        local = sorted(n for n, r in nodes.items() if r.get("host") == host)
        if len(local) != 1:
            raise ConfigError(
                f"{len(local)} nodes of job '{job}' run on this host ({', '.join(local) or 'none'}); name one with --node."
            )
        node_id = local[0]
    elif node_id not in nodes:
        raise ConfigError(f"The node '{node_id}' is not in job '{job}' (nodes: {', '.join(sorted(nodes)) or 'none'}).")
    registry.request_leave(node_id)
    if no_wait:
        click.echo(f"asked node {node_id} to leave job {job}")
        return
    try:
        _wait_until(lambda: node_id not in registry.live_nodes(), timeout, f"node {node_id} to leave")
    except EtcdUnavailableError:
        click.echo(f"node {node_id} left job {job}, and the embedded etcd it ran stopped with it")
        return
    click.echo(f"node {node_id} left job {job}")


@cli.command(context_settings=_FLAT_ENV)
@etcd_options
@click.option("--job", default=None, callback=_checked_name("job name"),
              help="The job (default: the only job in etcd).")
@click.option("--timeout", type=_Seconds(min=0), default=120.0, show_default=True,
              help="Seconds to wait for the nodes to stop.")
def down(job, timeout, **etcd_params) -> None:
    """Stop the job on every node (each exits 0) and remove its keys (not its event history)."""
    # Short retries: an embedded etcd may stop with the job, right after its nodes.
    client = connect(dataclasses.replace(_settings(etcd_params), retry_timeout=5.0))
    job = resolve_job(client, job, etcd_params["key_prefix"])
    registry = Registry(client, job, etcd_params["key_prefix"])
    from elasticctl.job.events import EventLog
    from elasticctl.job.records import EventKind

    registry.request_down()
    count = len(registry.live_nodes())
    EventLog(client, registry.keys).record(EventKind.JOB_DOWN, reason=f"elasticctl down: {count} node(s) asked to stop")
    try:
        _wait_until(lambda: not registry.live_nodes(), timeout, f"the {count} nodes of job {job} to stop")
        registry.delete_job()
    except EtcdUnavailableError:
        pass  # the embedded etcd of the `up` node stopped with the job, keys and all
    click.echo(f"job {job} is down ({count} node{'s' if count != 1 else ''} stopped)")


def _wait_until(done, timeout: float, what: str) -> None:
    if not poll(done, timeout, Backoff(0.5)):
        raise ElasticctlError(f"Timed out after {timeout:g} s waiting for {what}.")


def main(argv: list[str] | None = None) -> None:
    """The ``elasticctl`` entry point (``argv``: the arguments, default sys.argv[1:])."""
    try:
        cli.main(args=argv, prog_name="elasticctl", standalone_mode=False)
    except click.exceptions.Abort:
        _fail("aborted.", 130)
    except click.ClickException as exc:
        # One line, like every other error; `--help` has the usage.
        _fail(exc.format_message().replace("\n", " "), exc.exit_code)
    except ElasticctlError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        _fail("interrupted.", 130)


if __name__ == "__main__":
    main()
