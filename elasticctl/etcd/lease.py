"""The one etcd lease type of elasticctl: granted, kept alive, and re-granted once etcd lost it.

Every key a process writes with a lifetime (a node's record, its rendezvous declaration, the
run's shared keys, the event history) is bound to a :class:`Lease`. A lease may be private to
this process, or shared by every process of a job through its id stored at a key
(:func:`find_or_grant`). It is renewed every ``renew_every`` seconds, by a keeper thread once
:meth:`Lease.start` ran, else whenever it is used. When etcd no longer knows it (this process
was frozen, or etcd was away, for longer than the ttl) another is found or granted and the
``on_regrant`` callbacks write again what was bound to the old one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from elasticctl.errors import ConfigError, ElasticctlError, LeaseNotFoundError
from elasticctl.etcd.client import EtcdClient

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# Tries to put a lease id at a shared key while other processes race to put theirs.
_FIND_OR_GRANT_ATTEMPTS = 5


class Lease:
    """A lease of ``ttl`` seconds, private to this process or shared through its id at ``key``.

    ``renew_every`` defaults to ``ttl / 3``: two renewals may fail before the lease ends.
    A shared lease is never revoked by :meth:`stop`: the job's other processes still use it.
    """

    def __init__(self, client: EtcdClient, ttl: int, *, key: str | None = None,
                 renew_every: float | None = None, name: str = "lease") -> None:
        if ttl < 2:
            raise ConfigError(f"The {name} ttl ({ttl}) must be at least 2 seconds.")
        self._client = client
        self._ttl = ttl
        self._key = key
        self.renew_every = renew_every if renew_every is not None else ttl / 3
        self._name = name
        self._lock = threading.Lock()  # held across etcd calls: two users never grant two leases
        self._id: int | None = None
        self._renewed_at = 0.0
        # When the lease ends unless renewed, on the monotonic clock: the last renewal's sending
        # plus the TTL etcd gave (never after the real end, as etcd counts from its receiving).
        self._expires_at = 0.0
        self._regranted: list[Callable[[int], None]] = []
        self._stopped = threading.Event()
        self._keeper: threading.Thread | None = None

    @property
    def ttl(self) -> int:
        return self._ttl

    @property
    def held(self) -> int | None:
        """The lease id in use as this process knows it, without asking etcd (None before the
        first grant); it changes when the lease is found gone and replaced."""
        return self._id  # one attribute read: no lock, which etcd calls may hold for seconds

    def on_regrant(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(new_lease_id)`` whenever the lease is found gone and replaced."""
        self._regranted.append(callback)

    # -- using it ------------------------------------------------------------------------

    def id(self) -> int:
        """The lease id, granted or found on first use; renewed first when that is overdue."""
        lease, lost = self._current(renew_after=self.renew_every)
        self._announce(lost, lease)
        return lease

    def bound(self, write: Callable[[int], _T]) -> _T:
        """``write(lease_id)``, done again on a new lease if etcd no longer knew this one."""
        lease = self.id()
        try:
            return write(lease)
        except LeaseNotFoundError:
            new = self._replace(lease)
        return write(new)

    def put(self, key: str | bytes, value: str | bytes) -> int:
        """Write ``key`` bound to this lease; returns the new revision."""
        return self.bound(lambda lease: self._client.put(key, value, lease=lease))

    def renew(self) -> None:
        """Renew the lease now, replacing it if it is gone; put its id back at ``key`` if deleted."""
        lease, lost = self._current(renew_after=0.0)
        if lost is None and self._key is not None and self._client.get(self._key) is None:
            # Its key was deleted: put it back, so that a newcomer finds this lease.
            self._client.compare_and_swap(self._key, str(lease), 0, lease=lease)
        self._announce(lost, lease)

    # -- the keeper ----------------------------------------------------------------------

    def start(self) -> Lease:
        """Hold a lease from now on, renewed by a thread every :attr:`renew_every` seconds."""
        self.id()
        if self._keeper is None:
            self._keeper = threading.Thread(target=self._keep, name="elasticctl-" + self._name.replace(" ", "-"), daemon=True)
            self._keeper.start()
        return self

    def stop(self, revoke: bool = False) -> None:
        """Stop renewing; with ``revoke`` (a private lease only) its keys go at once, not after ttl."""
        self._stopped.set()
        keeper = self._keeper
        if keeper is not None and keeper is not threading.current_thread():
            keeper.join(timeout=10)
        with self._lock:
            lease = self._id
        if revoke and lease is not None:
            try:
                self._client.revoke_lease(lease)
            except ElasticctlError as exc:
                log.warning("cannot revoke the %s %x: %s", self._name, lease, exc)

    def _keep(self) -> None:
        while not self._stopped.wait(self.renew_every):
            try:
                self.renew()
            except ElasticctlError as exc:
                log.warning("cannot renew the %s: %s", self._name, exc)

    # -- finding and replacing it ------------------------------------------------------

    def _current(self, renew_after: float) -> tuple[int, int | None]:
        """The lease id, renewed if it was last renewed ``renew_after`` seconds ago or more, and
        the id of the lease it replaced when that one was found gone (else None)."""
        with self._lock:
            now = time.monotonic()
            lost = None
            if self._id is not None and now - self._renewed_at >= renew_after:
                # Answered late, even past its end, the renewal still says whether etcd kept it
                ttl = self._client.refresh_lease(self._id, until=self._expires_at, name=self._name)
                if ttl <= 0:
                    lost, self._id = self._id, None
                self._renewed_at, self._expires_at = now, now + ttl
            if self._id is None:
                self._id = self._find_or_grant()
                self._renewed_at, self._expires_at = now, now + self._ttl
            return self._id, lost

    def _replace(self, lost: int) -> int:
        """A lease instead of ``lost``, which etcd said it does not know (unless another thread
        replaced it already)."""
        with self._lock:
            replaced = self._id == lost
            if replaced:
                self._id = self._find_or_grant()
                self._renewed_at = time.monotonic()
                self._expires_at = self._renewed_at + self._ttl
            lease = self._id
        if replaced:
            self._announce(lost, lease)
        return lease

    def _find_or_grant(self) -> int:
        if self._key is None:
            return self._client.grant_lease(self._ttl)
        return find_or_grant(self._client, self._key, self._ttl)

    def _announce(self, lost: int | None, new: int) -> None:
        """Say that ``lost`` ended and the keys now live on ``new``, and let the callbacks rewrite them."""
        if lost is None:
            return
        log.warning("the %s %x expired (this process was frozen or cut off); its keys now live on lease %x",
                    self._name, lost, new)
        for callback in list(self._regranted):
            try:
                callback(new)
            except ElasticctlError as exc:
                log.warning("cannot rewrite a key on the new %s: %s", self._name, exc)


def find_or_grant(client: EtcdClient, key: str, ttl: int) -> int:
    """The live lease whose id is stored at ``key``, else a new one of ``ttl`` seconds put there
    (bound to itself); shared by every process that writes the keys bound to it."""
    for _ in range(_FIND_OR_GRANT_ATTEMPTS):
        kv = client.get(key)
        if kv is not None:
            try:
                lease_id = int(kv.value)
            except ValueError:
                lease_id = 0
            if lease_id > 0 and client.refresh_lease(lease_id) > 0:
                return lease_id
        lease_id = client.grant_lease(ttl)
        ok, _, _ = client.compare_and_swap(key, str(lease_id), 0 if kv is None else kv.mod_revision, lease=lease_id)
        if ok:
            return lease_id
        client.revoke_lease(lease_id)  # another writer put its lease there first
    raise ElasticctlError(f"The shared lease at '{key}' kept changing under us.")
