"""The dashboard's I/O edge: read the jobs from etcd on every request, serve the page, its JSON
and ``/metrics``. It keeps no state of a job: every answer is one fresh look at etcd, and the
totals it exports are the job's own counters there, so a restarted dashboard goes on where the
last one left off.

One dashboard serves every job on its etcd (each series labelled with its job), or one job
(``--job``). Server: werkzeug, used bare (routing, responses, static files, a threaded WSGI
server; what TensorBoard serves its pages with): robust, no framework, one small dependency
(MarkupSafe). Metrics: prometheus_client's own WSGI app at ``/metrics``, on a custom collector
that reads etcd at each scrape.
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import json
import logging
import socket
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from werkzeug.exceptions import HTTPException
from werkzeug.middleware.dispatcher import DispatcherMiddleware
from werkzeug.middleware.shared_data import SharedDataMiddleware
from werkzeug.routing import Map, Rule
from werkzeug.serving import BaseWSGIServer, make_server
from werkzeug.wrappers import Request, Response

from elasticctl import __version__
from elasticctl.dashboard.model import JobMetrics, Reading, job_metrics, job_view
from elasticctl.errors import ConfigError, ElasticctlError
from elasticctl.etcd.client import EtcdClient
from elasticctl.job.keys import DEFAULT_KEY_PREFIX, JobKeys
from elasticctl.job.records import EventKind
from elasticctl.job.registry import Registry, jobs_to_show
from elasticctl.job.snapshot import Part
from elasticctl.job.spec import JobSpec, quote, whole_number

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"


class JobsReader:
    """Reads what the dashboard shows of its jobs (every job under ``key_prefix``, or the one
    ``job``); times every etcd request in ``latency``."""

    def __init__(self, client: EtcdClient, latency: Histogram, *, job: str | None = None,
                 key_prefix: str = DEFAULT_KEY_PREFIX) -> None:
        self.client = client
        self.job = job  # the one job served (--job), else None: every job
        self.key_prefix = key_prefix
        self._latency = latency

    def _timed(self, request: str, call):
        with self._latency.labels(request).time():
            return call()

    def jobs(self) -> list[str]:
        """The jobs shown now: the one named, or every job with a spec or a history in etcd."""
        if self.job is not None:
            return [self.job]
        return self._timed("range", lambda: jobs_to_show(self.client, self.key_prefix))

    def registry(self, job: str) -> Registry:
        return Registry(self.client, job, self.key_prefix)

    def read(self, job: str) -> Reading:
        registry = self.registry(job)
        snapshot = registry.snapshot(Part.DASHBOARD, self._timed)
        return Reading.of(dataclasses.replace(snapshot, spec=self._spec(registry)), time.time())

    def _spec(self, registry: Registry) -> JobSpec | None:
        # Read apart from the snapshot, whose spec part would fail as a whole on a malformed spec:
        # here that blanks only the metrics that come from the spec, never the page.
        try:
            return self._timed("range", registry.read_spec)
        except ConfigError as exc:
            log.warning("the spec of job %s is unreadable: %s", registry.job, exc)
            return None


def choose_job(asked: str | None, jobs: Sequence[str]) -> str:
    """The job the page shows: the one ``asked`` for (``?job=``), else the only one shown; a
    ConfigError (one sentence) when that is none or several."""
    if asked is not None:
        if asked not in jobs:
            raise ConfigError(f"The job {quote(asked)} is not one this dashboard shows "
                              f"(jobs: {', '.join(jobs) or 'none'}).")
        return asked
    if len(jobs) == 1:
        return jobs[0]
    if not jobs:
        raise ConfigError("There is no job in etcd yet; start one with 'elasticctl up'.")
    raise ConfigError(f"There are {len(jobs)} jobs in etcd ({', '.join(jobs)}); pick one.")


class _Families:
    """One metric family per name, with the samples of every job: Prometheus wants each name once
    per scrape. ``elastic_job``, not ``job``: Prometheus attaches its own ``job`` label (the scrape
    job) to every series and would rename ours to ``exported_job``."""

    def __init__(self) -> None:
        self._families: dict[str, Metric] = {}

    def _family(self, kind, name: str, doc: str, labels: Sequence[str]) -> Metric:
        if name not in self._families:
            self._families[name] = kind(name, doc, labels=["elastic_job", *labels])
        return self._families[name]

    def gauge(self, name: str, doc: str, job: str, value, **labels: str) -> None:
        """A gauge's sample, left out while its value is not known (None)."""
        if value is not None:
            self._family(GaugeMetricFamily, name, doc, labels).add_metric([job, *labels.values()], value)

    def per_label(self, name: str, doc: str, job: str, label: str, values: dict) -> None:
        """A gauge with one series per ``label`` value (a node, a state)."""
        family = self._family(GaugeMetricFamily, name, doc, [label])
        for key, value in sorted(values.items()):
            family.add_metric([job, key], value)

    def counter(self, name: str, doc: str, job: str, value, **labels: str) -> None:
        self._family(CounterMetricFamily, name, doc, labels).add_metric([job, *labels.values()], value)

    def histogram(self, name: str, doc: str, job: str, buckets, total: float) -> None:
        self._family(HistogramMetricFamily, name, doc, []).add_metric(
            [job], [("+Inf" if b == float("inf") else repr(b), c) for b, c in buckets], total)

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._families.values())


def build_info(version: str = __version__) -> GaugeMetricFamily:
    family = GaugeMetricFamily("elasticctl_build_info", "The elasticctl version serving these metrics (value 1).",
                               labels=["version"])
    family.add_metric([version], 1)
    return family


def metric_families(results: Sequence[tuple[str, JobMetrics | None]] | None) -> list[Metric]:
    """The families of ``/metrics`` for each job's metrics (None: the job could not be read);
    ``results`` None: not even the list of jobs could be read."""
    up = "elasticctl_dashboard_etcd_up"
    up_doc = "1 if the dashboard could read the job from etcd at this scrape."
    if results is None:  # which jobs there are is not known: one series without a job
        return [build_info(), GaugeMetricFamily(up, up_doc, value=0)]
    out = _Families()
    for job, metrics in results:
        out.gauge(up, up_doc, job, 0 if metrics is None else 1)
        if metrics is not None:
            _job_families(out, job, metrics)
    return [build_info(), *out]


def _job_families(out: _Families, job: str, m: JobMetrics) -> None:
    out.gauge("elasticctl_world_size", "Nodes training in the current round.", job, m.world_size)
    out.gauge("elasticctl_round", "The current rendezvous round.", job, m.round)
    # The bounds the world size moves within (an alert compares it to MIN: the job cannot train).
    out.gauge("elasticctl_nnodes_min", "The job's --nnodes MIN (from its spec).", job, m.nnodes_min)
    out.gauge("elasticctl_nnodes_max", "The job's --nnodes MAX (from its spec).", job, m.nnodes_max)
    # A finished run trains no step and has no world: the alerts on those stay quiet on it.
    out.gauge("elasticctl_finished_nodes",
              "Nodes whose workers finished the script (member records in state done).", job, m.finished_nodes)
    out.per_label("elasticctl_nodes", "Live nodes by state.", job, "state", m.nodes_by_state)
    # The totals below are the job's counters in etcd, added to as each event is recorded: they
    # never go down while the job's history lives (an hour after its last writer), whatever the
    # bounded history forgets and however often the dashboard restarts.
    out.counter("elasticctl_restarts_spent", "Restarts charged to the job's nodes (failure_judged events).",
                job, m.restarts_spent)
    for kind in EventKind:  # every kind, 0 until it happens: increase() sees the first one
        out.counter("elasticctl_events", "Events recorded in the job's history, by kind.", job,
                    m.counters.count(kind), kind=kind.value)
    # The budget is per node (a node over it stops alone), so what each node spent is a
    # series of its own: an alert can name the node that is about to stop.
    out.gauge("elasticctl_restart_budget", "Restarts each node may spend on its own failures (--max-restarts).",
              job, m.restart_budget)
    out.per_label("elasticctl_node_restarts_spent", "Restarts a live node's own failures spent (its member record).",
                  job, "node", m.node_restarts)
    # A gauge per node while it is named (the newest straggler event since the round formed).
    out.per_label("elasticctl_straggler_ratio",
                  "A live node named a straggler: its own step time over the other nodes' median.",
                  job, "node", m.straggler_ratios)
    out.gauge("elasticctl_stragglers", "Live nodes named stragglers now.", job, len(m.straggler_ratios))
    out.counter("elasticctl_straggler_events", "Nodes named (or evicted as) stragglers: straggler events.",
                job, m.straggler_events)
    # Hosts kept out of the job by an admission check (they never registered: no node series).
    out.counter("elasticctl_node_refused_events",
                "Nodes an admission check refused before they registered: node_refused events.",
                job, m.node_refused_events)
    # Silent corruption: a replica whose parameters left its set's majority (the replica check).
    out.counter("elasticctl_replica_diverged_events",
                "Replicas whose parameters differed from their replicas' majority, or replica sets with no "
                "majority (which stop the job): replica_diverged events.", job, m.replica_diverged_events)
    # NaN or infinite gradients (or a rank's loss), named at the first step of each run of them.
    out.counter("elasticctl_non_finite_events",
                "Runs of steps whose gradients (or a rank's loss) were not finite, each named with the ranks "
                "that produced them: non_finite events.", job, m.non_finite_events)
    # Hot spares: the nodes waiting warm (also elasticctl_nodes{state="spare"}) against the
    # spec's --spares N, so an alert can fire while fewer wait than expected.
    out.gauge("elasticctl_spares", "Hot spares: live nodes waiting warm beside a full world.", job, m.spares)
    out.gauge("elasticctl_spares_expected", "The hot spares the job's spec asks for (--spares N).",
              job, m.spares_expected)
    out.histogram("elasticctl_recovery_seconds", "Seconds each recovery took (recovery_finished events).",
                  job, m.recovery_buckets, m.recovery_seconds)
    out.gauge("elasticctl_steps_per_second", "Training steps per second (last two progress samples).",
              job, m.steps_per_s)
    out.gauge("elasticctl_samples_per_second", "Samples per second, as rank 0 reports it.", job, m.samples_per_s)
    out.gauge("elasticctl_training_step", "The step rank 0 last reported.", job, m.step)
    out.gauge("elasticctl_training_loss", "The loss rank 0 last reported.", job, m.loss)
    out.gauge("elasticctl_last_checkpoint_step", "The step of the newest checkpoint.", job, m.last_checkpoint_step)
    if m.step is not None and m.last_checkpoint_step is not None:
        out.gauge("elasticctl_steps_since_checkpoint", "Steps trained since the newest checkpoint.",
                  job, max(0, m.step - m.last_checkpoint_step))
    out.gauge("elasticctl_last_checkpoint_age_seconds",
              "Seconds since the newest checkpoint was committed (checkpoint_written events).",
              job, m.last_checkpoint_age)
    # A gauge of the newest write: over time, max_over_time/quantile_over_time of it.
    out.gauge("elasticctl_checkpoint_write_seconds", "Seconds the newest checkpoint write took.",
              job, m.checkpoint_write_seconds)
    # The error's kind as a label (disk_full, permission, other; empty while none fail), never
    # its text: a path or a message would make a new series of each. `status` quotes the text.
    out.gauge("elasticctl_checkpoint_failures",
              "Checkpoint writes failed in a row (0: the newest succeeded), by the newest error's kind.",
              job, m.checkpoint_failures, error=m.checkpoint_error.value if m.checkpoint_error else "")
    out.gauge("elasticctl_progress_age_seconds", "Seconds since rank 0 last reported progress.",
              job, m.progress_age)


class JobsCollector(Collector):
    """Prometheus metrics of the jobs ``reader`` shows, read from etcd at each scrape (no state
    between scrapes: the totals are the jobs' counters in etcd)."""

    def __init__(self, reader: JobsReader) -> None:
        self.reader = reader

    def collect(self) -> Iterator[Metric]:
        try:
            jobs = self.reader.jobs()
        except ElasticctlError as exc:
            log.warning("cannot list the jobs in etcd: %s", exc)
            yield from metric_families(None)
            return
        results = []
        for job in jobs:
            try:
                results.append((job, job_metrics(self.reader.read(job))))
            except ElasticctlError as exc:
                log.warning("cannot read job %s from etcd: %s", job, exc)
                results.append((job, None))
        yield from metric_families(results)


class Dashboard:
    """The WSGI application: ``/`` the page, ``/api/job`` its JSON (``?job=``: which job),
    ``/api/jobs`` the jobs shown, ``/metrics`` (prometheus_client's app), ``/static/``.

    ``keys``: the one job to serve (its key prefix too); None: every job under ``key_prefix``.
    """

    def __init__(self, client: EtcdClient, keys: JobKeys | None = None, *,
                 key_prefix: str = DEFAULT_KEY_PREFIX) -> None:
        self.registry = CollectorRegistry()
        latency = Histogram(
            "elasticctl_dashboard_etcd_request_duration_seconds",
            "Latency of the dashboard's own etcd requests.",
            ["request"],
            registry=self.registry,
        )
        self.reader = JobsReader(client, latency, job=keys.job if keys else None,
                                 key_prefix=keys.key_prefix if keys else key_prefix)
        self.registry.register(JobsCollector(self.reader))
        self.routes = Map(
            [
                Rule("/", endpoint="index"),
                Rule("/api/job", endpoint="job"),
                Rule("/api/jobs", endpoint="jobs"),
            ]
        )
        app = DispatcherMiddleware(self._app, {"/metrics": make_wsgi_app(self.registry)})
        self.wsgi = SharedDataMiddleware(app, {"/static": str(STATIC)}, cache=False)

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

    def _job(self, request: Request) -> Response:
        jobs: list[str] = []
        try:
            jobs = self.reader.jobs()
            job = choose_job(request.args.get("job"), jobs)
            body, status = {**job_view(self.reader.read(job)), "jobs": jobs}, 200
        except ConfigError as exc:  # no such job, or none or several to choose from: the page lists them
            body, status = {"error": str(exc), "jobs": jobs}, 404
        except ElasticctlError as exc:  # etcd away: the page says so and polls again
            body, status = {"error": str(exc), "jobs": jobs}, 503
        return _json(body, status)

    def _jobs(self, _request: Request) -> Response:
        try:
            return _json({"jobs": self.reader.jobs()}, 200)
        except ElasticctlError as exc:
            return _json({"error": str(exc)}, 503)


def _json(body: dict, status: int) -> Response:
    return Response(json.dumps(body), status=status, mimetype="application/json",
                    headers={"Cache-Control": "no-store"})


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


def serve(client: EtcdClient, keys: JobKeys | None, host: str, port: int, *,
          key_prefix: str = DEFAULT_KEY_PREFIX) -> BaseWSGIServer:
    """A threaded server on ``host:port`` (not started) of the dashboard of ``keys.job``, or of
    every job under ``key_prefix`` when ``keys`` is None.

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
    server = make_server(host, port, Dashboard(client, keys, key_prefix=key_prefix), threaded=True,
                         fd=sock.fileno())
    server.bound_socket = sock  # keep it open as long as the server: werkzeug uses a dup of its fd
    return server
