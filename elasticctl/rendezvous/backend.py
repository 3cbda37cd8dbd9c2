"""The ``etcd3`` rendezvous for torchrun, and torch's dynamic rendezvous on the etcd v3 API.

torch ships ``etcd`` and ``etcd-v2`` backends that speak etcd's v2 API, which etcd
3.5 hides and 3.6 removed. This module provides, on v3:

* :func:`create_rdzv_handler`: the ``etcd3`` handler torchrun builds through the
  ``torchrun.handlers`` entry point (:mod:`elasticctl.rendezvous.plugin`): elasticctl's own
  etcd-native protocol, see :mod:`elasticctl.rendezvous.handler`;
* :class:`EtcdStore`: a c10d ``Store`` over etcd, for the agents' bookkeeping in a round;
* :class:`EtcdRendezvousBackend` and :func:`create_backend`: for code that wants torch's
  own ``DynamicRendezvousHandler`` on etcd — the state under one key, the fencing
  token mapped onto the key's ``mod_revision`` (compare-and-swap in one transaction).

Keys live under ``<key_prefix>/<run_id>/`` and are bound to a lease, so an
abandoned run's keys disappear after ``ttl`` seconds instead of piling up.

torch unpickles the state it reads, so whoever can write to etcd could run code
on every agent of torch's handler. Every state is checked by
:mod:`elasticctl.rendezvous.state` (seal, allow-listed classes, shape, sequence) before
torch sees its bytes; a node that meets a refused or replayed state keeps the newest
good state it has seen and writes it back over the bad one.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import logging
import os
import re
import threading
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
    Token,
)

from elasticctl.errors import ConfigError, ElasticctlError, EtcdUnavailableError
from elasticctl.etcd.client import EtcdClient, EtcdSettings, connect
from elasticctl.etcd.retry import Backoff, Deadline, poll
from elasticctl.job.environment import WorkerEnvironment
from elasticctl.job.keys import JobKeys
from elasticctl.job.rdzv_records import StoreRecords, TorchStateRecord
from elasticctl.job.records import run_secret
from elasticctl.job.run_lease import RunLease
from elasticctl.job.settings import (
    DEFAULT_KEY_PREFIX,
    DEFAULT_QUARANTINE_AFTER,
    DEFAULT_RUN_TTL,
    RdzvOptions,
    WorkerSettings,
    parse_rdzv_options,
)
from elasticctl.rendezvous.state import open_state, seal_state
from elasticctl.job.registry import Registry
from elasticctl.job.spec import validate_name

log = logging.getLogger(__name__)

BACKEND_NAME = "etcd3"
DEFAULT_TTL = DEFAULT_RUN_TTL


class EtcdRendezvousBackend(RendezvousBackend):
    """Holds torch's rendezvous state in one etcd v3 key.

    The fencing token is the key's ``mod_revision``. ``set_state`` is one etcd
    transaction: compare the revision (or absence, for ``token=None``), put on
    success, read the current value on failure.

    Every state read is checked (see :mod:`elasticctl.rendezvous.state`) before torch
    unpickles it. A state this node refuses (forged, corrupt) or that is older than
    one it has already seen (replayed, rolled back, deleted) is never handed to
    torch: the newest good state is, with the current token, so that torch's next
    write puts it back. A node that has seen no good state yet raises
    :class:`RendezvousStateError` naming the key.

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
        validate_name(run_id, "run id")
        self._client = client
        self._lease = lease or RunLease(client, DEFAULT_TTL)
        self._record = TorchStateRecord(client, JobKeys(run_id, key_prefix), self._lease)
        self._key = self._record.key
        self._secret = secret or None
        self._lock = threading.Lock()
        self._newest_seq = 0
        self._newest_state: bytes | None = None
        self._refused_revision = 0

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
            kv = self._record.read()
        except ElasticctlError as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        if kv is None:
            with self._lock:
                if self._newest_state is None:
                    return None
            return self._keep_newest("it was deleted", None, 0)
        return self._accept(kv.value, kv.mod_revision)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        """See base class."""
        if token is None:
            expected_revision = 0
        else:
            try:
                expected_revision = int(token)
            except (TypeError, ValueError):
                expected_revision = -1
            if expected_revision <= 0:
                # A token we never issued cannot match: report the current state.
                result = self.get_state()
                return None if result is None else (*result, False)

        with self._lock:
            seq = self._newest_seq + 1
        sealed = seal_state(state, seq, self._secret)
        try:
            succeeded, kv = self._record.swap(sealed, expected_revision)
        except ElasticctlError as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        if succeeded:
            with self._lock:
                self._newest_seq, self._newest_state = seq, state
            return state, kv.mod_revision, True
        if kv is None:
            # Deleted between the compare and the read: the next get_state decides.
            result = self.get_state()
            return None if result is None else (*result, False)
        return *self._accept(kv.value, kv.mod_revision), False

    def _accept(self, sealed: bytes, revision: int) -> tuple[bytes, Token]:
        """The state in ``sealed`` if it is good and not older than what this node saw."""
        try:
            opened = open_state(sealed, self._secret, self._key)
        except RendezvousStateError as exc:
            with self._lock:
                if self._newest_state is None:
                    raise
            return self._keep_newest(str(exc), revision, revision)
        with self._lock:
            if opened.seq < self._newest_seq:
                stale = True
            else:
                stale = False
                self._newest_seq, self._newest_state = opened.seq, opened.state
        if stale:
            return self._keep_newest(
                f"its sequence {opened.seq} is older than {self._newest_seq}, which this node has "
                "seen (replayed or rolled back)", revision, revision)
        return opened.state, revision

    def _keep_newest(self, reason: str, token: Token | None, revision: int) -> tuple[bytes, Token]:
        """Answer with the newest good state, so that torch writes it back over a bad one."""
        with self._lock:
            state, seq = self._newest_state, self._newest_seq
            first_time = revision != self._refused_revision or revision == 0
            self._refused_revision = revision
        if first_time:
            log.warning("Refusing the rendezvous state at '%s' (%s); keeping the newest good state "
                        "this node has seen (sequence %d) and writing it back.", self._key, reason, seq)
        assert state is not None  # callers checked
        return state, token


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdStore(dist.Store):
    """A c10d ``Store`` over etcd v3, for the agents' bookkeeping at each rendezvous round.

    Blocking reads poll with a short backoff rather than watch: pyetcd's watch
    streams do not survive a failover between etcd members, polling does.
    """

    _POLL = Backoff(0.005, 0.1)

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        lease: RunLease | None = None,
        timeout: datetime.timedelta | None = None,
    ) -> None:
        super().__init__()  # required by the pybind trampoline
        self._lease = lease or RunLease(client, DEFAULT_TTL)
        self._records = StoreRecords(client, prefix, self._lease)
        if timeout is not None:
            self.set_timeout(timeout)

    def set(self, key: str, value: str | bytes) -> None:
        self._records.write(key, _as_bytes(value))

    def get(self, key: str) -> bytes:
        """Return the value of ``key``, waiting up to the store timeout for it to appear."""
        return self._wait_for(key, self.timeout).value

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the decimal integer at ``key`` (0 when absent).

        A compare-and-swap loop on the key's revision. Caveat: a swap whose answer
        was lost to a timeout is retried, so such a rare ambiguous failure can add twice.
        """
        current = self._records.read(key)
        while True:
            base = 0 if current is None else int(current.value)
            revision = 0 if current is None else current.mod_revision
            succeeded, current = self._records.swap(key, str(base + amount).encode(), revision)
            if succeeded:
                return base + amount

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value`` (TCPStore semantics).

        A missing key counts as holding the empty value. Returns the value after the call,
        except that a missing key with a non-empty expectation returns ``expected_value``.
        """
        expected, desired = _as_bytes(expected_value), _as_bytes(desired_value)
        while True:
            current = self._records.read(key)
            if current is None and expected:
                return expected
            if current is not None and current.value != expected:
                return current.value
            revision = 0 if current is None else current.mod_revision
            succeeded, _ = self._records.swap(key, desired, revision)
            if succeeded:
                return desired
            # Someone changed the key between our read and our write: decide again.

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        """Wait until every key exists, or raise ``DistStoreError`` after ``timeout``."""
        deadline = Deadline((self.timeout if timeout is None else timeout).total_seconds())
        for key in keys:
            self._wait_for(key, datetime.timedelta(seconds=deadline.remaining()))

    def check(self, keys: list[str]) -> bool:
        return all(self._records.read(key) is not None for key in keys)

    def delete_key(self, key: str) -> bool:
        return self._records.delete(key)

    def num_keys(self) -> int:
        return self._records.count()

    # The pybind trampoline looks these two up by their C++ names.
    getNumKeys = num_keys
    deleteKey = delete_key

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def _wait_for(self, key: str, timeout: datetime.timedelta):
        kv = poll(lambda: self._records.read(key), timeout.total_seconds(), self._POLL)
        if kv is None:
            raise dist.DistStoreError(
                f"Timed out after {timeout.total_seconds():g} s waiting for key '{key}' in the etcd store."
            )
        return kv


# -- torchrun integration -----------------------------------------------------------------

def settings_from_params(params: RendezvousParameters, options: RdzvOptions | None = None,
                         environment: WorkerEnvironment | None = None) -> EtcdSettings:
    """Build etcd connection settings from ``--rdzv-endpoint`` and ``--rdzv-conf`` (the password
    also from the environment the node gave torchrun)."""
    options = options or parse_rdzv_options(params.config)
    environment = environment or WorkerEnvironment.from_env()
    if not params.endpoint:
        raise ConfigError("The etcd3 rendezvous needs --rdzv-endpoint HOST:PORT[,HOST:PORT...].")
    return EtcdSettings.from_string(
        params.endpoint, protocol=options.protocol, cacert=options.cacert, cert=options.cert,
        key=options.key, user=options.user,
        password=options.password or environment.etcd_password or None,
        read_timeout=options.read_timeout, retry_timeout=options.retry_timeout,
        connect_timeout=options.connect_timeout,
    )


def _connect(params: RendezvousParameters, options: RdzvOptions, environment: WorkerEnvironment) -> EtcdClient:
    settings = settings_from_params(params, options, environment)
    try:
        return connect(settings)
    except EtcdUnavailableError as exc:
        raise RendezvousConnectionError(
            f"The etcd3 rendezvous cannot reach etcd at {settings.describe()}: {exc.__cause__ or exc}"
        ) from exc


def create_backend(
    params: RendezvousParameters, options: RdzvOptions | None = None
) -> tuple[EtcdRendezvousBackend, EtcdStore]:
    """Create the backend and store for ``params``, after checking etcd answers.

    The ``--rdzv-conf`` options are those of :class:`elasticctl.job.settings.RdzvOptions`.
    """
    options = options or parse_rdzv_options(params.config)
    validate_name(params.run_id, "run id")
    environment = WorkerEnvironment.from_env()
    secret = run_secret((options.secret or environment.rdzv_secret).encode() or None, options.run)
    client = _connect(params, options, environment)
    lease = RunLease(client, options.ttl)
    backend = EtcdRendezvousBackend(client, params.run_id, options.key_prefix, lease, secret)
    store = EtcdStore(client, JobKeys(params.run_id, options.key_prefix).store(), lease)
    return backend, store


_handlers_made = itertools.count()


def _default_node_id(local_addr: str) -> str:
    """address-pid-n: unique per handler even with several in one process (tests, benchmarks)."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", local_addr).strip("-_.")[:40] or "node"
    return f"{host}-{os.getpid()}-{next(_handlers_made)}"


def _log_with_times() -> None:
    """Show the handler's INFO lines, timestamped, in the agent's log: a node's log is the
    timeline of its rounds (torchrun configures only torch's own loggers)."""
    logger = logging.getLogger("elasticctl")
    if logger.handlers or logging.getLogger().handlers:
        return  # the embedding program configured logging itself
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s elasticctl %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Create the ``etcd3`` handler: elasticctl's etcd-native rendezvous (see elasticctl/rendezvous/handler.py).

    Its options, their defaults and ranges are the table's (:mod:`elasticctl.job.options`,
    docs/reference/options.md): node_ttl, the restart budget (max_restarts), quarantine (with
    quarantine_after's default where it applies: see
    :func:`elasticctl.rendezvous.verdicts.quarantine_by_default`), join_timeout and
    last_call_timeout as in torch's dynamic rendezvous, the recovery mode and stragglers.
    Options of torch's other backends and launchers are ignored (``TORCH_ONLY_OPTIONS``).
    """
    import socket

    from elasticctl.rendezvous.handler import EtcdRendezvousHandler
    from elasticctl.rendezvous.rounds import Settings
    from elasticctl.rendezvous.verdicts import quarantine_by_default

    _log_with_times()
    options = parse_rdzv_options(params.config)
    validate_name(params.run_id, "run id")
    if params.min_nodes < 1 or params.max_nodes < params.min_nodes:
        raise ConfigError(
            f"The node counts {params.min_nodes}:{params.max_nodes} must satisfy 1 <= MIN <= MAX."
        )
    local_addr = params.local_addr or socket.getfqdn()
    # What the node gave torchrun, decoded once: the node id, etcd's password, the job's
    # secret, and what the handler hands on to the workers with each start of them.
    environment = WorkerEnvironment.from_env()
    node_id = environment.node or _default_node_id(local_addr)
    validate_name(node_id, "node id")
    # torch's shared agent TCPStore deadlocks a scale-up in which the joiner is not rank 0.
    # This handler never shares it, without TORCH_DISABLE_SHARE_RDZV_TCP_STORE: torch reads
    # that variable only in its own DynamicRendezvousHandler (use_agent_store and
    # next_rendezvous, dynamic_rendezvous.py); the agent asks the handler's use_agent_store
    # (False here: the workers' TCPStore is rank 0's own) and takes MASTER_ADDR/PORT from
    # the RendezvousStoreInfo this handler returns. Setting it would change every c10d
    # handler made later in the process, so it is not set.
    quarantine_after = options.quarantine_after
    if quarantine_after is None and quarantine_by_default(options.max_restarts is not None,
                                                         params.min_nodes, params.max_nodes):
        quarantine_after = DEFAULT_QUARANTINE_AFTER
    client = _connect(params, options, environment)
    registry = Registry(client, params.run_id, options.key_prefix)
    # One lease for the run's shared keys, renewed by every live agent (and worker): they
    # live as long as the job does, and expire ttl seconds after its last process.
    lease = RunLease(client, options.ttl, registry.keys.run_lease).start()
    settings = Settings(min_nodes=params.min_nodes, max_nodes=params.max_nodes,
                        last_call=float(options.last_call_timeout))
    return EtcdRendezvousHandler(
        client=client, run_id=params.run_id, registry=registry, run_lease=lease, node_id=node_id,
        local_addr=local_addr, settings=settings, node_ttl=options.node_ttl,
        join_timeout=float(options.join_timeout), max_restarts=options.max_restarts,
        quarantine_after=quarantine_after, quarantine_window=options.quarantine_window,
        quarantine_seconds=options.quarantine_seconds,
        store_factory=lambda number: EtcdStore(client, registry.keys.store(number), lease),
        secret=run_secret((options.secret or environment.rdzv_secret).encode() or None, options.run),
        # The workers' settings, decided once here: the recovery mode (the handler's too), hot
        # recovery's, and straggler detection's (every worker watches, in either mode).
        worker_environment=dataclasses.replace(
            environment, settings=WorkerSettings.of(options, params.min_nodes, params.max_nodes)),
    )


def handler_factory() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """Kept for code that imports it from here; torchrun uses :mod:`elasticctl.rendezvous.plugin`."""
    return create_rdzv_handler
