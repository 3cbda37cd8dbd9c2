"""The dashboard's I/O edge: read a job from etcd on every request, serve the page, its JSON and
``/metrics``. It keeps no state of the job: every answer is one fresh look at etcd.

Server: werkzeug, used bare (routing, responses, static files, a threaded WSGI server; what
TensorBoard serves its pages with): robust, no framework, one small dependency (MarkupSafe).
Metrics: prometheus_client, with a custom collector that reads etcd on each scrape.
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import json
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from werkzeug.exceptions import HTTPException
from werkzeug.middleware.shared_data import SharedDataMiddleware
from werkzeug.routing import Map, Rule
from werkzeug.serving import BaseWSGIServer, make_server
from werkzeug.wrappers import Request, Response

from elasticctl.dashboard.model import Reading, job_metrics, job_view
from elasticctl.errors import ConfigError, ElasticctlError
from elasticctl.etcd.client import EtcdClient
from elasticctl.job.keys import JobKeys
from elasticctl.job.registry import Registry
from elasticctl.job.snapshot import Part
from elasticctl.job.spec import JobSpec, quote, whole_number

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"


class JobReader:
    """Reads what the dashboard shows of one job; times every etcd request in ``latency``."""

    def __init__(self, client: EtcdClient, keys: JobKeys, latency: Histogram) -> None:
        self.keys = keys
        self.registry = Registry(client, keys.job, keys.key_prefix)
        self._latency = latency

    def _timed(self, request: str, call):
        with self._latency.labels(request).time():
            return call()

    def read(self) -> Reading:
        snapshot = self.registry.snapshot(Part.DASHBOARD, self._timed)
        return Reading.of(dataclasses.replace(snapshot, spec=self._spec()), time.time())

    def _spec(self) -> JobSpec | None:
        # Read apart from the snapshot, whose spec part would fail as a whole on a malformed spec:
        # here that blanks only the metrics that come from the spec, never the page.
        try:
            return self._timed("range", self.registry.read_spec)
        except ConfigError as exc:
            log.warning("the spec of job %s is unreadable: %s", self.keys.job, exc)
            return None


class JobCollector(Collector):
    """Prometheus metrics of one job, read from etcd at each scrape (no state between scrapes)."""

    def __init__(self, reader: JobReader) -> None:
        self.reader = reader

    def collect(self) -> Iterator:
        # `elastic_job`, not `job`: Prometheus attaches its own `job` label (the scrape job) to
        # every series and would rename ours to `exported_job`.
        job = [self.reader.keys.job]
        up = GaugeMetricFamily(
            "elasticctl_dashboard_etcd_up",
            "1 if the dashboard could read the job from etcd at this scrape.",
            labels=["elastic_job"],
        )
        try:
            m = job_metrics(self.reader.read())
        except ElasticctlError as exc:
            log.warning("cannot read job %s from etcd: %s", job[0], exc)
            up.add_metric(job, 0)
            yield up
            return
        up.add_metric(job, 1)
        yield up

        def gauge(name: str, doc: str, value) -> Iterator:
            if value is not None:
                family = GaugeMetricFamily(name, doc, labels=["elastic_job"])
                family.add_metric(job, value)
                yield family

        def per_label(name: str, doc: str, label: str, values: dict) -> GaugeMetricFamily:
            """A gauge with one series per ``label`` value (a node, a state)."""
            family = GaugeMetricFamily(name, doc, labels=["elastic_job", label])
            for key, value in sorted(values.items()):
                family.add_metric([*job, key], value)
            return family

        def counter(name: str, doc: str, value) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["elastic_job"])
            family.add_metric(job, value)
            return family

        yield from gauge(
            "elasticctl_world_size", "Nodes training in the current round.", m.world_size
        )
        yield from gauge("elasticctl_round", "The current rendezvous round.", m.round)
        # The bounds the world size moves within: an alert compares the world size to its MAX.
        yield from gauge(
            "elasticctl_nnodes_min", "The job's --nnodes MIN (from its spec).", m.nnodes_min
        )
        yield from gauge(
            "elasticctl_nnodes_max", "The job's --nnodes MAX (from its spec).", m.nnodes_max
        )
        # A finished run trains no step and has no world: the alerts on those stay quiet on it.
        yield from gauge(
            "elasticctl_finished_nodes",
            "Nodes whose workers finished the script (member records in state done).",
            m.finished_nodes,
        )
        yield per_label("elasticctl_nodes", "Live nodes by state.", "state", m.nodes_by_state)
        # From the event history (failure_judged that charged one): it may drop when the bounded
        # history forgets old events, which Prometheus treats as a counter reset.
        yield counter("elasticctl_restarts_spent", "Restarts charged to the job's nodes.", m.restarts_spent)
        # The budget is per node (a node over it stops alone), so what each node spent is a
        # series of its own: an alert can name the node that is about to stop.
        yield from gauge(
            "elasticctl_restart_budget",
            "Restarts each node may spend on its own failures (--max-restarts).",
            m.restart_budget,
        )
        yield per_label("elasticctl_node_restarts_spent",
                        "Restarts a live node's own failures spent (its member record).", "node", m.node_restarts)
        # A gauge per node while it is named (the newest straggler event since the round formed).
        yield per_label("elasticctl_straggler_ratio",
                        "A live node named a straggler: its own step time over the other nodes' median.",
                        "node", m.straggler_ratios)
        yield counter("elasticctl_straggler_events",
                      "Nodes named (or evicted as) stragglers: straggler events in the history.", m.straggler_events)
        # Hot spares: the nodes waiting warm (also elasticctl_nodes{state="spare"}) against the
        # spec's --spares N, so an alert can fire while fewer wait than expected.
        yield from gauge("elasticctl_spares",
                         "Hot spares: live nodes waiting warm beside a full world.", m.spares)
        yield from gauge("elasticctl_spares_expected",
                         "The hot spares the job's spec asks for (--spares N).", m.spares_expected)
        recoveries = HistogramMetricFamily(
            "elasticctl_recovery_seconds",
            "Seconds each recovery took (recovery_finished events).",
            labels=["elastic_job"],
        )
        recoveries.add_metric(
            job,
            [("+Inf" if b == float("inf") else repr(b), c) for b, c in m.recovery_buckets],
            m.recovery_seconds,
        )
        yield recoveries
        yield from gauge(
            "elasticctl_steps_per_second",
            "Training steps per second (last two progress samples).",
            m.steps_per_s,
        )
        yield from gauge(
            "elasticctl_samples_per_second",
            "Samples per second, as rank 0 reports it.",
            m.samples_per_s,
        )
        yield from gauge("elasticctl_training_step", "The step rank 0 last reported.", m.step)
        yield from gauge("elasticctl_training_loss", "The loss rank 0 last reported.", m.loss)
        yield from gauge(
            "elasticctl_last_checkpoint_step",
            "The step of the newest checkpoint.",
            m.last_checkpoint_step,
        )
        if m.step is not None and m.last_checkpoint_step is not None:
            yield from gauge(
                "elasticctl_steps_since_checkpoint",
                "Steps trained since the newest checkpoint.",
                max(0, m.step - m.last_checkpoint_step),
            )
        yield from gauge(
            "elasticctl_last_checkpoint_age_seconds",
            "Seconds since the newest checkpoint was committed (checkpoint_written events).",
            m.last_checkpoint_age,
        )
        # A gauge of the newest write, not a histogram: the history keeps only the newest 100
        # checkpoint events, so a histogram's count would stop at 100 and its rate() read 0.
        # Over time: max_over_time/quantile_over_time of this gauge.
        yield from gauge(
            "elasticctl_checkpoint_write_seconds",
            "Seconds the newest checkpoint write took.",
            m.checkpoint_write_seconds,
        )
        if m.checkpoint_failures is not None:
            # The error as a label: an alert can quote why ("... failed: the disk is full").
            failing = GaugeMetricFamily(
                "elasticctl_checkpoint_failures",
                "Checkpoint writes failed in a row (0: the newest succeeded), with the newest error.",
                labels=["elastic_job", "error"],
            )
            failing.add_metric([*job, m.checkpoint_error], m.checkpoint_failures)
            yield failing
        yield from gauge(
            "elasticctl_progress_age_seconds",
            "Seconds since rank 0 last reported progress.",
            m.progress_age,
        )


class Dashboard:
    """The WSGI application: ``/`` the page, ``/api/job`` its JSON, ``/metrics``, ``/static/``."""

    def __init__(self, client: EtcdClient, keys: JobKeys) -> None:
        self.registry = CollectorRegistry()
        latency = Histogram(
            "elasticctl_dashboard_etcd_request_duration_seconds",
            "Latency of the dashboard's own etcd requests.",
            ["request"],
            registry=self.registry,
        )
        self.reader = JobReader(client, keys, latency)
        self.registry.register(JobCollector(self.reader))
        self.routes = Map(
            [
                Rule("/", endpoint="index"),
                Rule("/api/job", endpoint="job"),
                Rule("/metrics", endpoint="metrics"),
            ]
        )
        self.wsgi = SharedDataMiddleware(self._app, {"/static": str(STATIC)}, cache=False)

    def __call__(self, environ, start_response):
        return self.wsgi(environ, start_response)

    def _app(self, environ, start_response):
        request = Request(environ)
        try:
            endpoint, _ = self.routes.bind_to_environ(environ).match()
            response = getattr(self, f"_{endpoint}")(request)
        except HTTPException as exc:
            response = exc
        return response(environ, start_response)

    def _index(self, _request: Request) -> Response:
        return Response((STATIC / "index.html").read_bytes(), mimetype="text/html")

    def _job(self, _request: Request) -> Response:
        try:
            body, status = job_view(self.reader.read()), 200
        except ElasticctlError as exc:  # etcd away: the page says so and polls again
            body, status = {"error": str(exc)}, 503
        return Response(
            json.dumps(body),
            status=status,
            mimetype="application/json",
            headers={"Cache-Control": "no-store"},
        )

    def _metrics(self, _request: Request) -> Response:
        return Response(generate_latest(self.registry), mimetype="text/plain; version=0.0.4")


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[V6]:PORT`` for IPv6) with a literal address, or a one-sentence error."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    problem = None
    number = whole_number(port)
    if not sep or not host or number is None or number > 65535:
        problem = "is not HOST:PORT with a port from 0 to 65535"
    else:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            problem = "does not name an IP address (such as 127.0.0.1)"
    if problem:
        raise ConfigError(f"The --listen value {quote(text)} {problem}.")
    return host, number


def serve(client: EtcdClient, keys: JobKeys, host: str, port: int) -> BaseWSGIServer:
    """A threaded server of the dashboard of ``keys.job`` on ``host:port`` (not started).

    The socket is bound here, so a taken port or an address not on this host is one sentence,
    not werkzeug's own message and exit.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        reason = (
            "the port is taken"
            if exc.errno == errno.EADDRINUSE
            else (exc.strerror or str(exc)).lower()
        )
        raise ConfigError(f"Cannot listen on {quote(f'{host}:{port}')}: {reason}.") from exc
    server = make_server(host, port, Dashboard(client, keys), threaded=True, fd=sock.fileno())
    server.bound_socket = sock  # keep it open as long as the server: werkzeug uses a dup of its fd
    return server
