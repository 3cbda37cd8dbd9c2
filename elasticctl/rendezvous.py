"""The ``etcd3`` rendezvous for torchrun: torch's dynamic rendezvous on the etcd v3 API.

torch ships ``etcd`` and ``etcd-v2`` backends that speak etcd's v2 API, which etcd
3.5 hides and 3.6 removed. This module provides the pieces torch's
``DynamicRendezvousHandler`` needs, on v3:

* :class:`EtcdRendezvousBackend`: the rendezvous state under one key, with the
  fencing token mapped onto the key's ``mod_revision`` (compare-and-swap in one
  transaction);
* :class:`EtcdStore`: a c10d ``Store`` for the agents' bookkeeping;
* :func:`handler_factory`: the ``torchrun.handlers`` entry point.

Keys live under ``<key_prefix>/<run_id>/`` and are bound to a lease, so an
abandoned run's keys disappear after ``ttl`` seconds instead of piling up.

torch unpickles the state it reads, so whoever can write to etcd could run code
on every agent. The state is therefore always checksummed, and HMAC-signed when
a job secret is configured; unsigned or altered state is refused.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    RendezvousTimeout,
    Token,
)

from elasticctl.errors import ConfigError, ElasticctlError, EtcdUnavailableError
from elasticctl.etcd import EtcdClient, EtcdSettings, connect
from elasticctl.registry import DEFAULT_KEY_PREFIX, DEFAULT_NODE_TTL, Registry, job_prefix

log = logging.getLogger(__name__)

BACKEND_NAME = "etcd3"
DEFAULT_TTL = 7200
SECRET_ENV = "ELASTICCTL_RDZV_SECRET"
PASSWORD_ENV = "ELASTICCTL_ETCD_PASSWORD"

_STATE_MAGIC = b"elasticctl-rdzv/1\n"
_CHECKSUM = b"sha256"
_SIGNATURE = b"hmac-sha256"


class RunLease:
    """The lease a run's keys are bound to, so that an abandoned run's keys expire.

    Renewed when used rather than by a thread: a key outlives the last write of the
    last live writer by between ``ttl / 2`` and ``ttl`` seconds. Rendezvous
    heartbeats rewrite the state every few seconds, so a live run never expires.
    """

    def __init__(self, client: EtcdClient, ttl: int) -> None:
        if ttl < 2:
            raise ConfigError(f"The rendezvous key ttl ({ttl}) must be at least 2 seconds.")
        self._client = client
        self._ttl = ttl
        self._lock = threading.Lock()
        self._id: int | None = None
        self._renewed_at = 0.0

    def id(self) -> int:
        with self._lock:
            now = time.monotonic()
            if self._id is not None and now - self._renewed_at > self._ttl / 2:
                if self._client.refresh_lease(self._id) <= 0:
                    self._id = None
                self._renewed_at = now
            if self._id is None:
                self._id = self._client.grant_lease(self._ttl)
                self._renewed_at = now
            return self._id

    def forget(self) -> None:
        """Drop a lease etcd no longer knows (it expired while we were away)."""
        with self._lock:
            self._id = None


def _with_lease(lease: RunLease, op: Callable[[int], object]):
    """Run a write bound to the run lease, re-granting the lease once if etcd lost it."""
    try:
        return op(lease.id())
    except ElasticctlError as exc:
        if "lease not found" not in str(exc):
            raise
        lease.forget()
        return op(lease.id())


def seal_state(state: bytes, secret: bytes | None) -> bytes:
    """Wrap encoded state with a checksum, or an HMAC when a secret is configured."""
    if secret:
        tag = _SIGNATURE + b":" + hmac.new(secret, state, hashlib.sha256).hexdigest().encode()
    else:
        tag = _CHECKSUM + b":" + hashlib.sha256(state).hexdigest().encode()
    return _STATE_MAGIC + tag + b"\n" + state


def open_state(sealed: bytes, secret: bytes | None, where: str) -> bytes:
    """Return the state inside ``sealed``; raise RendezvousStateError unless it is intact and trusted."""
    if not sealed.startswith(_STATE_MAGIC) or b"\n" not in sealed[len(_STATE_MAGIC):]:
        raise RendezvousStateError(f"The rendezvous state at '{where}' is corrupt or was not written by elasticctl.")
    tag, _, state = sealed[len(_STATE_MAGIC):].partition(b"\n")
    kind, _, digest = tag.partition(b":")
    if kind == _SIGNATURE:
        if not secret:
            raise RendezvousStateError(
                f"The rendezvous state at '{where}' is signed, but this node has no secret ({SECRET_ENV})."
            )
        expected = hmac.new(secret, state, hashlib.sha256).hexdigest().encode()
    elif kind == _CHECKSUM:
        if secret:
            raise RendezvousStateError(
                f"The rendezvous state at '{where}' is not signed, and this node requires a signature."
            )
        expected = hashlib.sha256(state).hexdigest().encode()
    else:
        raise RendezvousStateError(f"The rendezvous state at '{where}' has an unknown integrity tag.")
    if not hmac.compare_digest(digest, expected):
        raise RendezvousStateError(
            f"The rendezvous state at '{where}' failed its integrity check (altered, or a different secret)."
        )
    return state


class EtcdRendezvousBackend(RendezvousBackend):
    """Holds torch's rendezvous state in one etcd v3 key.

    The fencing token is the key's ``mod_revision``. ``set_state`` is one etcd
    transaction: compare the revision (or absence, for ``token=None``), put on
    success, read the current value on failure.

    Args:
        client: the etcd client.
        run_id: the rendezvous id (torchrun's ``--rdzv-id``).
        key_prefix: the prefix under which every run has its own keys.
        lease: the run lease the state key is bound to.
        secret: when set, state is HMAC-signed and unsigned state refused.
    """

    def __init__(
        self,
        client: EtcdClient,
        run_id: str,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        lease: RunLease | None = None,
        secret: bytes | None = None,
    ) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._client = client
        self._key = job_prefix(key_prefix, run_id) + "/rdzv"
        self._lease = lease or RunLease(client, DEFAULT_TTL)
        self._secret = secret or None

    @property
    def name(self) -> str:
        return BACKEND_NAME

    @property
    def key(self) -> str:
        return self._key

    @property
    def client(self) -> EtcdClient:
        return self._client

    @property
    def lease(self) -> RunLease:
        return self._lease

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class."""
        try:
            kv = self._client.get(self._key)
        except ElasticctlError as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        if kv is None:
            return None
        return open_state(kv.value, self._secret, self._key), kv.mod_revision

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        """See base class."""
        if token is None:
            expected_revision = 0
        else:
            try:
                expected_revision = int(token)
            except (TypeError, ValueError):
                # A token we never issued cannot match: report the current state.
                result = self.get_state()
                return None if result is None else (*result, False)
            if expected_revision <= 0:
                result = self.get_state()
                return None if result is None else (*result, False)

        sealed = seal_state(state, self._secret)
        try:
            succeeded, kv, _ = _with_lease(
                self._lease,
                lambda lease_id: self._client.compare_and_swap(self._key, sealed, expected_revision, lease_id),
            )
        except ElasticctlError as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        if kv is None:
            return None
        if succeeded:
            return state, kv.mod_revision, True
        return open_state(kv.value, self._secret, self._key), kv.mod_revision, False


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdStore(dist.Store):
    """A c10d ``Store`` over etcd v3, for the agents' bookkeeping at each rendezvous round.

    Blocking reads poll with a short backoff rather than watch: pyetcd's watch
    streams do not survive a failover between etcd members, polling does.
    """

    _POLL_START = 0.005
    _POLL_MAX = 0.1

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        lease: RunLease | None = None,
        timeout: datetime.timedelta | None = None,
    ) -> None:
        super().__init__()  # required by the pybind trampoline
        self._client = client
        self._prefix = prefix.rstrip("/").encode() + b"/"
        self._lease = lease or RunLease(client, DEFAULT_TTL)
        if timeout is not None:
            self.set_timeout(timeout)

    def _key(self, key: str) -> bytes:
        return self._prefix + key.encode()

    def _put(self, key: str, value: bytes) -> None:
        _with_lease(self._lease, lambda lease_id: self._client.put(self._key(key), value, lease_id))

    def set(self, key: str, value: str | bytes) -> None:
        self._put(key, _as_bytes(value))

    def get(self, key: str) -> bytes:
        """Return the value of ``key``, waiting up to the store timeout for it to appear."""
        return self._wait_for(key, self.timeout).value

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the decimal integer at ``key`` (0 when absent).

        A compare-and-swap loop on the key's revision. Caveat: a swap whose answer
        was lost to a timeout is retried, so such a rare ambiguous failure can add twice.
        """
        full_key = self._key(key)
        current = self._client.get(full_key)
        while True:
            base = 0 if current is None else int(current.value)
            new_value = str(base + amount).encode()
            revision = 0 if current is None else current.mod_revision
            succeeded, current, _ = _with_lease(
                self._lease,
                lambda lease_id, v=new_value, r=revision: self._client.compare_and_swap(full_key, v, r, lease_id),
            )
            if succeeded:
                return base + amount

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value`` (TCPStore semantics).

        A missing key counts as holding the empty value. Returns the value after the call,
        except that a missing key with a non-empty expectation returns ``expected_value``.
        """
        expected, desired = _as_bytes(expected_value), _as_bytes(desired_value)
        full_key = self._key(key)
        while True:
            current = self._client.get(full_key)
            if current is None and expected:
                return expected
            if current is not None and current.value != expected:
                return current.value
            revision = 0 if current is None else current.mod_revision
            succeeded, _, _ = _with_lease(
                self._lease,
                lambda lease_id, r=revision: self._client.compare_and_swap(full_key, desired, r, lease_id),
            )
            if succeeded:
                return desired
            # Someone changed the key between our read and our write: decide again.

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        """Wait until every key exists, or raise ``DistStoreError`` after ``timeout``."""
        deadline_span = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + deadline_span.total_seconds()
        for key in keys:
            remaining = datetime.timedelta(seconds=max(0.0, deadline - time.monotonic()))
            self._wait_for(key, remaining)

    def check(self, keys: list[str]) -> bool:
        return all(self._client.get(self._key(key)) is not None for key in keys)

    def delete_key(self, key: str) -> bool:
        return self._client.delete(self._key(key))

    def num_keys(self) -> int:
        return self._client.count_prefix(self._prefix)

    # The pybind trampoline looks these two up by their C++ names.
    getNumKeys = num_keys
    deleteKey = delete_key

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def _wait_for(self, key: str, timeout: datetime.timedelta):
        full_key = self._key(key)
        deadline = time.monotonic() + timeout.total_seconds()
        delay = self._POLL_START
        while True:
            kv = self._client.get(full_key)
            if kv is not None:
                return kv
            now = time.monotonic()
            if now >= deadline:
                raise dist.DistStoreError(
                    f"Timed out after {timeout.total_seconds():g} s waiting for key '{key}' in the etcd store."
                )
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 2, self._POLL_MAX)


# -- torchrun integration -----------------------------------------------------------------

_RDZV_TIMEOUT_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout")


def _seconds(params: RendezvousParameters, name: str, default: float) -> float:
    value = params.get(name)
    if value in (None, ""):
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ConfigError(f"The rendezvous option {name} ('{value}') must be a positive number of seconds.")
    return seconds


def settings_from_params(params: RendezvousParameters) -> EtcdSettings:
    """Build etcd connection settings from ``--rdzv-endpoint`` and ``--rdzv-conf``.

    torch's etcd-v2 option names (``ca_cert``, ``ssl_cert``, ``ssl_cert_key``) are
    accepted as aliases so that existing launch lines keep working.
    """

    def option(*names: str) -> str | None:
        for name in names:
            value = params.get(name)
            if value not in (None, ""):
                return str(value)
        return None

    if not params.endpoint:
        raise ConfigError("The etcd3 rendezvous needs --rdzv-endpoint HOST:PORT[,HOST:PORT...].")
    return EtcdSettings.from_string(
        params.endpoint,
        protocol=(option("protocol") or "").lower() or None,
        cacert=option("cacert", "ca_cert"),
        cert=option("cert", "ssl_cert"),
        key=option("key", "ssl_cert_key"),
        user=option("user"),
        password=option("password") or os.environ.get(PASSWORD_ENV) or None,
        read_timeout=_seconds(params, "read_timeout", 5.0),
        retry_timeout=_seconds(params, "retry_timeout", 30.0),
    )


def create_backend(params: RendezvousParameters) -> tuple[EtcdRendezvousBackend, EtcdStore]:
    """Create the backend and store for ``params``, after checking etcd answers.

    Extra ``--rdzv-conf`` keys: protocol, cacert, cert, key, user, password, read_timeout,
    retry_timeout, connect_timeout, key_prefix, ttl, secret.
    """
    settings = settings_from_params(params)
    key_prefix = params.get("key_prefix") or DEFAULT_KEY_PREFIX
    ttl = int(_seconds(params, "ttl", DEFAULT_TTL))
    secret = (params.get("secret") or os.environ.get(SECRET_ENV) or "").encode() or None
    connect_timeout = _seconds(params, "connect_timeout", 10.0)

    try:
        client = connect(settings, connect_timeout)
    except EtcdUnavailableError as exc:
        raise RendezvousConnectionError(
            f"The etcd3 rendezvous cannot reach etcd at {settings.describe()}: {exc.__cause__ or exc}"
        ) from exc
    lease = RunLease(client, ttl)
    prefix = job_prefix(key_prefix, params.run_id)
    backend = EtcdRendezvousBackend(client, params.run_id, key_prefix, lease, secret)
    store = EtcdStore(client, prefix + "/store", lease)
    return backend, store


def _whole(params: RendezvousParameters, key: str, default: int | None, minimum: int) -> int | None:
    value = params.get(key)
    if value in (None, ""):
        return default
    try:
        number = int(value)
        if number < minimum:
            raise ValueError
    except ValueError as exc:
        raise ConfigError(f"The rendezvous option {key} ('{value}') must be a whole number of at least {minimum}.") from exc
    return number


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Create the elasticctl handler (torch's dynamic handler + liveness) on the etcd3 backend.

    Extra ``--rdzv-conf`` keys: node_ttl (seconds a node may be silent, default 5),
    max_restarts (the real restart budget; torch's own counts every failure),
    quarantine_after (counted failures, default 2) within quarantine_window (s, 600)
    put the node aside for quarantine_seconds (60).
    """
    from elasticctl.handler import NODE_ENV, ElasticctlRendezvousHandler

    # torch's shared agent TCPStore deadlocks a scale-up in which the joiner is not
    # rank 0; the etcd store serves the agents instead, and workers build their own.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    for key in _RDZV_TIMEOUT_KEYS:
        _whole(params, key, None, 1)
    node_ttl = _whole(params, "node_ttl", DEFAULT_NODE_TTL, 2)
    max_restarts = _whole(params, "max_restarts", None, 0)
    quarantine_after = _whole(params, "quarantine_after", 2, 1)
    quarantine_window = _seconds(params, "quarantine_window", 600.0)
    quarantine_seconds = _seconds(params, "quarantine_seconds", 60.0)

    backend, store = create_backend(params)
    timeout = RendezvousTimeout(
        *(datetime.timedelta(seconds=int(params.get(f"{key}_timeout")))
          if params.get(f"{key}_timeout") else None for key in ("join", "last_call", "close", "heartbeat"))
    )
    handler = ElasticctlRendezvousHandler.from_backend(
        params.run_id, store, backend, params.min_nodes, params.max_nodes, params.local_addr, timeout,
        keep_alive_interval=_whole(params, "keep_alive_interval", 5, 1),
        keep_alive_max_attempt=_whole(params, "keep_alive_max_attempt", 3, 1),
    )
    registry = Registry(backend.client, params.run_id, params.get("key_prefix") or DEFAULT_KEY_PREFIX)
    return handler.attach(
        backend.client, registry, backend.lease, os.environ.get(NODE_ENV) or None, node_ttl, max_restarts,
        quarantine_after, quarantine_window, quarantine_seconds,
    )


def handler_factory() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: torch calls it once and registers the result."""
    return create_rdzv_handler
