"""A watched local copy of one run's rendezvous keys, and the few writes of the protocol.

Two feeds, each read once and then kept current by a watch (see :mod:`elasticctl.etcd.watch`):

* ``ctl/`` — the sealed ``round``, ``closed``, the ``sealer`` claim and the ``reform``
  record. Every node follows it: O(1) events per round, so a thousand joiners cost etcd
  a thousand small notifications, not a million.
* ``nodes/`` — every node's declaration. Followed only by the node that seals (it
  must count who wants the round) and by three members of a sealed round
  (:func:`~elasticctl.rendezvous.rounds.publishes_changes`), which publish a lost lease,
  a member re-joining or a newcomer waiting (what restarts the workers) in ``reform``
  for all the others. They load it in the background from their first look at it
  (torch's agent looks once the workers run), not while the round forms, and stop
  following it when they re-declare (:meth:`RoundView.unfollow_nodes`).

Nodes answer questions such as "is anybody waiting?" from the view, with no etcd
request. Writes per node per round: one declaration (a put bound to the node's
lease), at most one claim to seal; per round: one transaction that seals the round
and releases the claim. See :mod:`elasticctl.rendezvous.rounds`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from elasticctl.errors import ElasticctlError
from elasticctl.etcd.client import EtcdClient, KeyValue
from elasticctl.job.keys import JobKeys
from elasticctl.job.rdzv_records import RoundRecords
from elasticctl.job.records import Claim, Declaration, Reform, Round, preferred_round
from elasticctl.rendezvous.writer import LatestWinsWriter

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Progress:
    """What a joining node waits on, as one comparable value (see :meth:`RoundView.progress`)."""

    closed: bool
    round: int
    claim: tuple
    wanting: int
    live: int


class RoundView:
    """The rendezvous keys of one run (``keys.rdzv``), kept current by watches.

    Attributes change under the view's lock; read them through :meth:`snapshot` (a copy),
    :meth:`evaluate`, or in an interest of :meth:`wait_until`. Counts of declarations per
    wanted round are kept as events arrive, so that a node waiting for a round is woken
    only when something it waits for changed, not by each of a thousand declarations.
    """

    def __init__(self, client: EtcdClient, keys: JobKeys, secret: bytes | None = None) -> None:
        self.keys = keys
        self.records = RoundRecords(client, keys, secret)  # the keys this view follows and writes
        self._nodes_prefix = keys.rdzv_nodes
        self._round_key = keys.rdzv_round
        self._closed_key = keys.rdzv_closed
        self._claim_key = keys.rdzv_sealer
        self._changed = threading.Condition()
        self._interests: list[tuple[Callable[[], object], threading.Event]] = []
        self.declarations: dict[str, Declaration] = {}
        self.want_counts: collections.Counter[int] = collections.Counter()
        self.round: Round | None = None
        self.round_revision = 0  # of the round key as it is in etcd, readable or not: the seal's token
        self.closed = False
        self.claim: Claim | None = None  # who seals the next round, if anybody claimed it
        self.claim_revision = 0  # of the claim key as it is in etcd, readable or not
        self.ctl_revision = 0  # the etcd revision up to which the ctl/ keys above are current
        self.gone_at: dict[str, float] = {}  # node -> when its key vanished (monotonic), for verdicts
        # Of those, the ones known from a re-form record only (this view did not follow the
        # declarations): dropped once the node is in a sealed round again.
        self._gone_as_reported: set[str] = set()
        self.reform: Reform | None = None  # the running round must re-form (ctl/reform), if readable
        self.reform_revision = 0  # of the re-form key as it is in etcd, readable or not
        # Live declarations (bound to a lease) that this node cannot read: malformed, or signed
        # with another secret or for another run. Nobody seals a round from scratch beside them.
        self.unreadable: set[str] = set()
        # Whether etcd holds the round this view believes (False after a delete, or while an
        # unreadable, older or forged record is there); see on_round_missing.
        self.round_in_etcd = True
        self._round_missing: list[Callable[[Round, int], None]] = []
        self._on_change: list[Callable[[], None]] = []
        # The on_change callbacks (the member's ctl/reform publish: an etcd write) run on this
        # writer, not on the watch thread that brought the change: see writer.py.
        self._change_writer = LatestWinsWriter(self._run_on_change, "elasticctl-rdzv-reform")
        self._ctl = self.records.ctl_feed(self._load_ctl, self._apply_ctl)
        self._nodes_lock = threading.Lock()
        # Each following of nodes/ has its own feed; what an earlier one still delivers (a load
        # that ends after unfollow_nodes) is ignored by its number.
        self._nodes_epoch = 0
        self._nodes = self._nodes_feed()
        self._nodes_state = "off"  # off -> loading -> on
        self._loader: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> RoundView:
        self._ctl.start()
        return self

    def _nodes_feed(self):
        epoch = self._nodes_epoch
        return self.records.nodes_feed(lambda kvs, revision: self._load_nodes(kvs, revision, epoch),
                                       lambda response: self._apply_nodes(response, epoch))

    def follow_nodes(self, background: bool = False) -> None:
        """Start following the declarations (idempotent); ``background``: return at once."""
        with self._nodes_lock:
            if self._nodes_state != "off":
                return
            self._nodes_state = "loading"
            feed = self._nodes
        if background:
            self._loader = threading.Thread(target=self._start_nodes, args=(feed, True),
                                            name="elasticctl-rdzv-nodes", daemon=True)
            self._loader.start()
        else:
            self._start_nodes(feed, False)

    def _start_nodes(self, feed, background: bool) -> None:
        try:
            feed.start()
        except ElasticctlError as exc:
            with self._nodes_lock:
                if feed is self._nodes:
                    self._nodes_state = "off"  # the next follow_nodes() tries again
            if not background:
                raise
            log.warning("cannot read the rendezvous declarations yet (%s); trying again at the next look", exc)

    def unfollow_nodes(self) -> None:
        """Stop following the declarations (idempotent; not from a watch callback): a member that
        does not publish changes gets no notification per declaration. What the view knew of
        them is dropped; :meth:`follow_nodes` reads them afresh."""
        with self._nodes_lock:
            if self._nodes_state == "off":
                return
            feed = self._nodes
            self._nodes_epoch += 1
            self._nodes = self._nodes_feed()
            self._nodes_state = "off"
        feed.stop()  # a load still running starts no watch after this
        with self._changed:
            self.declarations, self.unreadable = {}, set()
            self.want_counts = collections.Counter()
            self._notify()

    def on_change(self, callback: Callable[[], None]) -> None:
        """``callback()`` on the view's writer thread, outside the view's lock, after the changes
        the watches bring (either feed): a member that publishes changes decides there whether
        to, from the view as it is then. Latest-wins: changes that come while it runs lead to
        one more call after it, so a slow write never holds up the watch or piles up calls."""
        self._on_change.append(callback)

    def _changed_now(self) -> None:
        if self._on_change:
            self._change_writer.request()

    def _run_on_change(self) -> None:
        for callback in list(self._on_change):
            callback()

    @property
    def nodes_followed(self) -> bool:
        """Whether :attr:`declarations` is a current copy (else it is empty or partial)."""
        return self._nodes_state == "on"

    def stop(self) -> None:
        """Stop both watches and the writer, and wait for their threads (and a background load)
        to end."""
        self._ctl.stop()
        with self._nodes_lock:
            nodes = self._nodes
        nodes.stop()  # a load still running starts no watch after this
        loader = self._loader
        if loader is not None and loader is not threading.current_thread():
            loader.join(timeout=self.records.retry_timeout)
        nodes.stop()  # and joins the watch that load may have started
        self._change_writer.stop(timeout=self.records.retry_timeout)  # after the watches: no request comes

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

    def interrupt(self) -> None:
        """Wake every waiter now, whatever it waits for (each one re-checks why it waits)."""
        with self._changed:  # a re-entrant lock: safe from a signal handler in a waiting thread
            self._changed.notify_all()
            for _, woken in list(self._interests):
                woken.set()

    def evaluate(self, decide: Callable[[Round | None, dict[str, Declaration], bool], object]) -> object:
        """``decide(round, declarations, closed)`` under the lock, without copying the view."""
        with self._changed:
            return decide(self.round, self.declarations, self.closed)

    def snapshot(self) -> tuple[Round | None, dict[str, Declaration], bool]:
        with self._changed:
            return self.round, dict(self.declarations), self.closed

    def progress(self, target: int) -> Progress:
        """What a node joining round ``target`` waits on; O(1). Call under the lock (in an interest)."""
        claim = (self.claim.node, self.claim.round, self.claim_revision) if self.claim else (None, 0, self.claim_revision)
        return Progress(self.closed, self.round.number if self.round else 0, claim,
                        self.want_counts[target], len(self.declarations))

    def _notify(self) -> None:
        """Wake the threads waiting on the view; called with the lock held."""
        self._changed.notify_all()
        for interest, woken in self._interests:
            if not woken.is_set() and interest():
                woken.set()

    def seal_token(self) -> int:
        with self._changed:
            return self.round_revision

    # -- the ctl/ feed ---------------------------------------------------------------

    def on_round_missing(self, callback: Callable[[Round, int], None]) -> None:
        """``callback(round, revision)`` (on the watch thread) whenever etcd stops holding the round
        this view believes: its key was deleted (``revision`` 0), or holds a record that is
        unreadable, older or forged (at ``revision``). Members write their round back."""
        self._round_missing.append(callback)

    def _load_ctl(self, kvs: list[KeyValue], revision: int) -> None:
        with self._changed:
            self.round_revision, self.claim, self.claim_revision, self.closed = 0, None, 0, False
            self.reform, self.reform_revision = None, 0
            round_seen = False
            for kv in kvs:
                round_seen |= kv.key.decode(errors="replace") == self._round_key
                self._ctl_key(kv.key, kv.value, kv.mod_revision, kv.lease, deleted=False)
            if not round_seen:
                self.round_in_etcd = self.round is None
            self.ctl_revision = max(self.ctl_revision, revision)
            self._notify()
            missing = self._missing()
        self._report_missing(missing)
        self._changed_now()

    def _apply_ctl(self, response) -> None:
        with self._changed:
            for event in response.events:
                deleted = type(event).__name__ == "DeleteEvent"
                self._ctl_key(event.key, b"" if deleted else event.value, event.mod_revision,
                              0 if deleted else event.lease, deleted)
                self.ctl_revision = max(self.ctl_revision, event.mod_revision)
            self._notify()
            missing = self._missing()
        self._report_missing(missing)
        self._changed_now()

    def _missing(self) -> tuple[Round, int] | None:
        return None if self.round_in_etcd or self.round is None else (self.round, self.round_revision)

    def _report_missing(self, missing: tuple[Round, int] | None) -> None:
        if missing is None:
            return
        for callback in list(self._round_missing):
            callback(*missing)

    def _ctl_key(self, key: bytes, value: bytes, revision: int, lease: int, deleted: bool) -> None:
        name = key.decode(errors="replace")
        if name == self._round_key:
            if deleted:
                self.round_in_etcd = self.round is None
            else:
                candidate = self.records.round_from(value, revision)
                believed = self._believed_round(candidate, revision)
                self.round_in_etcd = believed is candidate or (believed is None and candidate is None)
                if believed is not None:
                    # Every member of a sealed round was live when it was sealed: a loss only
                    # reported earlier is over (one this view saw itself goes when it re-declares).
                    for node in self._gone_as_reported & set(believed.members):
                        self.gone_at.pop(node, None)
                    self._gone_as_reported -= set(believed.members)
                self.round = believed
            self.round_revision = 0 if deleted else revision
        elif name == self._closed_key:
            self.closed = not deleted
        elif name == self._claim_key:
            # A claim must be bound to a lease: one that could never expire would block sealing.
            claim = None if deleted or not lease else self.records.claim_from(value)
            self.claim, self.claim_revision = claim, 0 if deleted else revision
        elif name == self.records.reform_key:
            self.reform = None if deleted else self.records.reform_from(value, revision)
            self.reform_revision = 0 if deleted else revision
            if self.reform is not None and self._nodes_state != "on":
                # A member that does not follow the declarations learns of a loss here: when
                # it was seen (a few milliseconds late) is what its failure verdicts weigh.
                now = time.monotonic()
                for node in self.reform.lost:
                    if node not in self.gone_at:
                        self.gone_at[node] = now
                        self._gone_as_reported.add(node)

    def _believed_round(self, candidate: Round | None, revision: int) -> Round | None:
        """The round to believe: ``candidate`` unless it is unreadable, older than the round this
        view holds, or another record of that same round sealed later (a forgery, or a round
        sealed from scratch while the record was gone): :func:`preferred_round`.

        A planted or replayed round record is never followed (rounds only go forward); its
        revision is kept, so that the next seal, or a member restoring its round, overwrites it.
        """
        believed = preferred_round(self.round, candidate)
        if believed is candidate or believed is None:
            return believed
        if self.round is None or self.round.revision != revision:
            if candidate is None:
                why = "unreadable"
            elif candidate.number < self.round.number:
                why = f"round {candidate.number} is older than round {self.round.number}"
            else:
                why = f"another record of round {candidate.number}, sealed after the one its members run"
            log.warning("Ignoring the round record at %s (revision %d): %s", self._round_key, revision, why)
        return self.round

    # -- the nodes/ feed -------------------------------------------------------------

    def _load_nodes(self, kvs: list[KeyValue], revision: int, epoch: int) -> None:
        declarations: dict[str, Declaration] = {}
        unreadable: set[str] = set()
        for kv in kvs:
            node, declaration = self.records.declaration_at(kv.key, kv.value, kv.mod_revision)
            if declaration is not None:
                declarations[node] = declaration
            elif kv.lease:
                unreadable.add(node)
        self._warn_unreadable(unreadable - self.unreadable)
        with self._changed:
            with self._nodes_lock:
                if epoch != self._nodes_epoch:
                    return  # unfollowed while it loaded
                self._nodes_state = "on"
            self.unreadable = unreadable
            now = time.monotonic()
            for node in self.declarations.keys() - declarations.keys():
                self.gone_at[node] = now
            self.declarations = declarations
            self.want_counts = collections.Counter(d.wants for d in declarations.values())
            self._notify()
        self._changed_now()

    def _apply_nodes(self, response, epoch: int) -> None:
        with self._changed:
            if epoch != self._nodes_epoch:
                return  # the watch of a feed this view stopped following
            now = time.monotonic()
            for event in response.events:
                deleted = type(event).__name__ == "DeleteEvent"
                node, value = self.records.declaration_at(event.key, b"" if deleted else event.value, event.mod_revision)
                previous = self.declarations.pop(node, None)
                if previous is not None:
                    self.want_counts[previous.wants] -= 1
                if not deleted and value is None and event.lease:
                    if node not in self.unreadable:
                        self._warn_unreadable({node})
                    self.unreadable.add(node)
                else:
                    self.unreadable.discard(node)
                if deleted or value is None:
                    if previous is not None:
                        self.gone_at[node] = now
                else:
                    self.declarations[node] = value
                    self.want_counts[value.wants] += 1
                    self.gone_at.pop(node, None)
            self._notify()
        self._changed_now()

    def _warn_unreadable(self, nodes: set[str]) -> None:
        if nodes:
            log.warning("Cannot read the rendezvous declaration(s) of %s under %s (malformed, or signed "
                        "with another secret or for another run); no round is sealed from scratch beside "
                        "them", ", ".join(sorted(nodes)), self._nodes_prefix)

    # -- the protocol's writes (the records' own; here for the protocol's callers) -----------

    def declare(self, declaration: Declaration, lease: int) -> int:
        """Put this node's declaration, bound to its lease; returns the new revision."""
        return self.records.declare(declaration, lease)

    def declare_and_claim(self, declaration: Declaration, claim: Claim, expected_revision: int,
                          lease: int) -> tuple[bool, int]:
        """See :meth:`RoundRecords.declare_and_claim`."""
        return self.records.declare_and_claim(declaration, claim, expected_revision, lease)

    def withdraw(self, node: str) -> None:
        self.records.withdraw(node)

    def claim_sealing(self, claim: Claim, expected_revision: int, lease: int) -> bool:
        """See :meth:`RoundRecords.claim_sealing`."""
        return self.records.claim_sealing(claim, expected_revision, lease)

    def seal(self, sealed: Round, expected_revision: int, lease: int | None = None) -> bool:
        """See :meth:`RoundRecords.seal`."""
        return self.records.seal(sealed, expected_revision, lease)

    def publish_reform(self, reform: Reform, expected_revision: int, lease: int | None = None) -> bool:
        """See :meth:`RoundRecords.publish_reform`."""
        return self.records.publish_reform(reform, expected_revision, lease)

    def restore(self, known: Round, expected_revision: int, lease: int | None = None) -> bool:
        """See :meth:`RoundRecords.restore`: a member of a running round puts back its record
        when it was deleted or replaced."""
        return self.records.restore(known, expected_revision, lease)

    def close(self, lease: int | None = None) -> None:
        self.records.close(lease)
