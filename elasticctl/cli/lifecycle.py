"""The commands that run and end jobs: ``etcd``, ``up``, ``join``, ``leave``, ``down``."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time

import click
from click.core import ParameterSource

from elasticctl import addressing
from elasticctl.cli.job_file import _load_config
from elasticctl.cli.options import (
    _FLAT_ENV,
    _PORT,
    _checked_name,
    _fail,
    _not_empty,
    _Seconds,
    read_as_usage,
    _settings,
    JOB_SETTING_FLAGS,
    etcd_options,
    job_setting_options,
    param_name,
    TorchrunStyleCommand,
    worker_log_options,
    worker_logs_from,
)
from elasticctl.errors import ConfigError, ElasticctlError, EtcdUnavailableError
from elasticctl.etcd.client import Endpoint, EtcdSettings, connect
from elasticctl.etcd.retry import Backoff, poll, retry
from elasticctl.job import environment
from elasticctl.job.registry import Registry, resolve_job
from elasticctl.job.options import BY_FLAG, BY_NAME, OPTIONS, Home, describe_default, settle, up_defaults
from elasticctl.job.spec import (
    JobSpec,
    parse_env,
    parse_nnodes,
    parse_rdzv_conf,
)

log = logging.getLogger("elasticctl")

# `up` sets these rendezvous options where torch (and elasticctl's handler under plain torchrun)
# would take another default: shown in --help, from the table.
_RDZV_CONF_HELP = (
    "Further rendezvous options k=v,... (docs/reference/options.md); a setting that has a flag may be "
    "given either way, not both with different values. `up` sets "
    + ", ".join(f"{name}={value} (torch: {describe_default(BY_NAME[name], BY_NAME[name].torch_default)})"
                for name, value in up_defaults().items())
    + " unless given.")


@click.command(context_settings=_FLAT_ENV)
@click.option("--data-dir", type=click.Path(file_okay=False), default=None, callback=_not_empty,
              help="Where etcd keeps its data (default: a temporary directory).")
@click.option("--listen", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option("--advertise", default=None, callback=_not_empty, help="Address other hosts use to reach this etcd.")
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


# -- up / join ------------------------------------------------------------------------------

def _known_checks(ctx, param, values: tuple[str, ...]) -> frozenset[str]:
    from elasticctl.doctor import ADMISSION_CHECKS

    unknown = sorted(set(values) - set(ADMISSION_CHECKS))
    if unknown:
        raise click.BadParameter(f"{', '.join(map(repr, unknown))} is not an admission check; the checks are "
                                 f"{', '.join(ADMISSION_CHECKS)}.", ctx, param)
    return frozenset(values)


def _checks_given(ctx, param, values: tuple[str, ...]) -> tuple[str, ...]:
    for value in values:
        if not value.strip():
            raise click.BadParameter("a check is a command to run; this one is empty.", ctx, param)
    return tuple(values)


def admission_options(command):
    """--skip-check and --check, of up and join: each node's own, not the job's (two nodes may
    well run different checks), so they are not in the job's options table or spec."""
    command = click.option(
        "--check", "checks", multiple=True, metavar="CMD", callback=_checks_given,
        help="An admission check of your own (repeatable): CMD runs (no shell) before the node registers, "
             "within 10 s; a status other than 0 refuses the node with its first line of output.")(command)
    return click.option(
        "--skip-check", "skip_checks", multiple=True, metavar="NAME", callback=_known_checks,
        help="Skip the admission check NAME (repeatable): a doctor check's name, e.g. code, devices, "
             "custom (docs/troubleshooting.md#admission-checks).")(command)


@click.command(cls=TorchrunStyleCommand, context_settings={"allow_interspersed_args": False, **_FLAT_ENV})
@click.option("--config", type=click.Path(dir_okay=False), callback=_load_config, is_eager=True, expose_value=False,
              help="A YAML job file; any flag can be set there, and flags override it.")
@etcd_options
@click.option("--job", default="elastic-job", show_default=True, callback=_checked_name("job name"),
              help="The job name (torchrun's --rdzv-id).")
@click.option("--nnodes", default=None, help="Node count: N, or MIN:MAX for an elastic job.  [required]")
@click.option("--nproc-per-node", default="1", show_default=True,
              help="Workers per node: a number, or as torchrun: 'gpu' (one per GPU), 'cpu' (one per CPU), "
                   "'auto' (one per GPU, else one per CPU).")
@click.option("--checkpoint-dir", default=None, callback=_not_empty,
              help=f"Where trainers checkpoint (handed to them as {environment.CHECKPOINT_DIR}).")
@click.option("--env", multiple=True, metavar="NAME=VALUE", help="Environment for the workers of every node (repeatable).")
@click.option("--rdzv-conf", default="", help=_RDZV_CONF_HELP)
@job_setting_options
@click.option("--legacy-local-rank", is_flag=True, help="Hand each worker --local_rank=N, as torch.distributed.launch did.")
@click.option("--node-id", default=None, callback=_checked_name("node id"),
              help="This node's id in the job (default: the host name, made unique).")
@click.option("--local-addr", default=None, callback=_not_empty,
              help="This node's address as other nodes see it (default: the source of this host's route to etcd; "
                   "with the embedded etcd, of its default route).")
@click.option("--etcd-listen", default="0.0.0.0", show_default=True, help="Embedded etcd: address to listen on.")
@click.option("--etcd-port", type=_PORT, default=2379, show_default=True,
              help="Embedded etcd: client port (0: a free port).")
@click.option("--etcd-peer-port", type=_PORT, default=2380, show_default=True,
              help="Embedded etcd: peer port (0: a free port).")
@click.option("--etcd-data-dir", type=click.Path(file_okay=False), default=None, callback=_not_empty,
              help="Embedded etcd: data directory (default: temporary).")
@click.option("-m", "--module", is_flag=True, help="SCRIPT is a Python module name, as with python -m.")
@click.option("--code-hash", default=None, metavar="PATHS", callback=_not_empty,
              help="Files or directories of the job's code, comma-separated: their sha256 goes into the job's "
                   "spec with the script's, and a node whose copy differs is refused (the code check).")
@admission_options
@click.option("--dry-run", is_flag=True, help="Print the torchrun command and exit.")
@worker_log_options
@click.argument("script", required=False)
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def up(job, nnodes, nproc_per_node, checkpoint_dir, env, rdzv_conf, legacy_local_rank, node_id, local_addr,
       etcd_listen, etcd_port, etcd_peer_port, etcd_data_dir, module, code_hash, skip_checks, checks, dry_run,
       script, script_args, **params) -> None:
    """Start a job (or join it with the same spec): publish it, register, run torchrun.

    Without --etcd, an embedded etcd starts on this host and the line for
    other hosts is printed.
    """
    from elasticctl import launcher
    from elasticctl.embedded_etcd import EmbeddedEtcd, check_listen_host, free_port

    worker_logs = worker_logs_from(params)

    with read_as_usage():  # every value is checked here, before anything starts or is published
        if script is None:
            raise ConfigError("A training SCRIPT is required (on the command line or as 'script' in --config).")
        if nnodes is None:
            raise ConfigError("--nnodes N or MIN:MAX is required (on the command line or in --config).")
        low, high = parse_nnodes(nnodes)
        fields, conf = _settled_settings(rdzv_conf, params)
        spec = JobSpec(
            name=job, script=script, script_args=tuple(script_args), min_nodes=low, max_nodes=high,
            nproc_per_node=str(nproc_per_node), rdzv_conf=tuple(conf.items()), checkpoint_dir=checkpoint_dir,
            module=module, env=parse_env(env), legacy_local_rank=legacy_local_rank, **fields,
        )
        launcher.check_script(spec)
        spec = _with_code_digests(spec, code_hash)
        if params["etcd_endpoints"] is None:
            check_listen_host(etcd_listen)
            if etcd_port == etcd_peer_port != 0:
                raise ConfigError(f"The etcd client and peer ports must differ (both are {etcd_port}).")
    for warning in filter(None, [no_checkpoint_warning(spec)]):
        click.echo(f"elasticctl: warning: {warning}", err=True)

    server = None
    if params["etcd_endpoints"] is None:
        # Chosen now, so that the endpoint (and --dry-run) names the real port.
        etcd_port = etcd_port or free_port(etcd_listen)
        etcd_peer_port = etcd_peer_port or free_port(etcd_listen)
        advertised, etcd_host = _embedded_addresses(etcd_listen, local_addr)
        server = EmbeddedEtcd(
            data_dir=etcd_data_dir, listen_host=etcd_listen, client_port=etcd_port, peer_port=etcd_peer_port,
            advertise_host=etcd_host,
        )
        settings = _settings(params, server.endpoint)
        _warn_if_exposed(settings, listening=Endpoint(etcd_listen, etcd_port))
    else:
        settings = _settings(params)
        _warn_if_exposed(settings)
        advertised = addressing.advertised_address(local_addr, settings.endpoints[0].host)
    local_addr = advertised.address
    if dry_run:
        from elasticctl.node import torchrun_for

        click.echo(launcher.format_command(torchrun_for(spec, settings, params["key_prefix"], local_addr,
                                                        worker_logs=worker_logs)))
        return

    # A dry run's output is the command alone (its --local-addr says the address); a node says why.
    click.echo(advertised.line(), err=True)
    try:
        if server is not None:
            _start_embedded(server, job)
        client = connect(settings)
        registry = Registry(client, job, params["key_prefix"])
        published = registry.publish_spec(spec)
        if published:
            click.echo(f"published job {job} ({spec.nnodes} nodes, script {spec.script})", err=True)
        else:
            click.echo(f"job {job} already runs with this spec: joining it", err=True)
        marker = None
        try:
            # Joining a running job: this host's code is compared with the digests its first node
            # recorded (the spec in etcd), not with its own.
            running = None if published else registry.read_spec()
            marker = _quick_doctor(client, registry, running or spec, local_addr, node_id, skip_checks, checks,
                                   record_refusal=not published)
            _run_node(client, registry, spec, local_addr, node_id, hosts_etcd=server is not None,
                      worker_logs=worker_logs)
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


def _embedded_addresses(listen: str, given: str | None) -> tuple[addressing.Advertised, str | None]:
    """What a node whose etcd runs in its own process advertises, and the host in that etcd's
    client URL (the endpoint of the join line; None: etcd's own default, loopback). On a wildcard
    listen address both are this host's address: ``given`` (--local-addr), else the source of
    its default route. On one address, etcd serves only there, so that is its URL's host, and the
    node's address is the source of the route to it (the address itself)."""
    if listen in ("0.0.0.0", "::", ""):
        advertised = addressing.advertised_address(given, None)
        return advertised, None if addressing.is_loopback(advertised.address) else advertised.address
    advertised = addressing.advertised_address(given, listen)
    return advertised, None if addressing.is_loopback(listen) else listen


def _with_code_digests(spec: JobSpec, code_hash: str | None) -> JobSpec:
    """``spec`` with the sha256 of its script (the module's file for -m, found without importing
    it) and of the ``--code-hash`` paths, as this host has them (ConfigError: a path is missing)."""
    from elasticctl.doctor.code import hash_code, hash_file, script_file

    paths = tuple(dict.fromkeys(p.strip() for p in (code_hash or "").split(",") if p.strip()))
    if code_hash is not None and not paths:
        raise ConfigError(f"--code-hash {code_hash!r} names no path; give files or directories, comma-separated.")
    try:
        script_digest = hash_file(script_file(spec.script, spec.module))
        code_digest = hash_code(paths) if paths else None
    except OSError as exc:
        raise ConfigError(f"Cannot hash the job's code: {exc.filename or spec.script}: "
                          f"{exc.strerror or exc}.") from None
    return dataclasses.replace(spec, script_sha256=script_digest, code_paths=paths, code_sha256=code_digest)


def _settled_settings(rdzv_conf: str, params: dict) -> tuple[dict[str, object], dict[str, str]]:
    """The job's settings from its flags and ``--rdzv-conf``, each in its one home: (the spec's
    fields, the spec's rendezvous options). A setting given both ways with different values is a
    usage error naming both (exit 2)."""
    ctx = click.get_current_context()
    given: dict[str, str] = {}
    for flag in JOB_SETTING_FLAGS:
        option, name = BY_FLAG[flag], param_name(BY_FLAG[flag])
        if params[name] is not None and ctx.get_parameter_source(name) is not ParameterSource.DEFAULT:
            given[option.name] = str(params[name])
    try:
        spec_texts, conf = settle(given, parse_rdzv_conf(rdzv_conf))
        fields = {}
        for option in OPTIONS:
            if option.home is Home.SPEC:
                # The flag's value as click read it (its default when neither way gave one), or
                # the rendezvous option's read by the table's parser.
                given_as_option = option.name in spec_texts and option.name not in given
                fields[option.name] = (option.parse(option.name, spec_texts[option.name]) if given_as_option
                                       else params[param_name(option)])
        # The secret's one home is the spec's options or this node's environment, not both.
        secret = environment.rdzv_secret()
        if secret and conf.get("secret", secret) != secret:
            raise ConfigError(f"The rendezvous option secret and {environment.RDZV_SECRET} differ; "
                              "give the job secret once.")
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    return fields, conf


def no_checkpoint_warning(spec: JobSpec) -> str | None:
    """Why a restart-mode job that can change size wants a checkpoint directory: each change
    restarts every worker, and without one they start again from step 0 (None: nothing to say)."""
    from elasticctl.job.options import RecoveryMode

    if spec.checkpoint_dir or spec.min_nodes == spec.max_nodes or spec.options.recovery is not RecoveryMode.RESTART:
        return None
    return (f"the job can change size (--nnodes {spec.nnodes}) in restart mode without --checkpoint-dir: each "
            "node that joins or leaves restarts every worker from step 0; give --checkpoint-dir DIR (on storage "
            "every node sees) unless the script checkpoints itself, or --recovery hot.")


def join_hint(endpoint: str, listen_host: str, job: str) -> list[str]:
    """What `up` with an embedded etcd tells the person at it: the line that adds a node, for the
    hosts that can reach this etcd. Listening on loopback, only this host can (another terminal
    here); other hosts need it to listen on an address they reach."""
    from elasticctl.launcher import is_loopback

    line = f"  elasticctl join --etcd {endpoint} --job {job}"
    if is_loopback(listen_host):
        return [f"Embedded etcd serving at {endpoint}, on loopback: it serves this host only. "
                "For another node on this host, in another terminal run:", line,
                "(For other hosts, start with --etcd-listen 0.0.0.0 or an address they reach.)"]
    return [f"Embedded etcd serving at {endpoint}. On every other host (and for another node on this one) run:",
            line]


def _start_embedded(server, job: str) -> None:
    from elasticctl.embedded_etcd import remember_embedded

    server.start()
    try:
        remember_embedded(server.endpoint, os.getpid())
    except OSError as exc:
        log.warning("cannot record the embedded etcd for the other commands on this host: %s", exc)
    for line in join_hint(server.endpoint, server.listen_host, job):
        click.echo(line, err=True)
    click.echo("The job's etcd lives in this process: when this node stops, the job stops with it "
               "(run `elasticctl etcd` on a dedicated host for a job that must outlive any node).",
               err=True)


@click.command(cls=TorchrunStyleCommand, context_settings=_FLAT_ENV)
@etcd_options
@click.option("--job", default=None, callback=_checked_name("job name"),
              help="The job to join (default: the only job in etcd).")
@click.option("--wait", "wait_seconds", type=_Seconds(min=0), default=0.0, show_default=True,
              help="Wait this long for the job to be published (nodes started before `up`).")
@click.option("--node-id", default=None, callback=_checked_name("node id"),
              help="This node's id in the job (default: the host name, made unique).")
@click.option("--local-addr", default=None, callback=_not_empty,
              help="This node's address as other nodes see it (default: the source of this host's route to etcd; "
                   "with the embedded etcd, of its default route).")
@admission_options
@click.option("--dry-run", is_flag=True, help="Print the torchrun command and exit.")
@worker_log_options
def join(job, wait_seconds, node_id, local_addr, skip_checks, checks, dry_run, **etcd_params) -> None:
    """Join a running job: read its spec from etcd, register, run the same torchrun."""
    from elasticctl import launcher

    worker_logs = worker_logs_from(etcd_params)

    settings = _settings(etcd_params)
    _warn_if_exposed(settings)
    client = connect(settings)
    # Nodes may start before `up` published the job: look for it until --wait has passed.
    job = retry(lambda: resolve_job(client, job, etcd_params["key_prefix"]), ConfigError, wait_seconds,
                Backoff(0.5), on_retry=_Progress(f"job {job} to be published" if job else "a job to be published",
                                                 wait_seconds))
    registry = Registry(client, job, etcd_params["key_prefix"])
    spec = registry.read_spec()
    advertised = addressing.advertised_address(local_addr, settings.endpoints[0].host)
    local_addr = advertised.address
    if dry_run:
        from elasticctl.node import torchrun_for

        launcher.check_script(spec)
        click.echo(launcher.format_command(torchrun_for(spec, settings, etcd_params["key_prefix"], local_addr,
                                                        worker_logs=worker_logs)))
        return
    click.echo(advertised.line(), err=True)
    _quick_doctor(client, registry, spec, local_addr, node_id, skip_checks, checks, record_refusal=True)
    _run_node(client, registry, spec, local_addr, node_id, hosts_etcd=False, worker_logs=worker_logs)


def _quick_doctor(client, registry: Registry, spec: JobSpec, local_addr: str, node_id: str | None = None,
                  skip: frozenset[str] = frozenset(), custom: tuple[str, ...] = (),
                  record_refusal: bool = False) -> str | None:
    """The admission checks (the doctor's quick ones, the code, the devices, ``custom``) before
    this node registers: warnings are printed, a failure refuses the node, and, with
    ``record_refusal`` (a job that other nodes run), is recorded in the job's history as a
    node_refused event. Returns the checkpoint marker this node claimed as the job's first, if any."""
    from elasticctl import doctor

    began = time.monotonic()
    report = doctor.run_checks(settings=client.settings, client=client, etcd_error=None, registry=registry,
                               checkpoint_dir=spec.checkpoint_dir, local_addr=local_addr, quick=True, spec=spec,
                               skip=skip, custom=custom)
    log.debug("admission checks took %.2f s (%s)", time.monotonic() - began,
              ", ".join(f"{name} {seconds:.2f}" for name, seconds in report.seconds))
    for check in report.checks:
        if check.status is doctor.Status.WARN:
            click.echo(f"elasticctl: warning: doctor {check.name}: {check.detail}; fix: {check.fix}", err=True)
    for check in report.failed[1:]:
        click.echo(f"elasticctl: doctor FAIL {check.name}: {check.detail}; fix: {check.fix}", err=True)
    reason = doctor.refusal(report, spec.name)
    if reason is not None:
        if report.claimed_marker is not None:
            _ignore_etcd_errors(lambda: registry.release_checkpoint_marker(report.claimed_marker))
        if record_refusal:
            _record_refusal(client, registry, node_id, report.failed[0].name, reason)
        raise ConfigError(reason)
    return report.claimed_marker


def _record_refusal(client, registry: Registry, node_id: str | None, check: str, reason: str) -> None:
    """A node_refused event in the job's history: the refused node never registers, so this is
    how `status`, `events` and the metrics see it. Best effort, like every event. Not for the
    job's first node, whose spec is withdrawn: there is no job to see it."""
    from elasticctl.job.events import EventLog
    from elasticctl.job.records import EVENT_REASON_MAX, EventKind
    from elasticctl.job.registry import _host_node_id

    host = socket.gethostname()
    text = f"host {host}: check {check}: {reason}"[:EVENT_REASON_MAX]
    EventLog(client, registry.keys).record(EventKind.NODE_REFUSED, node_id or _host_node_id(), reason=text)


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


def _run_node(client, registry, spec, local_addr, node_id, hosts_etcd: bool, worker_logs=None) -> None:
    from elasticctl.launcher import WorkerLogs
    from elasticctl.node import NodeSession, wait_for_other_nodes

    session = NodeSession(client, registry, spec, local_addr, node_id, echo=lambda m: click.echo(m, err=True),
                          worker_logs=worker_logs or WorkerLogs())
    outcome = session.run()
    if hosts_etcd:
        # The others need this etcd to stop cleanly; down also clears the job's keys.
        wait_for_other_nodes(registry, session.node_id, timeout=60)
        if session.request == "down":
            registry.delete_job()
    click.echo(f"elasticctl: {outcome.reason}", err=True)
    sys.exit(outcome.code)


# -- leave / down ----------------------------------------------------------------------------

@click.command(context_settings=_FLAT_ENV)
@etcd_options
@click.option("--job", default=None, callback=_checked_name("job name"),
              help="The job (default: the only job in etcd).")
@click.option("--node", "node_id", default=None, callback=_checked_name("node id"),
              help="The node to remove (default: the one on this host).")
@click.option("--timeout", type=_Seconds(min=0), default=120.0, show_default=True,
              help="Seconds to wait for the node to go.")
@click.option("--no-wait", is_flag=True, help="Ask the node to leave and return at once.")
def leave(job, node_id, timeout, no_wait, **etcd_params) -> None:
    """Scale down by one node: it checkpoints and stops; the others go on without it, in restart mode
    from that checkpoint (restarted, spending no restart), in hot mode in their own processes."""
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


@click.command(context_settings=_FLAT_ENV)
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


# Seconds between two "still waiting" lines of a command that waits (leave, down, join --wait).
PROGRESS_EVERY = 5.0


class _Progress:
    """Says, every PROGRESS_EVERY seconds of a wait, what the command still waits for: called
    with nothing to report on each check, it prints once a period has passed."""

    def __init__(self, what: str, timeout: float) -> None:
        self.what, self.timeout = what, timeout
        self.began = time.monotonic()
        self.next_at = self.began + PROGRESS_EVERY

    def __call__(self, *_ignored) -> None:
        now = time.monotonic()
        if now >= self.next_at:
            self.next_at = now + PROGRESS_EVERY
            click.echo(f"elasticctl: still waiting for {self.what} ({now - self.began:.0f} s of "
                       f"{self.timeout:g} s)", err=True)


def _wait_until(done, timeout: float, what: str) -> None:
    progress = _Progress(what, timeout)

    def check() -> bool:
        progress()
        return bool(done())

    if not poll(check, timeout, Backoff(0.5)):
        raise ElasticctlError(f"Timed out after {timeout:g} s waiting for {what}.")
