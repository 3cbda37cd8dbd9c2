"""One node's part in the etcd-native rendezvous: its lease, its declarations, sealing, waiting.

:meth:`RoundMember.join` declares for the next round (one put) and waits, on the
watched view, until a round with this node in it is sealed; the node holding the
claim to seal it (a lease-bound key, won by one compare-and-swap) seals it as soon
as :func:`seal_due` says so. Nothing polls: every wait is on the view's condition,
with a timeout only where a deadline (last call, the join timeout) can fire.

In a sealed round, :meth:`RoundMember.change` says what changed. Three members on different hosts
where they can be (:func:`declaration_followers`) and the holder of the next claim follow every declaration
and publish what they see in one ``ctl/reform`` record (:meth:`RoundMember._publish_change`);
the others read that record from the ``ctl/`` watch: a round of N re-forms with O(N)
notifications, not O(N²).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousTimeoutError
from torch.distributed.elastic.utils.distributed import get_free_port

from elasticctl.errors import ElasticctlError
from elasticctl.etcd.client import EtcdClient
from elasticctl.etcd.lease import Lease
from elasticctl.job.records import Claim, Declaration, Round
from elasticctl.rendezvous.liveness import PROBE_ATTEMPTS, REPROBE_ALIVE, AlivePort, Liveness, probe
from elasticctl.rendezvous.rounds import (
    Change,
    Settings,
    change_for,
    change_from_reform,
    count,
    counted_by,
    declaration_followers,
    has_quorum,
    next_members,
    next_number,
    observed_change,
    publishes_changes,
    waiting_line,
    reform_due,
    reform_record,
    seal_due,
    last_call_for,
    to_probe,
    wanting,
    without_dead,
)
from elasticctl.rendezvous.view import RoundView

log = logging.getLogger(__name__)


# Seconds between two "waiting for N more nodes" lines while the job's first round gathers.
WAIT_REPORT_EVERY = 5.0
# How long, in node TTLs, a re-formation waits for a silent member that answers its probe: such a
# member runs, and a gloo collective that no peer's death reached directly (it waits on a live
# neighbour) ends only at its timeout, the node TTL, after which the member tears its group down
# and re-declares. Sealed at exactly one TTL, it would miss it by that margin and cost a second
# re-formation at once; the wait ends as soon as it re-declares.
RUNNING_WAIT_TTLS = 2


class JoinCancelled(ElasticctlError):
    """:meth:`RoundMember.cancel` ended a join: the node (or worker) was told to stop."""


class RoundMember:
    """This node (``node`` at ``addr``) in the rounds of the run whose keys ``view`` watches."""

    def __init__(self, client: EtcdClient, view: RoundView, node: str, addr: str, settings: Settings,
                 node_ttl: int, join_timeout: float, run_lease=None, pid: int = 0, node_workers: int = 0,
                 node_size: int = 0) -> None:
        self._client = client
        self.view = view
        self.node = node
        self.addr = addr
        self.pid = pid
        self.node_workers = node_workers  # see Declaration.node_workers (0: admitted alone)
        self.node_size = node_size  # see Declaration.node_size (0: not a node's worker)
        self.settings = settings
        self.node_ttl = node_ttl
        self.join_timeout = join_timeout
        self._run_lease = run_lease
        self._lease: Lease | None = None
        self._lease_lost = threading.Event()
        self._cancelled = threading.Event()
        self._left = False
        self._alive_port: AlivePort | None = None  # opened at the first declaration
        # (node, declaration revision) -> what a probe of it showed: True runs, False gone, None not known
        self._probed: dict[tuple[str, int], bool | None] = {}
        # (node, declaration revision) -> probes it left unanswered so far (fewer than PROBE_ATTEMPTS)
        self._unanswered: dict[tuple[str, int], int] = {}
        # (node, declaration revision) -> when a probe last found it running (it is probed again
        # after REPROBE_ALIVE while it stays silent)
        self._found_alive_at: dict[tuple[str, int], float] = {}
        self.round: Round | None = None  # the round this node is in
        # The mod revision of the claim key its declaration left there (its own claim or the one in
        # its way): it tries no compare-and-swap before its view is current up to it (0: none).
        self._claim_seen_from = 0
        # Members known to have finished (see change_for): what this node publishes leaves them out.
        self._finished: frozenset[str] = frozenset()
        view.on_round_missing(self._restore)
        view.on_change(self._publish_change)

    # -- liveness --------------------------------------------------------------------

    def _kept_lease(self) -> Lease:
        """This node's own lease, granted and kept alive from its first use until :meth:`leave`."""
        if self._lease is None:
            self._lease = Lease(self._client, self.node_ttl, name="rendezvous lease")
            self._lease.on_regrant(self._on_lease_lost)
            self._lease.start()
        return self._lease

    def bound_to_lease(self, write):
        """``write(lease_id)``, on a fresh lease if etcd no longer knows this node's lease
        (it expired while the node was frozen or starved): keys on the old one are gone."""
        return self._kept_lease().bound(write)

    @property
    def lease_lost(self) -> bool:
        """Whether this node's lease ended since it last joined (it was frozen or cut off)."""
        return self._lease_lost.is_set()

    def _on_lease_lost(self, _new_lease: int) -> None:
        # Frozen or cut off past node_ttl: the others have gone on without this node. It
        # must not slip back into the old round; it re-joins as a newcomer.
        log.warning("[%s] its rendezvous lease expired (frozen or cut off); it will join again", self.node)
        self._lease_lost.set()
        # A join waiting for its round lost its declaration with the lease: it declares again now.
        self.view.interrupt()

    # -- joining ---------------------------------------------------------------------

    def cancel(self) -> None:
        """End a join in progress, now or whenever one starts, with :class:`JoinCancelled`
        (safe from a signal handler)."""
        self._cancelled.set()
        self.view.interrupt()

    def join(self) -> Round:
        """Declare for the next round and return it once it is sealed with this node in it."""
        deadline = time.monotonic() + self.join_timeout
        self._lease_lost.clear()
        while True:
            if self._cancelled.is_set():
                raise JoinCancelled(f"{self.node} was told to stop while it waited for a round.")
            current, _, closed = self.view.snapshot()
            if closed:
                raise RendezvousClosedError()
            target = next_number(current)
            # Waiting, it follows only ctl/ (see _await_round); its last round's changes are
            # published by the claim holder from here on (publishes_changes).
            self.view.unfollow_nodes()
            if self._alive_port is None:
                self._alive_port = AlivePort(self.addr)
            declaration = Declaration(self.node, self.addr, target, self.pid, port=get_free_port(),
                                      alive_port=self._alive_port.port, node_workers=self.node_workers,
                                      node_size=self.node_size)
            declared_on = self.bound_to_lease(lambda lease, d=declaration: self._declare(d, lease))
            log.info("[%s] wants round %d", self.node, target)
            self._lease_lost.clear()  # the declaration is on the lease in use now
            sealed = self._await_round(target, deadline, declared_on)
            if sealed is not None:
                self.round = sealed
                return sealed
            # Sealed without this node (the round was full), or its declaration went with its
            # lease before the seal: declare (again) for the next round to seal.

    def _declare(self, declaration: Declaration, lease: int) -> int:
        """Put ``declaration`` on ``lease`` (returned); with the claim to seal its round in the
        same transaction while the view shows nobody holding it: when every node of a job starts
        at once, each would otherwise try a compare-and-swap of its own, and a failed one is a
        raft proposal as well (a round of 1,000 paid up to 1,000 of them)."""
        target = declaration.wants
        claim, claim_revision = self.view.evaluate(lambda *_: (self.view.claim, self.view.claim_revision))
        if claim is not None and claim.round == target:
            self.view.declare(declaration, lease)
            return lease
        claimed, claim_now = self.view.declare_and_claim(declaration, Claim(self.node, target), claim_revision, lease)
        if claimed:
            log.info("[%s] seals round %d", self.node, target)
        # Its own claim, or one that won, that this view has not seen yet: no compare-and-swap
        # of its own until it has (which would only fail, a proposal for nothing).
        self._claim_seen_from = claim_now
        return lease

    def _await_round(self, target: int, deadline: float, declared_on: int) -> Round | None:
        """Wait until round ``target`` is sealed; seal it if this node holds the claim to.
        None: sealed without this node, or its declaration (bound to lease ``declared_on``) is
        gone with that lease, so it must declare again.

        Every node follows only the ctl/ keys while it waits. When nobody holds a live
        claim to seal ``target``, each waiting node tries once to take it (a compare-and-
        swap: one wins); the holder follows the declarations and seals when
        :func:`seal_due` says so. A holder that dies loses the claim with its lease, and
        the others try again.
        """
        view, settings = self.view, self.settings
        quorum_since: float | None = None
        report_at = time.monotonic() + WAIT_REPORT_EVERY  # the first line only once a wait is felt
        while True:
            # Read what we wait on before deciding, so that no change slips in between.
            seen = view.evaluate(lambda *_: view.progress(target))
            now = time.monotonic()
            current, declarations, closed = view.snapshot()
            claim, claim_revision = view.claim, view.claim_revision
            if closed:
                raise RendezvousClosedError()
            if self._cancelled.is_set():
                raise JoinCancelled(f"{self.node} was told to stop while it waited for round {target}.")
            if current is not None and current.number >= target:
                return current if self.node in current.members else None
            if self._lease is not None and self._lease.held != declared_on:
                # Starved or cut off past node_ttl while it waited: etcd deleted the declaration
                # (and this node's claim to seal, if it held it). Waiting on would wait for a
                # round that cannot count it: a round of min = max nodes would never fill.
                log.warning("[%s] its declaration for round %d went with its lease; declaring again",
                            self.node, target)
                return None
            counted = counted_by(settings)
            spare = (current is not None and count(current.members, counted) >= settings.max_nodes
                     and self.node not in current.members)
            if spare:
                # The running round is full: this node is a spare, warm, and waits as long as
                # the job runs (a member lost, it takes the place at the same re-formation).
                deadline = max(deadline, now + self.join_timeout)
            if now >= deadline:
                raise RendezvousTimeoutError(
                    f"The rendezvous round {target} did not complete within {self.join_timeout:g} s "
                    f"(sealed by {claim.node if claim and claim.round == target else 'nobody yet'}).")
            wake_at = [deadline, report_at]
            if now >= report_at and not spare:
                # Someone waits at a terminal for the other nodes (a re-formation among running
                # nodes is over long before the first line; a spare waits, quietly, on purpose).
                report_at = now + WAIT_REPORT_EVERY
                holder = claim.node if claim is not None and claim.round == target else None
                if holder == self.node and view.nodes_followed:
                    line = waiting_line(target, declarations.values(), settings.min_nodes, counted)
                else:
                    line = waiting_line(target, (), settings.min_nodes, gathered_by=holder or "none yet")
                log.warning("[%s] %s", self.node, line)
            if claim is None or claim.round != target:
                if view.ctl_revision < self._claim_seen_from:
                    # The claim that beat this node's declaration is on its way through the watch.
                    wake_at.append(now + 1.0)
                elif not self._claim(target, claim_revision):
                    wake_at.append(now + 0.5)  # etcd refused or was unreachable: try again soon
            elif claim.node == self.node:
                view.follow_nodes()
                live = list(declarations.values()) if view.nodes_followed else []
                live = self._without_gone(current, live)
                quorum_since = (quorum_since or now) if has_quorum(current, live, settings.min_nodes, counted) else None
                # A running member slow to re-declare is waited for up to twice its lease's length.
                rounds = dataclasses.replace(settings, last_call=last_call_for(
                    current, live, self._probed, settings.last_call, RUNNING_WAIT_TTLS * self.node_ttl))
                if seal_due(current, live, rounds, quorum_since, now, len(view.unreadable)):
                    self._seal(current, live, target)
                elif quorum_since is not None:
                    wake_at.append(quorum_since + rounds.last_call)
                    if self._found_alive_at:  # a silent member found running: is it still?
                        wake_at.append(min(self._found_alive_at.values()) + REPROBE_ALIVE)
            view.wait_until(lambda seen=seen: view.progress(target) != seen,
                            max(0.0, min(wake_at) - time.monotonic()) + 0.01)

    def _without_gone(self, current: Round | None, live: list[Declaration]) -> list[Declaration]:
        """``live`` less the members whose process is gone although their lease lives on: the
        few silent members of a re-formation are probed once per declaration, and one found
        running again every REPROBE_ALIVE seconds while it stays silent (see
        :mod:`elasticctl.rendezvous.liveness`), so that a crash is not waited for until
        the last call, nor its lease's end."""
        keys = {(d.node, d.revision) for d in live}
        self._probed = {key: alive for key, alive in self._probed.items() if key in keys}
        self._unanswered = {key: count for key, count in self._unanswered.items() if key in keys}
        self._found_alive_at = {key: at for key, at in self._found_alive_at.items() if key in keys}
        # A member found running is asked again once REPROBE_ALIVE has passed: it may have died
        # since. Only a refusal changes the verdict; no answer (a loaded host) leaves it running.
        for declaration in live:
            key = (declaration.node, declaration.revision)
            if key in self._found_alive_at and time.monotonic() - self._found_alive_at[key] >= REPROBE_ALIVE:
                if probe(declaration.addr, declaration.alive_port) is Liveness.GONE:
                    self._probed[key] = False
                    del self._found_alive_at[key]
                    log.info("[%s] %s (pid %d) is gone since it last answered; not waiting for its lease",
                             self.node, declaration.node, declaration.pid)
                else:
                    self._found_alive_at[key] = time.monotonic()
        for declaration in to_probe(current, live, self._probed):
            key = (declaration.node, declaration.revision)
            seen = probe(declaration.addr, declaration.alive_port)
            if seen is Liveness.UNKNOWN and self._unanswered.get(key, 0) + 1 < PROBE_ATTEMPTS:
                # Frozen, or starved of CPU on a loaded host: asked again at this loop's next
                # turn (the last call's end at the latest), so a slow answer still counts.
                self._unanswered[key] = self._unanswered.get(key, 0) + 1
                continue
            self._probed[key] = {Liveness.ALIVE: True, Liveness.GONE: False}.get(seen)
            if seen is Liveness.ALIVE:
                self._found_alive_at[key] = time.monotonic()
            if seen is Liveness.GONE:
                log.info("[%s] %s (pid %d) is gone (its liveness port refused a connection); not waiting "
                         "for its lease", self.node, declaration.node, declaration.pid)
        return without_dead(live, self._probed)

    def _claim(self, target: int, expected_revision: int) -> bool:
        """Try to take the claim to seal ``target``; False if etcd could not be asked (the
        watch shows who won otherwise)."""
        try:
            if self.bound_to_lease(lambda lease: self.view.claim_sealing(
                    Claim(self.node, target), expected_revision, lease)):
                log.info("[%s] seals round %d", self.node, target)
            return True
        except ElasticctlError as exc:
            log.warning("[%s] cannot claim the sealing of round %d: %s", self.node, target, exc)
            return False

    def _seal(self, current: Round | None, live: list[Declaration], target: int) -> None:
        token = self.view.seal_token()
        candidates = wanting(current, live)
        members = next_members(current, candidates, self.settings.max_nodes, counted_by(self.settings))
        by_node = {d.node: d for d in candidates}
        # Rank 0's address and port travel in the round: nobody waits in the store for them.
        sealed = Round(number=target, members=members, addrs=tuple(by_node[m].addr for m in members),
                       master_port=by_node[members[0]].port, sealed_at=round(time.time(), 6))
        run_lease = self._run_lease.id() if self._run_lease is not None else None
        try:
            if self.view.seal(sealed, token, run_lease):
                log.info("[%s] sealed round %d: %s", self.node, target, ", ".join(members))
        except ElasticctlError as exc:
            log.warning("[%s] cannot seal round %d: %s", self.node, target, exc)

    def _restore(self, known: Round, revision: int) -> None:
        """The record of the round this node runs in is gone from etcd (deleted, expired with a
        lease, overwritten by a forged or late record): write it back, bound to the run lease.
        Every member tries; one compare-and-swap wins. A newcomer meanwhile waits (see
        :func:`seal_due`) and then joins the running round's members."""
        if self._left or self.round is None or not self.round.same_round(known):
            return
        lease = self._run_lease.id if self._run_lease is not None else None
        try:
            restored = self.view.restore(known, revision, lease() if lease else None)
        except ElasticctlError as exc:
            log.warning("[%s] cannot write back the record of round %d: %s", self.node, known.number, exc)
            return
        if restored:
            log.warning("[%s] wrote back the record of round %d, which etcd no longer held", self.node,
                        known.number)

    # -- while in a round ------------------------------------------------------------

    def change(self, finished: frozenset[str] = frozenset()) -> Change:
        """What changed since this node's round was sealed, from the watched view alone
        (``finished``: members known to have finished, see :func:`change_for`).

        A follower of the declarations (:func:`declaration_followers`) answers from them; every
        other member from the followers' ``ctl/reform`` record, and stops following them if it
        did (it sealed the round).
        """
        if self.round is None:
            return Change()
        if self._lease_lost.is_set():
            return Change(superseded=True)
        self._finished |= finished
        my_round = self.round.number
        follows = self.view.evaluate(lambda current, _declarations, _closed: current is not None and (
            current.number == my_round and self.node in declaration_followers(current)))
        if not follows:
            self.view.unfollow_nodes()
        elif not self.view.nodes_followed:
            # From its first look on (loaded while its workers start): meanwhile, what another
            # follower published.
            self.view.follow_nodes(background=True)
        else:
            return self.view.evaluate(lambda current, declarations, _closed: change_for(
                self.node, my_round, current, declarations, self.settings.max_nodes, finished,
                counted_by(self.settings)))
        return self.view.evaluate(lambda current, _declarations, _closed: change_from_reform(
            self.node, my_round, current, self.view.reform, finished))

    def lost_now(self) -> tuple[int, tuple[str, ...]] | None:
        """Members of this node's round seen lost now, with that round's number (None: in no
        round). Read-only, any thread: from the declarations if this view follows them, else
        from the followers' ``ctl/reform`` record (unlike :meth:`change`, it starts or stops
        following nothing)."""
        joined = self.round
        if joined is None:
            return None
        followed = self.view.nodes_followed

        def lost(current, declarations, _closed) -> tuple[str, ...]:
            if followed:
                return change_for(self.node, joined.number, current, declarations, self.settings.max_nodes,
                                  self._finished, counted_by(self.settings)).lost
            return change_from_reform(self.node, joined.number, current, self.view.reform, self._finished).lost

        return joined.number, self.view.evaluate(lost)

    def _publish_change(self) -> None:
        """After the changes the view's watches bring (on the view's writer thread, latest-wins,
        so the write holds up no watch event; it reads the view as it is then): if this node follows
        the declarations of the running round for everyone (:func:`publishes_changes`), write
        what changed in it to ``ctl/reform`` when :func:`reform_due` says so. A compare-and-swap
        on the record's revision: of two followers that see the same change, one writes it, and
        the other sees it through its watch."""
        if self._left:
            return
        view = self.view

        def decide(current, declarations, closed):
            if not view.nodes_followed or not publishes_changes(self.node, current, view.claim):
                return None
            seen = observed_change(current, declarations, self.settings.max_nodes, self._finished,
                                   counted_by(self.settings))
            if not reform_due(seen, current, view.reform, closed):
                return None
            return reform_record(seen, current, self.node), view.reform_revision

        decision = view.evaluate(decide)
        if decision is None:
            return
        reform, revision = decision
        run_lease = self._run_lease.id() if self._run_lease is not None else None
        try:
            if view.publish_reform(reform, revision, run_lease):
                log.info("[%s] round %d must re-form: %s", self.node, reform.round, _reasons(reform))
        except ElasticctlError as exc:
            log.warning("[%s] cannot publish that round %d must re-form: %s", self.node, reform.round, exc)

    def leave(self) -> None:
        """Leave gracefully: the others see this node's key go at once, not after node_ttl."""
        self._left = True
        if self._alive_port is not None:
            self._alive_port.close()
        try:
            self.view.withdraw(self.node)
        finally:
            if self._lease is not None:
                self._lease.stop(revoke=True)
                self._lease = None


def _reasons(reform) -> str:
    """What a re-form record says, for a log line (a few names of each kind)."""
    def names(nodes: tuple[str, ...]) -> str:
        return ", ".join(nodes[:3]) + (f" and {len(nodes) - 3} more" if len(nodes) > 3 else "")

    parts = [f"lost {names(reform.lost)}"] if reform.lost else []
    parts += [f"{names(reform.moved_on)} re-forming"] if reform.moved_on else []
    parts += [f"{names(reform.waiting)} waiting"] if reform.waiting else []
    return "; ".join(parts) or "nothing any more"
