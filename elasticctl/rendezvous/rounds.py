"""The etcd-native rendezvous, decided: pure functions over its records.

Protocol (keys under :attr:`JobKeys.rdzv <elasticctl.job.keys.JobKeys.rdzv>`, records in
:mod:`elasticctl.job.records`, I/O in :mod:`elasticctl.rendezvous.view`):

* ``nodes/<node>`` — a :class:`Declaration`: "this node wants to be in round ``wants``",
  one put bound to the node's own lease. Liveness is the lease (keep-alives only);
  leaving is deleting the key. A node declares once per round: O(n) writes.
* ``ctl/sealer`` — a :class:`Claim`: the node that seals the next round, bound to its
  lease. Taken by one compare-and-swap when nobody holds it; only the holder needs
  to follow every declaration.
* ``ctl/round`` — the sealed :class:`Round`: its number and members in rank order,
  written (and the claim released) by one transaction on the previous round's
  revision. Every node learns it from a watch.
* ``ctl/closed`` — the job is done; no round is sealed after it.
* ``ctl/reform`` — a :class:`Reform`: the running round must re-form, and why. Only a few
  members of a running round follow the declarations (:func:`publishes_changes`); they
  write it when they see a member lost, moved on or a newcomer waiting, and every other
  member learns it from the ``ctl/`` watch it has anyway (:func:`change_from_reform`).

A round is sealed when enough nodes want it and there is nobody left worth waiting
for (:func:`seal_due`); its members are chosen by :func:`next_members`. Every
function here is pure: the view and the clock come in as arguments.

The same protocol runs the workers' generations in hot mode (members ``<node>.<local rank>``).
In a sharded job each worker's declaration says how many workers its node brings
(``node_workers``), and a generation admits a node whole or not at all (:func:`whole_nodes`):
an HSDP mesh replicates across nodes and shards within one, so half a node cannot be laid out.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence

from elasticctl.job.records import Claim, Declaration, Reform, Round, worker_of


@dataclasses.dataclass(frozen=True)
class Settings:
    min_nodes: int
    max_nodes: int
    last_call: float  # seconds to wait for more nodes once min_nodes want a round
    # The members are workers (``<node>.<local rank>``: a job's generations), and MIN and MAX count
    # their nodes, whatever each node's worker count: a node that brings more workers than the
    # others is still one node (beside a full round, a spare). False: the members are nodes.
    members_are_workers: bool = False


def _itself(name: str) -> str:
    return name


def node_of(name: str) -> str:
    """The node of a worker named ``<node>.<local rank>``; any other name is a node itself."""
    worker = worker_of(name)
    return worker[0] if worker else name


def counted_by(settings: Settings) -> Callable[[str], str]:
    """What a member name counts as towards MIN and MAX: its node when the members are workers."""
    return node_of if settings.members_are_workers else _itself


def count(names: Iterable[str], counted: Callable[[str], str] = _itself) -> int:
    """How many of MIN and MAX's units ``names`` make (distinct nodes when ``counted`` is node_of)."""
    return len({counted(name) for name in names})


def complete_nodes(declarations: Iterable[Declaration]) -> bool:
    """Whether every node among ``declarations`` has declared with all of its workers (those that
    say how many their node brings, ``node_size``; a declaration that does not is complete)."""
    declared: dict[str, int] = collections.Counter()
    size: dict[str, int] = {}
    for declaration in declarations:
        if declaration.node_size:
            node = node_of(declaration.node)
            declared[node] += 1
            size[node] = max(size.get(node, 0), declaration.node_size)
    return all(declared[node] >= workers for node, workers in size.items())


def next_number(current: Round | None) -> int:
    return 1 if current is None else current.number + 1


def wanting(current: Round | None, live: Iterable[Declaration]) -> list[Declaration]:
    """The live nodes that want the next round, in the order they declared."""
    target = next_number(current)
    return sorted((d for d in live if d.wants == target), key=lambda d: d.revision)


def admission_unit(declaration: Declaration) -> str:
    """What a round admits together with ``declaration``: its node's workers when it declares as a
    worker of a node (``node_workers``), else the declarer alone (an agent, a DDP job's worker)."""
    if declaration.node_workers:
        worker = worker_of(declaration.node)
        return f"node {worker[0]}" if worker else f"worker {declaration.node}"
    return f"worker {declaration.node}"


def whole_nodes(declarations: Iterable[Declaration]) -> list[Declaration]:
    """The declarations a round may admit, in their order: one made alone (``node_workers`` 0)
    always; a worker of a node only together with every other worker of that node, all
    ``node_workers`` of them (local ranks 0 to n-1, each saying n) among ``declarations``.

    So a node whose workers have not all declared waits for a later round (it does not hold up the
    others: it is not among the declarations a seal waits for either, see :func:`seal_due`), and a
    node that lost a worker leaves as a whole. A node whose workers disagree on n is never whole."""
    declarations = list(declarations)
    locals_by_unit: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    for declaration in declarations:
        if declaration.node_workers:
            worker = worker_of(declaration.node)
            local = worker[1] if worker else -1
            locals_by_unit[admission_unit(declaration)].append((local, declaration.node_workers))
    whole = {unit for unit, workers in locals_by_unit.items()
             if sorted(workers) == [(local, workers[0][1]) for local in range(workers[0][1])]}
    return [d for d in declarations if not d.node_workers or admission_unit(d) in whole]


def fitting(names: Sequence[str], unit_of: Mapping[str, str], room: int,
            counted: Callable[[str], str] = _itself, present: Iterable[str] = ()) -> list[str]:
    """``names`` less the units that do not fit in ``room`` places: units are taken whole, in the
    order of their first name, each one if it still fits (one name per unit: the first ``room``).
    A place holds what ``counted`` maps names to (a node's workers share one place when it is
    :func:`node_of`); ``present``: what holds places already, so that names of it take no more."""
    places_of: dict[str, set[str]] = collections.defaultdict(set)
    for name in names:
        places_of[unit_of[name]].add(counted(name))
    held = set(present)
    taken: set[str] = set()
    seen: set[str] = set()
    for name in names:
        unit = unit_of[name]
        if unit in seen:
            continue
        seen.add(unit)
        more = places_of[unit] - held
        if len(more) <= room:
            taken.add(unit)
            held |= more
            room -= len(more)
    return [name for name in names if unit_of[name] in taken]


def next_members(current: Round | None, candidates: list[Declaration], max_nodes: int,
                 counted: Callable[[str], str] = _itself) -> tuple[str, ...]:
    """Who is in the next round, rank order: the current round's members keep their order
    (rank 0 stays rank 0 when it can), then newcomers by arrival; at most ``max_nodes``
    (as ``counted``: :func:`counted_by`). A sharded job's nodes are admitted whole or not at all
    (:func:`whole_nodes`)."""
    admitted = whole_nodes(candidates)
    unit_of = {d.node: admission_unit(d) for d in admitted}
    kept = [m for m in (current.members if current else ()) if m in unit_of]
    kept_names = set(kept)
    newcomers = [d.node for d in admitted if d.node not in kept_names]
    return tuple(fitting(kept + newcomers, unit_of, max_nodes, counted))


def has_quorum(current: Round | None, live: list[Declaration], min_nodes: int,
               counted: Callable[[str], str] = _itself) -> bool:
    """Whether the next round has a quorum: ``min_nodes`` that could be admitted want it (a sharded
    job's whole nodes: half a node neither makes a quorum nor is waited for) and, once a round
    runs, its re-formation has begun: one of its members wants the next round, or none of them
    lives any more. Newcomers alone beside a running round are no quorum: its members re-form with
    them as soon as they see them waiting (a round of newcomers alone would supersede a training
    job). So a re-formation's last call counts from its first member's declaration, never from
    the arrival of a spare that has waited beside a full round for minutes: sealed at once, that
    spare's round would leave out every survivor slower to re-declare than the first."""
    wanted = wanting(current, live)
    if current is not None and not any(d.node in current.members for d in wanted):
        live_names = {d.node for d in live}
        if any(member in live_names for member in current.members):
            return False
    return count((d.node for d in whole_nodes(wanted)), counted) >= min_nodes


def seal_due(current: Round | None, live: list[Declaration], settings: Settings,
             quorum_since: float | None, now: float, unreadable: int = 0) -> bool:
    """Whether the next round should be sealed now.

    ``quorum_since``: since when this node has seen the next round have a quorum (:func:`has_quorum`).
    ``unreadable``: live declarations this node cannot read (another secret, another run).
    Never while a live node wants a round beyond the next one: it is in a round this node
    does not see (its record was deleted or expired; its members write it back), and a
    round sealed now would train beside it. Never a first round beside live declarations
    this node cannot read, for the same reason: at worst the job waits, and says why.
    Never without a quorum (:func:`has_quorum`). Otherwise sealed at once when
    the round is full, or, once a round has run, when every live node wants the next
    one (nobody is left to wait for: the usual re-forming after a failure or a join);
    otherwise after ``last_call`` seconds of quorum, so that nodes still starting up
    make the first round.
    """
    target = next_number(current)
    if any(d.wants > target for d in live) or (current is None and unreadable):
        return False
    counted = counted_by(settings)
    if not has_quorum(current, live, settings.min_nodes, counted):
        return False
    candidates = whole_nodes(wanting(current, live))
    if count((d.node for d in candidates), counted) >= settings.max_nodes and complete_nodes(candidates):
        return True
    if current is not None and len(candidates) == len(whole_nodes(live)):
        return True
    return quorum_since is not None and now - quorum_since >= settings.last_call


def waiting_line(target: int, live: Iterable[Declaration], min_nodes: int,
                 counted: Callable[[str], str] = _itself, gathered_by: str | None = None) -> str:
    """What a node waiting for round ``target`` says, at a steady pace, while the round cannot
    form yet: how many more nodes it needs, which it has, and MIN. ``live``: the declarations
    for it, known to the claim holder only; ``gathered_by``: the holder, for the others."""
    if gathered_by is not None:
        return f"round {target}: waiting for the nodes to gather (node {gathered_by} counts them; min {min_nodes})"
    have = sorted({counted(d.node) for d in live})
    missing = max(min_nodes - len(have), 0)
    if not missing:
        return f"round {target}: {len(have)} nodes here ({', '.join(have)}; min {min_nodes}); sealing soon"
    return (f"round {target}: waiting for {missing} more node{'' if missing == 1 else 's'} "
            f"(have {', '.join(have) or 'none'}; min {min_nodes})")


PROBE_AT_MOST = 8  # silent members probed at once: the few a re-formation still waits for


def silent_members(current: Round | None, live: Iterable[Declaration]) -> list[Declaration]:
    """The members of the running round whose live declaration does not want the next one yet."""
    if current is None:
        return []
    target = next_number(current)
    members = set(current.members)
    return [d for d in live if d.node in members and d.wants < target]


def to_probe(current: Round | None, live: Iterable[Declaration], known: Mapping[tuple[str, int], bool | None],
             at_most: int = PROBE_AT_MOST) -> list[Declaration]:
    """The live declarations whose process the sealer should probe now (see
    :mod:`elasticctl.rendezvous.liveness`): members of the running round that have not declared
    for the next one, and listen on a liveness port, not probed yet at this revision of their
    declaration (``known``: (node, revision) -> True alive, False gone, None not known). A re-formation after a crash waits for
    exactly these: the dead one's declaration stays until its lease ends, a survivor's is
    replaced within milliseconds. None while more than ``at_most`` are silent: early in a
    re-formation most members have not re-declared yet, and probing them all would cost a
    connection each for nothing."""
    silent = silent_members(current, live)
    if len(silent) > at_most:
        return []
    return [d for d in silent if d.alive_port and (d.node, d.revision) not in known]


def without_dead(live: Iterable[Declaration], known: Mapping[tuple[str, int], bool | None]) -> list[Declaration]:
    """``live`` less the declarations whose process a probe found gone (at that revision)."""
    return [d for d in live if known.get((d.node, d.revision)) is not False]


def last_call_for(current: Round | None, live: Iterable[Declaration], known: Mapping[tuple[str, int], bool | None],
                  last_call: float, running_wait: float) -> float:
    """How long a re-formation waits, once it has quorum, for the members still silent
    (``live``: without the dead). ``last_call``, or ``running_wait`` when every one of them
    answered a probe (it runs: slow to notice on a loaded machine, it will declare within
    moments, and sealing without it would cost a second re-formation at once). A frozen
    member does not answer and keeps the short last call; its lease decides."""
    silent = silent_members(current, live)
    if silent and all(known.get((d.node, d.revision)) is True for d in silent):
        return max(last_call, running_wait)
    return last_call


@dataclasses.dataclass(frozen=True)
class Change:
    """Why a member of a round must re-form: counts for torch's ``num_nodes_waiting``."""

    lost: tuple[str, ...] = ()        # members whose key is gone (lease expired, left)
    moved_on: tuple[str, ...] = ()    # members that want a later round (their workers failed)
    waiting: tuple[str, ...] = ()     # newcomers that fit in the next round
    superseded: bool = False          # a later round was sealed without this node

    @property
    def count(self) -> int:
        return len(self.lost) + len(self.moved_on) + len(self.waiting) + int(self.superseded)


def change_for(node: str, my_round: int, current: Round | None, live: Mapping[str, Declaration],
               max_nodes: int, finished: frozenset[str] = frozenset(),
               counted: Callable[[str], str] = _itself) -> Change:
    """What changed for ``node``, a member of round ``my_round``, in the watched view.

    ``finished``: members whose agent ended with its workers done. Such a member withdraws
    its declaration at shutdown, but it is not lost: the others' workers run to their own
    end (torch's contract: nodes may finish far apart, the exit barrier never fails a job).
    """
    if current is None or current.number != my_round or node not in current.members:
        return Change(superseded=True)
    return observed_change(current, live, max_nodes, finished, counted)


def observed_change(current: Round, live: Mapping[str, Declaration], max_nodes: int,
                    finished: frozenset[str] = frozenset(), counted: Callable[[str], str] = _itself) -> Change:
    """What changed in the running round ``current`` as the declarations ``live`` show it
    (from no member's point of view: what a follower of the declarations publishes)."""
    my_round = current.number
    lost = tuple(m for m in current.members if m not in live and m not in finished)
    moved_on = tuple(m for m in current.members if m in live and live[m].wants > my_round)
    present = {counted(member) for member in current.members}
    room = max_nodes - len(present)
    members = set(current.members)
    # Newcomers that could be admitted (a sharded job's whole nodes: half a node is no reason to
    # re-form yet), as many as fit.
    newcomers = whole_nodes(d for d in sorted(live.values(), key=lambda d: d.revision)
                            if d.node not in members and d.wants > my_round)
    waiting = tuple(fitting([d.node for d in newcomers], {d.node: admission_unit(d) for d in newcomers},
                            max(0, room), counted, present))
    return Change(lost=lost, moved_on=moved_on, waiting=waiting)


# -- who follows the declarations of a running round -------------------------------------
#
# Following every declaration costs a member one notification per declaration: were every
# member of a round of N to follow them, its re-forming (N re-declarations) would cost etcd
# N² notifications. Instead a few members follow them and publish what they see in one small
# record under ctl/ (a Reform), which every member follows anyway: N notifications.


DECLARATION_FOLLOWERS = 3  # any two of them frozen or lost together, the third still publishes


def declaration_followers(current: Round) -> tuple[str, ...]:
    """The members of the running round ``current`` that follow every declaration: rank 0 and,
    up to :data:`DECLARATION_FOLLOWERS` in all, the first members at addresses not yet among
    them (a host that dies or freezes takes its workers, its followers' neighbours, with it), then
    the next ranks. So two hosts failing together (behind one switch, one power feed) still
    leave a follower to publish the loss: the others never wait for a collective timeout to
    learn what etcd already knows. Three followers cost etcd 3 notifications per declaration."""
    if not current.members:
        return ()
    chosen = [0]
    if current.addrs and len(current.addrs) == len(current.members):
        seen = {current.addrs[0]}
        for rank, addr in enumerate(current.addrs):
            if len(chosen) == DECLARATION_FOLLOWERS:
                break
            if addr not in seen:
                seen.add(addr)
                chosen.append(rank)
    for rank in range(1, len(current.members)):
        if len(chosen) == DECLARATION_FOLLOWERS:
            break
        if rank not in chosen:
            chosen.append(rank)
    return tuple(current.members[rank] for rank in sorted(chosen))


def publishes_changes(node: str, current: Round | None, claim: Claim | None) -> bool:
    """Whether ``node`` follows the declarations of the running round ``current`` and publishes
    what changed in it: one of its :func:`declaration_followers`, or the holder of the claim to
    seal the next round (it follows them to seal; the followers stop once they re-declare, and
    a member lost after that is still seen, which the others' failure verdicts need)."""
    if current is None:
        return False
    if claim is not None and claim.node == node and claim.round == current.number + 1:
        return True
    return node in declaration_followers(current)


def reform_due(seen: Change, current: Round, published: Reform | None, closed: bool = False) -> bool:
    """Whether a follower that sees ``seen`` in the running round ``current`` (re)writes the
    :class:`Reform` record, given the one ``published`` (None: none).

    Once the record says the round re-forms, it is rewritten only when the lost members
    change (each member's agent tells a lost member from a finished one by name), not for
    each member that re-declares or newcomer that arrives: that would cost N notifications
    each. An empty one is written when nothing is left to re-form for (a waiting newcomer
    withdrew before anyone moved on). Never once the job is closed: its members then withdraw
    their declarations one by one as they finish, which is not a loss, and the members still
    training run to their own end.
    """
    if closed:
        return False
    if published is None or published.round != current.number:
        return seen.count > 0
    if not seen.count or not published.count:
        return bool(seen.count) != bool(published.count)
    return set(seen.lost) != set(published.lost)


def reform_record(seen: Change, current: Round, node: str) -> Reform:
    """The record a follower ``node`` publishes for what it sees."""
    return Reform(round=current.number, lost=seen.lost, moved_on=seen.moved_on, waiting=seen.waiting,
                  seen_by=node)


def change_from_reform(node: str, my_round: int, current: Round | None, published: Reform | None,
                       finished: frozenset[str] = frozenset()) -> Change:
    """What changed for ``node``, a member of round ``my_round`` that does not follow the
    declarations: the followers' :class:`Reform` record for its round, if any (see
    :func:`change_for` for ``finished``)."""
    if current is None or current.number != my_round or node not in current.members:
        return Change(superseded=True)
    if published is None or published.round != my_round:
        return Change()
    return Change(lost=tuple(m for m in published.lost if m not in finished), moved_on=published.moved_on,
                  waiting=published.waiting)
