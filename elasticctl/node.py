"""One node of a job: register in etcd, run torchrun, honour leave/down, leave nothing behind.

The node record (``nodes/<id>``) is bound to a lease this process renews, so
``status`` shows exactly the nodes whose elasticctl is alive. The rendezvous
handler inside torchrun does the fast part of leaving (see elasticctl/rendezvous/handler.py); this
process is the backstop: if torchrun has not stopped some seconds after a
request, it is terminated with its workers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import threading
import time

from elasticctl import launcher, processes
from elasticctl.doctor.gather import installed_torch_version
from elasticctl.errors import ElasticctlError
from elasticctl.etcd.client import EtcdClient, EtcdSettings
from elasticctl.etcd.lease import Lease
from elasticctl.etcd.retry import Backoff, poll
from elasticctl.job.events import EventLog
from elasticctl.job import environment
from elasticctl.job.records import EventKind, FailureCause, MemberState, NodeState
from elasticctl.job.options import BY_NAME, number_text
from elasticctl.job.registry import DEFAULT_KEY_PREFIX, Registry, now, request_for
from elasticctl.job.spec import JobSpec
from elasticctl.etcd.watch import WatchedKeys

log = logging.getLogger(__name__)

# How long torchrun may take to stop its workers (final checkpoint) after a request.
STOP_GRACE = 60.0
# How often a live node renews the event history's lease.
HISTORY_RENEWAL = 60.0


@dataclasses.dataclass
class Outcome:
    """How the node ended: the exit code for the shell, and why."""

    code: int
    reason: str


def worker_env(spec: JobSpec, settings: EtcdSettings, node_id: str, key_prefix: str) -> dict[str, str]:
    """What torchrun and the workers get on top of this process's environment: the job's own
    variables, then elasticctl's part (the rendezvous handler adds the rest for the workers)."""
    given = environment.WorkerEnvironment(
        job=spec.name, node=node_id, etcd=settings.urls(), key_prefix=key_prefix,
        etcd_cacert=settings.cacert or "", etcd_cert=settings.cert or "", etcd_key=settings.key or "",
        etcd_user=settings.user or "", etcd_password=settings.password or "",
        checkpoint_dir=os.path.abspath(spec.checkpoint_dir) if spec.checkpoint_dir else "")
    return {**dict(spec.env), **given.to_env()}


def socket_ifname_env(local_addr: str) -> dict[str, str]:
    """Make gloo use the interface of ``--local-addr``.

    gloo otherwise binds to whatever the host name resolves to, often 127.0.0.1 or
    Debian's 127.0.1.1, and tells its peers that address: a multi-host job never forms.
    """
    if launcher.is_loopback(local_addr) or environment.GLOO_SOCKET_IFNAME in os.environ:
        return {}
    interface = launcher.interface_of(local_addr)
    return {environment.GLOO_SOCKET_IFNAME: interface} if interface else {}


def tls_conf(settings: EtcdSettings) -> dict[str, str]:
    """The rendezvous options that make torchrun's handler reach etcd like we do."""
    conf = {"protocol": settings.protocol} if settings.protocol != "http" else {}
    for name in ("cacert", "cert", "key", "user"):
        value = getattr(settings, name)
        if value:
            conf[name] = value
    if settings.connect_timeout != BY_NAME["connect_timeout"].default:
        conf["connect_timeout"] = number_text(settings.connect_timeout)
    return conf


def torchrun_for(spec: JobSpec, settings: EtcdSettings, key_prefix: str, local_addr: str,
                 run: str | None = None, worker_logs: launcher.WorkerLogs = launcher.WorkerLogs()) -> list[str]:
    """The exact torchrun command a node of ``spec`` runs (also what --dry-run prints).

    ``run``: the run's identity (:meth:`Registry.run_identity`), so that records signed in
    another run of the same job are refused."""
    extra = tls_conf(settings)
    if key_prefix != DEFAULT_KEY_PREFIX:
        extra["key_prefix"] = key_prefix
    if run:
        extra["run"] = run
    return launcher.torchrun_command(spec, settings.describe(), local_addr, extra, worker_logs)


class NodeSession:
    """Run this host's part of ``spec`` until the job ends, the node leaves, or it fails."""

    def __init__(self, client: EtcdClient, registry: Registry, spec: JobSpec, local_addr: str,
                 node_id: str | None = None, echo=print,
                 worker_logs: launcher.WorkerLogs = launcher.WorkerLogs()) -> None:
        self.client = client
        self.worker_logs = worker_logs
        self.registry = registry
        self.spec = spec
        self.local_addr = local_addr
        self.wanted_id = node_id
        self.echo = echo
        self.node_id = ""
        self.record: dict = {}
        self._lease: Lease | None = None
        self._request: str | None = None
        self._request_at = 0.0
        self._signals = 0
        self.events = EventLog(client, registry.keys)

    @property
    def request(self) -> str | None:
        """'leave' or 'down' once one was received (from etcd or a signal), else None."""
        return self._request

    def command(self) -> list[str]:
        return torchrun_for(self.spec, self.client.settings, self.registry.key_prefix, self.local_addr,
                            self.registry.run_identity(), self.worker_logs)

    def run(self) -> Outcome:
        launcher.check_script(self.spec)
        command = self.command()
        nproc = launcher.resolve_nproc(self.spec.nproc_per_node)
        self.record = {
            "host": socket.gethostname(), "addr": self.local_addr, "pid": os.getpid(), "nproc": nproc,
            "gpus": launcher.visible_gpu_count(), "joined_at": now(), "state": NodeState.RUNNING,
        }
        torch = installed_torch_version()
        if torch:  # what `doctor` on the other nodes compares with (absent: unknown)
            self.record["torch"] = torch
        self._lease = Lease(self.client, self.spec.node_ttl, name="node lease")
        self._lease.on_regrant(self._rewrite_record)
        self._lease.start()
        try:
            self.node_id = self.registry.register_node(self.record, self._lease.id(), self.wanted_id)
            self.events.record(EventKind.NODE_JOINED, self.node_id,
                               reason=f"host {self.record['host']}, address {self.local_addr}")
            env = {**os.environ, **socket_ifname_env(self.local_addr),
                   **worker_env(self.spec, self.client.settings, self.node_id, self.registry.key_prefix)}
            self.echo(f"node {self.node_id} joins job {self.spec.name}: + {launcher.format_command(command)}")
            outcome = self._supervise(processes.spawn(command, env=env))
            self.events.record(EventKind.NODE_LEFT, self.node_id, reason=f"{outcome.reason} (exit code {outcome.code})")
            return outcome
        finally:
            self._lease.stop(revoke=True)
            if self._request == "leave":
                self._ignore_errors(lambda: self.registry.clear_request(self.node_id))

    def _rewrite_record(self, lease_id: int) -> None:
        if self.node_id:
            self.registry.update_node(self.node_id, self.record, lease_id)

    def _supervise(self, child) -> Outcome:
        def on_signal(signum, _frame) -> None:
            self._signals += 1
            if self._signals == 1 or signum == signal.SIGTERM:
                # Ctrl-C or a preemption notice: leave like `elasticctl leave`.
                if self._request:
                    return
                log.warning("received %s: node %s leaves the job", signal.Signals(signum).name, self.node_id)
                # No etcd call here: the handler may interrupt one on this very thread.
                self._request, self._request_at = "leave", time.monotonic()
                threading.Thread(target=self._announce_leave, daemon=True).start()
            else:
                # A second Ctrl-C means now. Repeated SIGTERMs (Slurm, kubelet) do not
                # cut a final checkpoint short: STOP_GRACE bounds the wait instead.
                processes.terminate(child, timeout=10)

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        requests = self._watch_requests()
        renewed_at = time.monotonic()
        try:
            while True:
                try:
                    code = child.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if time.monotonic() - renewed_at > HISTORY_RENEWAL:
                    renewed_at = time.monotonic()
                    threading.Thread(target=self.events.keep_alive, name="elasticctl-history", daemon=True).start()
                if self._request and time.monotonic() - self._request_at > STOP_GRACE:
                    log.warning("torchrun did not stop within %.0f s of the %s request; terminating it",
                                STOP_GRACE, self._request)
                    processes.terminate(child, timeout=10)
        finally:
            if requests is not None:
                requests.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            processes.terminate(child, timeout=10)
        if code != 0 and not self._request:
            # torchrun may exit on a `down` or `leave` before the last poll saw the request.
            self._poll_request(retry_timeout=2.0)
        return self._outcome(code)

    def _announce_leave(self) -> None:
        """Tell the torchrun handler (it leaves the round) and `status` that this node leaves."""
        self._ignore_errors(lambda: self.registry.request_leave(self.node_id))
        self.record = {**self.record, "state": NodeState.LEAVING}
        self._ignore_errors(lambda: self._rewrite_record(self._lease.id()))

    def _watch_requests(self) -> WatchedKeys | None:
        """leave/down requests for this node, followed by a watch (None if etcd is unreachable now:
        the handler in torchrun follows them too, and the last read after torchrun exits)."""
        def on_change(controls: dict[str, bytes]) -> None:
            request = request_for(controls, self.node_id)
            if request:
                self._note_request(request)

        try:
            return self.registry.watch_requests(on_change)
        except ElasticctlError as exc:
            log.warning("cannot follow requests for node %s: %s", self.node_id, exc)
            return None

    def _poll_request(self, retry_timeout: float | None = None) -> None:
        registry = self.registry
        if retry_timeout is not None:
            quick = EtcdClient(dataclasses.replace(self.client.settings, retry_timeout=retry_timeout))
            registry = Registry(quick, self.registry.job, self.registry.key_prefix)
        try:
            request = registry.requested(self.node_id)
        except ElasticctlError as exc:
            log.warning("cannot read requests for node %s: %s", self.node_id, exc)
            return
        finally:
            if registry is not self.registry:
                registry.client.close()
        if request and not self._request:
            self._note_request(request)

    def _note_request(self, request: str) -> None:
        if not self._request:
            self._request, self._request_at = request, time.monotonic()
            self.record = {**self.record, "state": NodeState.LEAVING}
            self._ignore_errors(lambda: self._rewrite_record(self._lease.id()))

    def _outcome(self, code: int) -> Outcome:
        if self._request:
            verb = "stopped (job down)" if self._request == "down" else "left the job"
            return Outcome(0, f"node {self.node_id} {verb}")
        if code == 0:
            return Outcome(0, f"node {self.node_id}: training finished")
        member = self._ignore_errors(lambda: self.registry.members().get(self.node_id)) or {}
        if member.get("state") == MemberState.FAILED and member.get("cause") == FailureCause.AGENT_CRASHED:
            return Outcome(code, f"node {self.node_id}: its torchrun agent crashed (exit code {code}); "
                                 "its log above says why")
        if member.get("state") == MemberState.FAILED and member.get("reason"):
            return Outcome(code, f"node {self.node_id} stopped: {member['reason']}")
        if member.get("state") == MemberState.FAILED:
            return Outcome(code, f"node {self.node_id} stopped: its workers failed {member.get('restarts')} times, "
                                 f"more than --max-restarts {self.spec.max_restarts}")
        return Outcome(code, f"node {self.node_id}: torchrun exited with code {code}")

    @staticmethod
    def _ignore_errors(action):
        try:
            return action()
        except ElasticctlError as exc:
            log.warning("%s", exc)
            return None


def wait_for_other_nodes(registry: Registry, node_id: str, timeout: float) -> None:
    """Keep an embedded etcd up until the other nodes are gone (they need it to stop cleanly)."""

    def nobody_else() -> bool:
        try:
            return not [n for n in registry.live_nodes() if n != node_id]
        except ElasticctlError:
            return True  # etcd is gone already: nobody needs it

    poll(nobody_else, timeout, Backoff(0.5))

