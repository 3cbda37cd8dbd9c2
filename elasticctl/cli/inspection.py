"""The commands that look at jobs: ``doctor``, ``status``, ``events``, ``dashboard``, ``jobs``."""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import signal
import sys
import threading
import time

import click
from click.core import ParameterSource

from elasticctl.cli.options import _FLAT_ENV, _checked_name, _Seconds, _settings, etcd_options
from elasticctl.errors import ElasticctlError
from elasticctl.etcd.client import connect
from elasticctl.job.registry import Registry, list_jobs, resolve_job
from elasticctl.job.spec import quote
from elasticctl.numbers import decimal_number


# -- doctor ----------------------------------------------------------------------------------

@click.command(context_settings=_FLAT_ENV)
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
    interface gloo would use, the address this host advertises, etcd latency, the clock
    against etcd's, a free port, /dev/shm, that the checkpoint directory is writable, shared with the other nodes and has
    room for the next checkpoint, that this host has the job's code, and that its GPUs compute.
    """
    from elasticctl import addressing
    from elasticctl import doctor as checks
    from elasticctl.embedded_etcd import embedded_endpoint
    from elasticctl.job.registry import list_jobs

    settings = client = etcd_error = registry = spec = None
    found: list = []
    endpoints = etcd_params["etcd_endpoints"] or embedded_endpoint()
    if endpoints:
        # A doctor answers quickly: a dead etcd is a failed check, not a 30 s wait (unless
        # --connect-timeout asks for longer).
        settings = _settings(etcd_params, endpoints)
        given = click.get_current_context().get_parameter_source("connect_timeout") is not ParameterSource.DEFAULT
        settings = dataclasses.replace(settings, retry_timeout=2.0,
                                       connect_timeout=settings.connect_timeout if given else 2.0)
        try:
            client = connect(settings)
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
            # What up/join would advertise: the source of the route to etcd (an embedded etcd's
            # endpoint is that address itself), or of the default route when no etcd is known.
            local_addr = addressing.advertised_address(None, settings.endpoints[0].host if settings else None).address
        report = checks.run_checks(settings=settings, client=client, etcd_error=etcd_error, registry=registry,
                                   checkpoint_dir=checkpoint_dir, local_addr=local_addr, quick=False, deep=deep,
                                   key_prefix=etcd_params["key_prefix"], prepare=False, spec=spec)
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


# -- status / events / dashboard / jobs ------------------------------------------------------


@click.command(context_settings=_FLAT_ENV)
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
        seconds = decimal_number(text)
        if seconds is not None:
            if seconds < 0:
                self.fail(f"{quote(value)} is not a number of seconds ago (0 or more).", param, ctx)
            return time.time() - seconds
        try:
            return datetime.datetime.fromisoformat(text).timestamp()
        except (ValueError, OverflowError, OSError):
            self.fail(f"{quote(value)} is neither a number of seconds ago nor an ISO 8601 time "
                      "(such as 2026-01-31T12:00:00).", param, ctx)


@click.command(context_settings=_FLAT_ENV)
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

    # Ctrl-C and SIGTERM end it through our own handlers, not KeyboardInterrupt: a process
    # started in the background by a non-interactive shell inherits SIGINT ignored, and Python
    # then installs no KeyboardInterrupt at all (`--follow` ignored Ctrl-C under such a CI).
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    watch = follow_events(client, keys, show)
    try:  # a stop while the watch starts is seen once it has: stop() below then ends its stream
        watch.start()
        while not stop.wait(1.0):
            pass
    finally:
        watch.stop()


@click.command(context_settings=_FLAT_ENV)
@etcd_options
@click.option("--job", default=None, callback=_checked_name("job name"),
              help="Serve this job only (default: every job in etcd, each metric labelled with its job; "
                   "the page shows the only one or lets you pick); a job that is down keeps its history "
                   "for an hour.")
@click.option("--listen", default="127.0.0.1:8080", show_default=True, metavar="HOST:PORT",
              help="Address of the page and /metrics (port 0: a free port). Loopback by default.")
def dashboard(job, listen, **etcd_params) -> None:
    """A read-only live web page of the jobs (nodes, world size, steps/s, loss, events) and
    Prometheus metrics of every job at /metrics, from etcd alone."""
    from elasticctl.dashboard.server import parse_listen, serve
    from elasticctl.job.keys import JobKeys
    from elasticctl.job.registry import job_has_keys

    host, port = parse_listen(listen)  # before etcd: a typo is reported at once
    client = connect(_settings(etcd_params))
    keys = JobKeys(job, etcd_params["key_prefix"]) if job else None
    if keys is not None and not job_has_keys(client, keys):  # neither running nor a history left
        resolve_job(client, job, etcd_params["key_prefix"])  # raises: names the job and the known ones
    if not logging.getLogger().isEnabledFor(logging.INFO):
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request, once a second
    server = serve(client, keys, host, port, key_prefix=etcd_params["key_prefix"])
    shown = f"[{host}]" if ":" in host else host
    what = f"job {keys.job}" if keys else "every job in etcd"
    click.echo(f"elasticctl: dashboard of {what} at http://{shown}:{server.port}/ "
               "(metrics at /metrics); Ctrl-C stops it.", err=True)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    try:
        server.serve_forever()  # returns on Ctrl-C (werkzeug catches it) or after shutdown()
    finally:
        server.server_close()
        server.bound_socket.close()
        client.close()


@click.command(context_settings=_FLAT_ENV)
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
