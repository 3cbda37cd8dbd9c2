"""A watched local copy of one run's rendezvous keys, and the few writes of the protocol.

The view is read once, then kept current by a watch from the revision it was read
at: nodes learn of declarations, sealed rounds and lost leases without polling, and
answer questions such as "is anybody waiting?" with no etcd request. When the watch
breaks (an etcd member restarts, a leader changes, history was compacted) the view
re-reads everything and watches again from the new revision.

Writes per node per round: one declaration (a put bound to the node's lease); per
round: one compare-and-swap of the sealed round. See :mod:`elasticctl.rdzv_rounds`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable

from elasticctl.errors import ElasticctlError
from elasticctl.etcd import EtcdClient
from elasticctl.rdzv_rounds import Declaration, Round

log = logging.getLogger(__name__)

_RETRY_DELAY = 0.2


class RoundView:
    """The rendezvous keys under ``prefix`` (``<key_prefix>/<run>/rdzv/``), kept current by a watch.

    Attributes change under the view's lock; read them through :meth:`snapshot` (a copy),
    :meth:`evaluate`, or in an interest of :meth:`wait_until`. Counts of declarations per
    wanted round are kept as events arrive, so that a node waiting for a round is woken
    only when something it waits for changed, not by each of a thousand declarations.
    """

    def __init__(self, client: EtcdClient, prefix: str, secret: bytes | None = None) -> None:
        self._client = client
        self._secret = secret or None  # with a job secret, records are signed and unsigned ones ignored
        self.prefix = prefix.rstrip("/") + "/"
        self._nodes_prefix = self.prefix + "nodes/"
        self._round_key = self.prefix + "round"
        self._closed_key = self.prefix + "closed"
        self._changed = threading.Condition()
        self.declarations: dict[str, Declaration] = {}
        self.want_counts: collections.Counter[int] = collections.Counter()
        self._interests: list[tuple[Callable[[], object], threading.Event]] = []
        self.round: Round | None = None
        self.round_revision = 0  # of the round key as it is in etcd, readable or not: the seal's token
        self.closed = False
        self.revision = 0
        self.gone_at: dict[str, float] = {}  # node -> when its key vanished (monotonic), for verdicts
        self._stopped = threading.Event()
        self._cancel: Callable[[], None] | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> RoundView:
        self._reload()
        self._thread = threading.Thread(target=self._watch_forever, name="elasticctl-rdzv-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        cancel = self._cancel
        if cancel is not None:
            with contextlib.suppress(Exception):
                cancel()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- reading ---------------------------------------------------------------------

    def wait_for(self, predicate: Callable[[], object], timeout: float | None) -> object:
        """Block until ``predicate()`` (evaluated under the view's lock) is truthy, or ``timeout``."""
        with self._changed:
            return self._changed.wait_for(predicate, timeout)

    def wait_until(self, interest: Callable[[], object], timeout: float | None) -> bool:
        """Block until ``interest()`` is truthy, or ``timeout``; it is evaluated under the lock
        by the watch after each change (keep it O(1)), and the waiter is woken only then."""
        woken = threading.Event()
        entry = (interest, woken)
        with self._changed:
            if interest():
                return True
            self._interests.append(entry)
        try:
            return woken.wait(timeout)
        finally:
            with self._changed:
                if entry in self._interests:
                    self._interests.remove(entry)

    def evaluate(self, decide: Callable[[Round | None, dict[str, Declaration], bool], object]) -> object:
        """``decide(round, declarations, closed)`` under the lock, without copying the view."""
        with self._changed:
            return decide(self.round, self.declarations, self.closed)

    def snapshot(self) -> tuple[Round | None, dict[str, Declaration], bool]:
        with self._changed:
            return self.round, dict(self.declarations), self.closed

    def _notify(self) -> None:
        """Wake the threads waiting on the view; called with the lock held."""
        self._changed.notify_all()
        for interest, woken in self._interests:
            if not woken.is_set() and interest():
                woken.set()

    def seal_token(self) -> int:
        with self._changed:
            return self.round_revision

    # -- the watch -------------------------------------------------------------------

    def _reload(self) -> None:
        kvs, revision = self._client.get_prefix_at(self.prefix)
        declarations: dict[str, Declaration] = {}
        sealed, round_revision, closed = self.round, 0, False
        for kv in kvs:
            kind, value = self._decode(kv.key, kv.value, kv.mod_revision)
            if kind == "node" and value is not None:
                declarations[value.node] = value
            elif kind == "round":
                sealed, round_revision = self._newer_round(value, kv.mod_revision), kv.mod_revision
            elif kind == "closed":
                closed = True
        with self._changed:
            now = time.monotonic()
            for node in self.declarations.keys() - declarations.keys():
                self.gone_at[node] = now
            self.declarations, self.round, self.closed, self.revision = declarations, sealed, closed, revision
            self.want_counts = collections.Counter(d.wants for d in declarations.values())
            self.round_revision = round_revision
            self._notify()

    def _newer_round(self, candidate: Round | None, revision: int) -> Round | None:
        """The round to believe: ``candidate`` unless it is unreadable or older than one seen.

        A planted or replayed round record is never followed (rounds only go forward);
        its revision is kept, so that the next seal overwrites it.
        """
        if candidate is not None and (self.round is None or candidate.number >= self.round.number):
            return candidate
        if self.round is None or self.round.revision != revision:
            log.warning("Ignoring the round record at %sround (revision %d): %s", self.prefix, revision,
                        "unreadable" if candidate is None else
                        f"round {candidate.number} is older than round {self.round.number}")
        return self.round

    def _decode(self, key: bytes, value: bytes, revision: int):
        name = key.decode(errors="replace")
        if name.startswith(self._nodes_prefix):
            declaration = Declaration.from_json(value, revision, name, self._secret)
            # A record under another node's name is not that node's declaration.
            valid = declaration is not None and declaration.node == name[len(self._nodes_prefix):]
            return "node", declaration if valid else None
        if name == self._round_key:
            return "round", Round.from_json(value, revision, name, self._secret)
        if name == self._closed_key:
            return "closed", True
        return "other", None

    def _apply(self, response) -> None:
        with self._changed:
            now = time.monotonic()
            for event in response.events:
                deleted = type(event).__name__ == "DeleteEvent"
                kind, value = self._decode(event.key, b"" if deleted else event.value, event.mod_revision)
                if kind == "node":
                    node = event.key.decode(errors="replace")[len(self._nodes_prefix):]
                    previous = self.declarations.pop(node, None)
                    if previous is not None:
                        self.want_counts[previous.wants] -= 1
                    if deleted or value is None:
                        if previous is not None:
                            self.gone_at[node] = now
                    else:
                        self.declarations[node] = value
                        self.want_counts[value.wants] += 1
                        self.gone_at.pop(node, None)
                elif kind == "round":
                    if not deleted:
                        self.round = self._newer_round(value, event.mod_revision)
                    self.round_revision = 0 if deleted else event.mod_revision
                elif kind == "closed":
                    self.closed = not deleted
            self.revision = max(self.revision, response.header.revision)
            self._notify()

    def _watch_forever(self) -> None:
        while not self._stopped.is_set():
            try:
                responses, self._cancel = self._client.watch_prefix(self.prefix, self.revision + 1)
                for response in responses:
                    if self._stopped.is_set():
                        return
                    self._apply(response)
            except Exception as exc:  # noqa: BLE001 - any broken stream: re-read, then watch again
                if self._stopped.is_set():
                    return
                log.info("rendezvous watch on %s broke (%s); re-reading", self.prefix, exc)
            if self._stopped.wait(_RETRY_DELAY):
                return
            try:
                self._reload()
            except ElasticctlError as exc:
                log.warning("cannot re-read the rendezvous at %s: %s", self.prefix, exc)

    # -- the protocol's writes -------------------------------------------------------

    def declare(self, declaration: Declaration, lease: int) -> int:
        """Put this node's declaration, bound to its lease; returns the new revision."""
        key = self._nodes_prefix + declaration.node
        return self._client.put(key, declaration.to_json(key, self._secret), lease=lease)

    def withdraw(self, node: str) -> None:
        self._client.delete(self._nodes_prefix + node)

    def seal(self, sealed: Round, expected_revision: int, lease: int | None = None) -> bool:
        """Seal ``sealed`` if the round key is still at ``expected_revision`` (one compare-and-swap).

        ``lease``: the run's lease, so that an abandoned run's round expires with it.
        """
        ok, _, _ = self._client.compare_and_swap(
            self._round_key, sealed.to_json(self._round_key, self._secret), expected_revision, lease)
        return ok

    def close(self, lease: int | None = None) -> None:
        self._client.put(self._closed_key, "1", lease=lease)
