"""etcd v3 access: endpoint parsing and a client that fails over and rides out blips.

The wire client is ``pyetcd`` (the python-etcd3 API, maintained and protobuf-4
compatible). This module adds what a training job needs on top of it:

* several endpoints with failover, and a bounded retry window, so a restart or a
  leader change of a few seconds is invisible to callers;
* re-authentication when etcd's auth token expires (it does, every 5 minutes by
  default, and ``pyetcd`` never renews it);
* errors that are one sentence naming the endpoints.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import re
import secrets
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import grpc
import pyetcd
from pyetcd import exceptions as etcd_exc

from elasticctl.errors import (
    ConfigError,
    ElasticctlError,
    EtcdRequestError,
    EtcdUnavailableError,
    LeaseNotFoundError,
    quote,
)
from elasticctl.etcd.keepalive import KeepAliveStream
from elasticctl.etcd.retry import Attempts, Backoff, Deadline, retry, retry_until

log = logging.getLogger(__name__)

DEFAULT_PORT = 2379

_T = TypeVar("_T")

# pyetcd's errors after which the same request may succeed on another member or a moment later
# (for one it raised from a grpc error, that error's status decides: see transient()).
_TRANSIENT_ERRORS = (
    etcd_exc.ConnectionFailedError,
    etcd_exc.ConnectionTimeoutError,
    etcd_exc.NoServerAvailableError,
    etcd_exc.InternalServerError,
)

# grpc codes of a request that may succeed a moment later: the member is down or restarting, the
# answer came later than this client waited, or the connection broke mid-call.
_TRANSIENT_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
})

# What etcd says when it could not serve a request now but may a moment later, whatever code it
# sends it with (FAILED_PRECONDITION for "not leader"; RESOURCE_EXHAUSTED for "too many requests",
# a code grpc also uses for a message too large: the text tells them apart).
_TRANSIENT_DETAILS = (
    "etcdserver: request timed out",  # also "..., possibly due to previous leader failure"
    "etcdserver: leader changed",
    "etcdserver: no leader",
    "etcdserver: not leader",
    "etcdserver: too many requests",
    "etcdserver: server stopped",
    "etcdserver: unhealthy cluster",
    # Go's own deadline error, which etcd's LeaseKeepAlive returns as it is, so that grpc sends it
    # as UNKNOWN: etcd answered late, under load; it did not refuse.
    "context deadline exceeded",
)

# Lease ids this client chooses (etcd's are positive int64s; it refuses an id in use).
_MAX_LEASE_ID = 2**63 - 1
_LEASE_EXISTS = "lease already exists"

# Pauses between the attempts of one request: short at first, for a leader change.
_BACKOFF = Backoff(0.05, 1.0)

# How etcd says that a write was bound to a lease it no longer knows (gRPC NOT_FOUND, which
# it also uses for members and alarms).
_LEASE_NOT_FOUND = "lease not found"

# grpc's default reconnect backoff grows to 120 s; an etcd that comes back after a
# blip must be used again within a second.
_GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

_ENDPOINT_RE = re.compile(r"^(?:(?P<scheme>https?)://)?(?P<host>\[[0-9a-fA-F:.]+\]|[^:/\[\]]+)(?::(?P<port>[0-9]{1,5}))?/?$")


@dataclasses.dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_endpoints(text: str) -> tuple[tuple[Endpoint, ...], str | None]:
    """Parse ``"h1:2379,h2:2379"`` (schemes optional) into endpoints and the scheme, if any."""
    endpoints: list[Endpoint] = []
    schemes: set[str] = set()
    for item in (part.strip() for part in text.split(",")):
        match = _ENDPOINT_RE.match(item)
        if not item or match is None:
            raise ConfigError(f"The etcd endpoint {quote(item)} in {quote(text)} is not of the form HOST[:PORT].")
        port = int(match["port"]) if match["port"] else DEFAULT_PORT
        if not 0 < port < 65536:
            raise ConfigError(f"The port of the etcd endpoint {quote(item)} must be between 1 and 65535.")
        if match["scheme"]:
            schemes.add(match["scheme"])
        endpoints.append(Endpoint(match["host"].strip("[]"), port))
    if len(schemes) > 1:
        raise ConfigError(f"The etcd endpoints {quote(text)} mix http and https.")
    return tuple(endpoints), (schemes.pop() if schemes else None)


@dataclasses.dataclass(frozen=True)
class EtcdSettings:
    """How to reach etcd. ``retry_timeout`` bounds how long one operation keeps retrying."""

    endpoints: tuple[Endpoint, ...]
    protocol: str = "http"
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    read_timeout: float = 5.0
    retry_timeout: float = 30.0
    connect_timeout: float = 10.0  # how long :func:`connect` waits for a first answer

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ConfigError("At least one etcd endpoint is required.")
        if self.protocol not in ("http", "https"):
            raise ConfigError(f"The etcd protocol '{self.protocol}' must be http or https.")
        if (self.cert is None) != (self.key is None):
            raise ConfigError("The etcd client certificate and key must be given together.")
        if (self.user is None) != (self.password is None):
            raise ConfigError("The etcd user and password must be given together.")
        for name in ("read_timeout", "retry_timeout", "connect_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"The etcd {name} ({getattr(self, name)}) must be positive.")

    @classmethod
    def from_string(cls, text: str, **options) -> EtcdSettings:
        endpoints, scheme = parse_endpoints(text)
        if scheme and options.get("protocol") in (None, scheme):
            options["protocol"] = scheme
        elif scheme:
            raise ConfigError(f"The etcd endpoints {quote(text)} say {scheme} but the protocol is {options['protocol']}.")
        options = {k: v for k, v in options.items() if v is not None}
        return cls(endpoints=endpoints, **options)

    def describe(self) -> str:
        return ",".join(str(ep) for ep in self.endpoints)

    def urls(self) -> str:
        """The endpoints with their scheme: what another process needs to reach etcd the same way."""
        return ",".join(f"{self.protocol}://{ep}" for ep in self.endpoints)


@dataclasses.dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int
    lease: int
    create_revision: int = 0  # the revision the key was created at (a new one after a delete)


def _kv(value: bytes, meta) -> KeyValue:
    return KeyValue(meta.key, value, meta.mod_revision, meta.lease_id, meta.create_revision)


class EtcdClient:
    """A thread-safe etcd v3 client over one or more endpoints.

    Every method retries transient failures (member down, leader change, timeout)
    across the endpoints until ``settings.retry_timeout`` has passed, then raises
    :class:`EtcdUnavailableError`. A request etcd refuses raises :class:`EtcdRequestError`.
    """

    def __init__(self, settings: EtcdSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._raw: pyetcd.MultiEndpointEtcd3Client | None = None
        # Threads that streaming calls started (pyetcd's watch reader, gRPC's request
        # consumer and channel spinner): close() waits for them, see _streaming.
        self._stream_threads: set[threading.Thread] = set()
        self._keepalive: KeepAliveStream | None = None  # the renewals' stream, opened at the first
        self._keepalive_opening = threading.Lock()

    # -- connection -----------------------------------------------------------------

    def _credentials(self) -> grpc.ChannelCredentials | None:
        s = self.settings
        if s.protocol != "https":
            return None

        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as exc:
                raise ConfigError(f"The etcd TLS file '{path}' cannot be read: {exc.strerror}.") from exc

        return grpc.ssl_channel_credentials(read(s.cacert), read(s.key), read(s.cert))

    def _connect(self) -> pyetcd.MultiEndpointEtcd3Client:
        with self._lock:
            if self._raw is None:
                creds = self._credentials()
                endpoints = [
                    pyetcd.Endpoint(
                        ep.host, ep.port, secure=creds is not None, creds=creds,
                        time_retry=0.5, opts=_GRPC_OPTIONS,
                    )
                    for ep in self.settings.endpoints
                ]
                # Authenticates at construction when a user is set.
                self._raw = pyetcd.MultiEndpointEtcd3Client(
                    endpoints, timeout=self.settings.read_timeout, user=self.settings.user,
                    password=self.settings.password, failover=True,
                )
                if creds is None:
                    # grpc refuses call credentials on plaintext channels; the token
                    # still travels in the metadata pyetcd adds to every call.
                    self._raw.call_credentials = None
            return self._raw

    def _reset(self) -> None:
        with self._lock:
            raw, self._raw = self._raw, None
            keepalive, self._keepalive = self._keepalive, None
        if keepalive is not None:
            keepalive.close()
        if raw is not None:
            raw.close()

    def close(self, timeout: float = 5.0) -> None:
        """Close the channels, and wait up to ``timeout`` s for the threads this client's streams
        started to end: gRPC aborts a fork() while any thread is inside it."""
        with self._lock:
            keepalive = self._keepalive
        self._reset()
        deadline = Deadline(timeout)
        if keepalive is not None:
            keepalive.join(deadline.remaining())
        with self._lock:
            threads, self._stream_threads = self._stream_threads, set()
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(deadline.remaining())

    def _streaming(self, op: Callable[[], _T]) -> _T:
        """Run ``op``, a call that opens a gRPC stream, and remember the threads it started.

        Neither pyetcd nor gRPC hands them out: they are the threads of theirs that appeared
        during the call, by name (pyetcd's ``pyetcd_watch_*``; gRPC's helpers run a function
        ``_run``, so threading names them ``Thread-N (_run)``). Another client's stream opened at
        the same moment may be counted too: joining it costs at most close()'s timeout.
        """
        before = set(threading.enumerate())
        try:
            return op()
        finally:
            started = {t for t in threading.enumerate()
                       if t not in before and (t.name.startswith("pyetcd_watch_") or t.name.endswith("(_run)"))}
            with self._lock:
                self._stream_threads = {t for t in self._stream_threads if t.is_alive()} | started

    def __enter__(self) -> EtcdClient:  # noqa: PYI034 (typing.Self needs Python 3.11)
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _call(self, what: str, op: Callable[[pyetcd.MultiEndpointEtcd3Client], _T], *,
              give_up: Callable[[Attempts], ElasticctlError] | None = None) -> _T:
        """``op`` on the current connection, retried after a transient failure for
        ``retry_timeout``; then ``give_up`` (default: an :class:`EtcdUnavailableError` naming the
        window) is raised. A refusal raises at once."""

        def attempt() -> _T:
            try:
                return op(self._connect())
            except grpc.RpcError as exc:
                details = exc.details() if hasattr(exc, "details") else str(exc)
                if "auth token" in (details or "") and self.settings.user:
                    # The token expired or the member restarted: log in again.
                    self._reset()
                    raise
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    # Raised from the constructor's login, outside pyetcd's error mapping.
                    self._reset()
                    raise
                if transient(exc):
                    raise
                refused = LeaseNotFoundError if _LEASE_NOT_FOUND in (details or "") else EtcdRequestError
                raise refused(f"etcd at {self.settings.describe()} refused to {what}: {details}.") from exc

        # A grpc error that leaves attempt() unconverted is one to retry: transient, or a login
        # to do again.
        return retry_until(
            attempt, lambda exc: isinstance(exc, grpc.RpcError) or transient(exc),
            time.monotonic() + self.settings.retry_timeout,
            _BACKOFF, give_up or (lambda attempts: self._unavailable(what, attempts)),
            on_retry=lambda exc: log.debug("etcd %s failed (%s); retrying", what, _describe(exc)),
        )

    def _unavailable(self, what: str, attempts: Attempts) -> EtcdUnavailableError:
        return EtcdUnavailableError(
            f"etcd at {self.settings.describe()} did not answer ({what}) within "
            f"{self.settings.retry_timeout:g} s: {_describe(attempts.last)}."
        )

    # -- key/value --------------------------------------------------------------------

    def get(self, key: bytes | str) -> KeyValue | None:
        value, meta = self._call("read a key", lambda c: c.get(key))
        return None if meta is None else _kv(value, meta)

    def get_prefix(self, prefix: bytes | str) -> list[KeyValue]:
        return self._call(
            "read keys", lambda c: [_kv(v, m) for v, m in c.get_prefix(prefix, sort_order="ascend")]
        )

    def get_prefix_at(self, prefix: bytes | str) -> tuple[list[KeyValue], int]:
        """The keys under ``prefix`` and the store revision they were read at (to watch from)."""

        def read(c: pyetcd.MultiEndpointEtcd3Client) -> tuple[list[KeyValue], int]:
            response = c.get_prefix_response(prefix)
            kvs = [KeyValue(kv.key, kv.value, kv.mod_revision, kv.lease, kv.create_revision) for kv in response.kvs]
            return kvs, response.header.revision

        return self._call("read keys", read)

    def watch_prefix(self, prefix: bytes | str, start_revision: int):
        """Watch ``prefix`` from ``start_revision``: (iterator of responses, cancel).

        Each response has ``events`` (pyetcd's PutEvent/DeleteEvent: key, value,
        mod_revision, lease) and ``header.revision``. The iterator raises when the
        stream breaks (member gone, revision compacted); the caller re-reads and
        watches again.
        """
        return self._streaming(lambda: self._call(
            "watch keys", lambda c: c.watch_prefix_response(prefix, start_revision=start_revision)
        ))

    def keys_prefix(self, prefix: bytes | str) -> list[bytes]:
        """The keys under ``prefix``, ascending, without their values."""

        def keys(c: pyetcd.MultiEndpointEtcd3Client) -> list[bytes]:
            return [kv.key for kv in c.get_prefix_response(prefix, keys_only=True, sort_order="ascend").kvs]

        return self._call("read keys", keys)

    def count_prefix(self, prefix: bytes | str) -> int:
        def count(c: pyetcd.MultiEndpointEtcd3Client) -> int:
            return c.get_prefix_response(prefix, count_only=True).count

        return self._call("count keys", count)

    def oldest_keys(self, prefix: bytes | str, limit: int) -> list[bytes]:
        """The first ``limit`` keys under ``prefix`` in key order, without their values."""

        def read(c: pyetcd.MultiEndpointEtcd3Client) -> list[bytes]:
            response = c.get_prefix_response(prefix, keys_only=True, limit=limit, sort_order="ascend")
            return [kv.key for kv in response.kvs]

        return self._call("read keys", read)

    def put(self, key: bytes | str, value: bytes | str, lease: int | None = None) -> int:
        """Write a key; returns the new revision."""
        return self._call("write a key", lambda c: c.put(key, value, lease=lease).header.revision)

    def compare_and_swap(
        self, key: bytes | str, value: bytes | str, mod_revision: int, lease: int | None = None,
        also_delete: bytes | str | None = None,
    ) -> tuple[bool, KeyValue | None, int]:
        """Write ``key`` only if its mod revision is ``mod_revision`` (0: only if absent), and
        then delete ``also_delete`` if given.

        One transaction: on failure it returns the current value read atomically.
        Returns (succeeded, current or new key/value, revision of the answer).
        """
        tx = pyetcd.Transactions()

        def txn(c: pyetcd.MultiEndpointEtcd3Client):
            compare = _at_revision(tx, key, mod_revision)
            success = [tx.put(key, value, lease=lease)]
            if also_delete is not None:
                success.append(tx.delete(also_delete))
            return c.transaction(compare=[compare], success=success, failure=[tx.get(key)])

        succeeded, responses = self._call("compare-and-swap a key", txn)
        if succeeded:
            revision = responses[0].response_put.header.revision
            return True, KeyValue(_bytes(key), _bytes(value), revision, lease or 0), revision
        current = responses[0][0] if responses and responses[0] else None
        if current is None:
            return False, None, 0
        return False, _kv(*current), current[1].response_header.revision

    def put_and_compare_and_swap(
        self, key: bytes | str, value: bytes | str, swap_key: bytes | str, swap_value: bytes | str,
        swap_revision: int, lease: int | None = None,
    ) -> tuple[bool, KeyValue | None]:
        """Put ``key``, and ``swap_key`` too if its mod revision is ``swap_revision`` (0: only if
        absent): one transaction, so one raft proposal where a put and a compare-and-swap would
        be two (etcd proposes a transaction that writes whether or not its compare holds).

        Returns (swapped, ``swap_key`` as it is now: the value written, or the one in the way,
        None if absent)."""
        tx = pyetcd.Transactions()

        def txn(c: pyetcd.MultiEndpointEtcd3Client):
            return c.transaction(compare=[_at_revision(tx, swap_key, swap_revision)],
                                 success=[tx.put(key, value, lease=lease), tx.put(swap_key, swap_value, lease=lease)],
                                 failure=[tx.put(key, value, lease=lease), tx.get(swap_key)])

        succeeded, responses = self._call("write a key and compare-and-swap another", txn)
        if succeeded:
            revision = responses[1].response_put.header.revision
            return True, KeyValue(_bytes(swap_key), _bytes(swap_value), revision, lease or 0)
        current = responses[1][0] if len(responses) > 1 and responses[1] else None
        return False, None if current is None else _kv(*current)

    def delete(self, key: bytes | str) -> bool:
        return self._call("delete a key", lambda c: c.delete(key))

    def delete_prefix(self, prefix: bytes | str) -> int:
        return self._call("delete keys", lambda c: c.delete_prefix(prefix).deleted)

    # -- leases ------------------------------------------------------------------------

    def grant_lease(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; its id.

        The id is chosen here, not by etcd, so that trying again is safe: a grant that etcd
        applied but answered too late (a loaded etcd) is found by its retry ("lease already
        exists") and taken, where a second grant would leave a lease nobody renews, and cost a
        raft proposal now and an expiry later, for every such late answer."""
        lease_id = secrets.randbelow(_MAX_LEASE_ID) + 1
        attempts = 0

        def grant(c: pyetcd.MultiEndpointEtcd3Client) -> int:
            nonlocal attempts
            attempts += 1
            try:
                return c.lease(ttl, lease_id=lease_id).id
            except etcd_exc.PreconditionFailedError as exc:
                status = grpc_status(exc)
                if attempts > 1 and status is not None and _LEASE_EXISTS in status[1]:
                    return lease_id  # an earlier attempt of this grant was applied
                raise

        return self._call("grant a lease", grant)

    def refresh_lease(self, lease_id: int, *, until: float | None = None, name: str = "lease") -> int:
        """Renew a lease; returns its new TTL, or 0 when it has already expired.

        A renewal that fails transiently is tried again for ``retry_timeout``, as every request
        is, even past the lease's end as its holder knows it (``until``, on the monotonic clock):
        the answer still says whether etcd kept the lease (a renewal it applied but answered
        late) or dropped it (0: the holder grants another and writes its keys again). Ending the
        holder at its lease's end would turn one slow etcd into a lost node. Should etcd stay
        silent that long, the error is a :class:`LeaseExpiredError` (the lease, called ``name``,
        ended unanswered) once ``until`` has passed, else the usual one.
        """

        def refresh(c: pyetcd.MultiEndpointEtcd3Client) -> int:
            return self._keepalive_on(c).renew(lease_id, self.settings.read_timeout)

        give_up = None
        if until is not None:
            def give_up(attempts: Attempts) -> ElasticctlError:
                if time.monotonic() >= until:
                    return LeaseExpiredError(lease_expired_message(name, lease_id, self.settings.describe(), attempts))
                return self._unavailable("renew a lease", attempts)

        return self._call("renew a lease", refresh, give_up=give_up)

    def _keepalive_on(self, raw: pyetcd.MultiEndpointEtcd3Client) -> KeepAliveStream:
        """The renewals' stream on connection ``raw``: the open one, else a new one (see
        :mod:`elasticctl.etcd.keepalive`)."""
        with self._keepalive_opening:  # one opens it; the others renew on it
            with self._lock:
                current = self._keepalive
            if current is not None and not current.broken and current.raw is raw:
                return current
            opened = self._streaming(lambda: KeepAliveStream(raw))
            with self._lock:
                replaced, self._keepalive = self._keepalive, opened
        if replaced is not None:
            replaced.close()
        return opened

    def lease_ttl(self, lease_id: int) -> tuple[int, int]:
        """A lease's remaining and granted TTL in seconds; (-1, 0) when it has expired."""

        def ask(c: pyetcd.MultiEndpointEtcd3Client) -> tuple[int, int]:
            response = c.get_lease_info(lease_id)
            return response.TTL, response.grantedTTL

        return self._call("report a lease's TTL", ask)

    def revoke_lease(self, lease_id: int) -> None:
        def revoke(c: pyetcd.MultiEndpointEtcd3Client) -> None:
            try:
                c.revoke_lease(lease_id)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise

        self._call("revoke a lease", revoke)

    # -- cluster -----------------------------------------------------------------------

    def server_version(self) -> str:
        """Ask the current member for its status; also a cheap health check."""
        return self._call("report its status", lambda c: c.status().version)

    def member_client_urls(self) -> list[str]:
        return self._call(
            "list its members", lambda c: [url for m in c.members for url in m.client_urls]
        )

    def members(self) -> list[tuple[str, tuple[str, ...]]]:
        """(name, client URLs) of every member of the cluster, as etcd lists them (a member added
        but not started yet has neither)."""
        return self._call(
            "list its members", lambda c: [(m.name, tuple(m.client_urls)) for m in c.members]
        )


@dataclasses.dataclass(frozen=True)
class MemberVersion:
    """One member of the etcd cluster and the server version it reported, as text from the
    network (unvalidated); ``version`` None: it could not be asked, ``error`` says why."""

    name: str
    version: str | None
    error: str | None = None


def member_versions(client: EtcdClient, timeout: float = 2.0) -> list[MemberVersion]:
    """Every member's etcd version, each asked of that member: etcd's Status call answers for
    the member it reaches, so one client per member, at the client URLs it advertises (with
    this client's TLS and credentials), each given ``timeout`` seconds, all at once.

    A single member is the one ``client`` reaches already: no second connection. The other
    members' URLs come from etcd's member list, which only etcd's own configuration (or its
    root user) sets: whoever controls that controls the job already.
    """
    members = client.members()
    if len(members) == 1:
        return [MemberVersion(members[0][0], client.server_version())]

    def ask(name: str, urls: tuple[str, ...]) -> MemberVersion:
        if not urls:
            return MemberVersion(name, None, "it has not started (no client URL)")
        try:
            endpoints, scheme = parse_endpoints(",".join(urls))
            settings = dataclasses.replace(
                client.settings, endpoints=endpoints, protocol=scheme or client.settings.protocol,
                read_timeout=min(client.settings.read_timeout, timeout), retry_timeout=timeout,
            )
        except ConfigError as exc:
            return MemberVersion(name, None, f"its client URLs are unusable: {exc}")
        probe = EtcdClient(settings)
        try:
            return MemberVersion(name, probe.server_version())
        except ElasticctlError as exc:
            return MemberVersion(name, None, str(exc))
        finally:
            probe.close()

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(members)) or 1,
                                               thread_name_prefix="elasticctl-member") as pool:
        return list(pool.map(lambda member: ask(*member), members))


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def _at_revision(tx: pyetcd.Transactions, key: bytes | str, mod_revision: int):
    """The compare of a compare-and-swap: ``key`` is at ``mod_revision`` (0: absent)."""
    return tx.version(key) == 0 if mod_revision == 0 else tx.mod(key) == mod_revision


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The grpc code and details behind ``exc``: its own, or those of the grpc error pyetcd raised
    it from (pyetcd's exceptions keep neither), else None."""
    error = exc.__context__ if isinstance(exc, etcd_exc.Etcd3Exception) else exc
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return error.code(), error.details() or ""
    return None


def transient(exc: BaseException) -> bool:
    """Whether the request that failed with ``exc`` may succeed if sent again a moment later: etcd
    (or the way to it) was down, slow or between leaders, as opposed to a refusal (a lease it no
    longer knows, a permission, a bad argument), which would only be refused again."""
    status = grpc_status(exc)
    if status is not None:
        code, details = status
        return code in _TRANSIENT_CODES or any(text in details for text in _TRANSIENT_DETAILS)
    return isinstance(exc, _TRANSIENT_ERRORS)


class LeaseExpiredError(EtcdUnavailableError):
    """A lease ended, as its holder knows it, while etcd left its renewals unanswered."""


def lease_expired_message(name: str, lease_id: int, endpoints: str, attempts: Attempts) -> str:
    return (f"The {name} {lease_id:x} expired before etcd at {endpoints} answered a renewal: "
            f"{attempts.count} attempt{'s' if attempts.count != 1 else ''} over {attempts.seconds:.1f} s, "
            f"the last: {_describe(attempts.last)}.")


def _describe(exc: BaseException) -> str:
    status = grpc_status(exc)
    if status is not None:
        return f"{status[0].name.lower()}: {status[1]}"
    return str(exc) or type(exc).__name__


def wait_until_healthy(client: EtcdClient, timeout: float) -> str:
    """Block until etcd answers a status request; returns its version."""
    quick = dataclasses.replace(client.settings, retry_timeout=max(0.1, min(timeout, 2.0)))
    probe = EtcdClient(quick)
    try:
        # Each probe retries for up to 2 s itself: ask again at once.
        return retry(probe.server_version, EtcdUnavailableError, timeout, Backoff(0.0))
    finally:
        probe.close()


def connect(settings: EtcdSettings, timeout: float | None = None) -> EtcdClient:
    """A client whose etcd has answered within ``timeout`` seconds (default: the settings'
    ``connect_timeout``), else a one-sentence error."""
    timeout = settings.connect_timeout if timeout is None else timeout
    client = EtcdClient(settings)
    try:
        wait_until_healthy(client, timeout)
    except EtcdUnavailableError as exc:
        client.close()
        raise EtcdUnavailableError(
            f"Cannot reach etcd at {settings.describe()}: no answer within {timeout:g} s (is it running there?)."
        ) from exc
    except ElasticctlError as exc:
        client.close()
        raise EtcdUnavailableError(f"etcd at {settings.describe()} refused the connection: {exc}") from exc
    return client
