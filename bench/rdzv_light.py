"""One process of light simulated agents for bench.rendezvous: the protocol's real etcd
operations, with asyncio and one etcd connection (gRPC channel) per process instead of a
torchrun agent, a client and threads per agent.

Each simulated agent does what :class:`elasticctl.rendezvous.member.RoundMember` does on the
wire: a lease of its own, its declaration bound to it (one put), one compare-and-swap for the
claim to seal when it sees nobody holding it; the holder reads and watches ``nodes/`` and seals
with one transaction when :func:`~elasticctl.rendezvous.rounds.seal_due` says so. The records
are the real ones (:mod:`elasticctl.job.records`, keys from :class:`~elasticctl.job.keys.JobKeys`)
and the decisions the real pure functions (:mod:`elasticctl.rendezvous.rounds`). Left out: lease
keep-alives (the leases outlive the round: their TTL exceeds the bench's timeout), the c10d
store, torch.

Watches: ``watchers="agent"`` gives every agent its own watch of ``ctl/`` (multiplexed on the
process's one watch stream), so etcd sends each change once per agent, as it does to real
agents; ``"process"`` one per process (etcd's fan-out is then P, not N: at 10,000 agents the
sealed round, ~25 bytes per member, sent to every agent would be 2.5 GB).

Modes (``spec["mode"]``):

* ``round``: one round of N agents from nothing (min = max = N), timed from "go".
* ``hot``: N running workers in a sealed generation (the harness seals it); after "go" the
  harness revokes one worker's lease, and the survivors re-form: the declaration followers
  (``policy="followers"``: :func:`~elasticctl.rendezvous.rounds.declaration_followers`, who
  publish ``ctl/reform``) or every worker (``policy="every-member"``: the protocol before
  the declaration followers) see the loss; each survivor re-declares for the next generation as
  soon as it learns it must re-form, and the claim holder seals it.

Spoken over pipes as bench.rdzv_worker: the spec line, then ``go``, then ``stop`` (or EOF).
stdout (``@rdzv `` lines): ``{"ready", "setup_s", "rss", "base_rss"}``; then per agent
``{"index", "rank", "world_size", "t"}`` or ``{"index", "error"}``; hot mode also ``{"seal_t"}``
from the sealer; at "stop" ``{"events", "watches"}`` (watch events this process received
since "go", and its watches) and ``{"shutdown", "stuck": 0}``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import sys
import time

import grpc
import psutil
from pyetcd.etcdrpc import kv_pb2
from pyetcd.etcdrpc import rpc_pb2 as rpc
from pyetcd.etcdrpc import rpc_pb2_grpc as rpc_grpc

from elasticctl.job.keys import JobKeys
from elasticctl.job.rdzv_records import RoundRecords
from elasticctl.job.records import Claim, Declaration, Round
from elasticctl.rendezvous import rounds

PREFIX = "@rdzv "
DELETE = kv_pb2.Event.DELETE
# Requests one process has in flight at most: etcd refuses requests ("too many requests") once
# its applied index lags the committed one by 5,000 entries, which 10,000 agents' lease grants
# and declarations at once reach on two cores. A connection's window, not a pause: the agents
# of a process queue behind it.
IN_FLIGHT = 256
TOO_MANY = "too many requests"


def emit(**message) -> None:
    sys.stdout.write(PREFIX + json.dumps(message) + "\n")
    sys.stdout.flush()


def range_end(prefix: bytes) -> bytes:
    """The end of etcd's range of keys under ``prefix``."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


class Etcd:
    """One gRPC channel to etcd, its stubs, and one watch stream many watches share."""

    def __init__(self, endpoint: str) -> None:
        self.channel = grpc.aio.insecure_channel(endpoint, options=[
            ("grpc.max_receive_message_length", 256 * 2**20), ("grpc.max_send_message_length", 64 * 2**20)])
        self.kv = rpc_grpc.KVStub(self.channel)
        self.leases = rpc_grpc.LeaseStub(self.channel)
        self._watch = rpc_grpc.WatchStub(self.channel)
        self._requests: asyncio.Queue = asyncio.Queue()
        self._pending: collections.deque = collections.deque()  # handlers of watches being created
        self._handlers: dict[int, object] = {}
        self._create = asyncio.Lock()
        self._window = asyncio.Semaphore(IN_FLIGHT)
        self.refused = 0  # requests etcd refused as too many, and that were sent again
        self.events = 0  # watch events received (every watch of this process)
        self.watches = 0

    async def start(self) -> None:
        self._call = self._watch.Watch(self._outgoing())
        self._reader = asyncio.create_task(self._read())

    async def _outgoing(self):
        while (request := await self._requests.get()) is not None:
            yield request

    async def _read(self) -> None:
        async for response in self._call:
            if response.created:
                handler, created = self._pending.popleft()
                self._handlers[response.watch_id] = handler
                created.set_result(response.watch_id)
            if response.events:
                self.events += len(response.events)
                handler = self._handlers.get(response.watch_id)
                if handler is not None:
                    handler(response.events)

    async def watch(self, prefix: bytes, start_revision: int, handler) -> int:
        """Watch ``prefix`` from ``start_revision``: ``handler(events)`` per response; the watch id."""
        async with self._create:  # etcd answers creations in order: one at a time
            created = asyncio.get_running_loop().create_future()
            self._pending.append((handler, created))
            self._requests.put_nowait(rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
                key=prefix, range_end=range_end(prefix), start_revision=start_revision)))
            watch_id = await created
        self.watches += 1
        return watch_id

    def cancel(self, watch_id: int) -> None:
        self._handlers.pop(watch_id, None)
        self._requests.put_nowait(rpc.WatchRequest(cancel_request=rpc.WatchCancelRequest(watch_id=watch_id)))
        self.watches -= 1

    async def _request(self, call, request):
        """``call(request)`` within the window, sent again after a pause if etcd refuses it as
        too many (as EtcdClient retries a member that is briefly unavailable)."""
        pause = 0.05
        while True:
            async with self._window:
                try:
                    return await call(request)
                except grpc.aio.AioRpcError as exc:
                    if TOO_MANY not in (exc.details() or ""):
                        raise
                    self.refused += 1
            await asyncio.sleep(pause)
            pause = min(1.0, pause * 2)

    async def read_prefix(self, prefix: bytes):
        response = await self._request(self.kv.Range, rpc.RangeRequest(key=prefix, range_end=range_end(prefix)))
        return response.kvs, response.header.revision

    async def grant(self, ttl: int) -> int:
        return (await self._request(self.leases.LeaseGrant, rpc.LeaseGrantRequest(TTL=ttl))).ID

    async def put(self, key: str, value: str, lease: int = 0) -> int:
        response = await self._request(self.kv.Put, rpc.PutRequest(key=key.encode(), value=value.encode(),
                                                                   lease=lease))
        return response.header.revision

    async def compare_and_swap(self, key: str, value: str, mod_revision: int, lease: int = 0,
                               also_delete: str | None = None) -> bool:
        """As EtcdClient.compare_and_swap: put ``key`` if its mod revision is ``mod_revision``
        (0: absent), and delete ``also_delete``, in one transaction."""
        if mod_revision == 0:
            compare = rpc.Compare(result=rpc.Compare.EQUAL, target=rpc.Compare.VERSION, key=key.encode(), version=0)
        else:
            compare = rpc.Compare(result=rpc.Compare.EQUAL, target=rpc.Compare.MOD, key=key.encode(),
                                  mod_revision=mod_revision)
        success = [rpc.RequestOp(request_put=rpc.PutRequest(key=key.encode(), value=value.encode(), lease=lease))]
        if also_delete is not None:
            success.append(rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=also_delete.encode())))
        response = await self._request(self.kv.Txn, rpc.TxnRequest(compare=[compare], success=success))
        return response.succeeded

    async def close(self) -> None:
        self._requests.put_nowait(None)
        self._reader.cancel()
        await self.channel.close()


class CtlView:
    """The ``ctl/`` keys as this process sees them (the round, the claim, the re-form record),
    applied from one of its watches; ``changed`` wakes every agent waiting on it."""

    def __init__(self, records: RoundRecords) -> None:
        self.records = records
        self.round: Round | None = None
        self.round_revision = 0
        self.claim: Claim | None = None
        self.claim_revision = 0
        self.reform = None
        self.reform_revision = 0
        self.changed = asyncio.Condition()

    def apply(self, key: bytes, value: bytes, revision: int, lease: int, deleted: bool) -> None:
        name = key.decode()
        if name == self.records.round_key:
            self.round = None if deleted else self.records.round_from(value, revision) or self.round
            self.round_revision = 0 if deleted else revision
        elif name == self.records.claim_key:
            self.claim = None if deleted or not lease else self.records.claim_from(value)
            self.claim_revision = 0 if deleted else revision
        elif name == self.records.reform_key:
            self.reform = None if deleted else self.records.reform_from(value, revision)
            self.reform_revision = 0 if deleted else revision

    def on_events(self, events) -> None:
        for event in events:
            deleted = event.type == DELETE
            self.apply(event.kv.key, event.kv.value, event.kv.mod_revision, event.kv.lease, deleted)
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait(self, predicate, timeout: float | None = None) -> bool:
        async with self.changed:
            return await asyncio.wait_for(self.changed.wait_for(predicate), timeout)


class Declarations:
    """The ``nodes/`` keys, followed by one agent of this process (the claim holder, a follower)."""

    def __init__(self, etcd: Etcd, records: RoundRecords, on_change) -> None:
        self.etcd, self.records, self._on_change = etcd, records, on_change
        self.live: dict[str, Declaration] = {}
        self.want_counts: collections.Counter[int] = collections.Counter()
        self.watch_id: int | None = None

    async def follow(self) -> None:
        kvs, revision = await self.etcd.read_prefix(self.records.nodes_prefix.encode())
        for kv in kvs:
            self._put(kv.key, kv.value, kv.mod_revision)
        self.watch_id = await self.etcd.watch(self.records.nodes_prefix.encode(), revision + 1, self._events)
        self._on_change()

    def stop(self) -> None:
        if self.watch_id is not None:
            self.etcd.cancel(self.watch_id)
            self.watch_id = None

    def _put(self, key: bytes, value: bytes, revision: int) -> None:
        node, declaration = self.records.declaration_at(key, value, revision)
        previous = self.live.pop(node, None)
        if previous is not None:
            self.want_counts[previous.wants] -= 1
        if declaration is not None:
            self.live[node] = declaration
            self.want_counts[declaration.wants] += 1

    def _events(self, events) -> None:
        for event in events:
            self._put(event.kv.key, b"" if event.type == DELETE else event.kv.value, event.kv.mod_revision)
        self._on_change()


class Agents:
    """This process's simulated agents (or hot workers) and the one connection they share."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.keys = JobKeys(spec["run_id"]) if spec["mode"] == "round" else JobKeys(spec["run_id"]).generations()
        self.records = RoundRecords(None, self.keys)  # records and keys only: the I/O is Etcd's
        self.etcd = Etcd(spec["endpoint"])
        self.view = CtlView(self.records)
        self.names = {index: f"agent{index}" for index in spec["indices"]}
        self.leases: dict[int, int] = {}
        self.settings = rounds.Settings(min_nodes=spec["min_nodes"], max_nodes=spec["max_nodes"],
                                        last_call=spec["last_call"])
        self.sealer: asyncio.Task | None = None
        # One claim attempt of this process at a time: its agents share one view of ctl/ and see
        # each other's attempts at once (a real agent tries with its declaration, in one transaction).
        self.claiming = False
        self.events_at_go = 0
        # hot mode
        self.go = asyncio.Event()
        self.followed: dict[int, Declarations] = {}
        self.must_reform: set[int] = set()  # every-member: the workers that saw the change themselves
        self.reform_event = asyncio.Event()

    async def setup(self) -> None:
        await self.etcd.start()
        kvs, revision = await self.etcd.read_prefix(self.records.ctl_prefix.encode())
        for kv in kvs:
            self.view.apply(kv.key, kv.value, kv.mod_revision, kv.lease, False)
        # Every watch but the first is only counted: they all see the same changes.
        watchers = len(self.names) if self.spec["watchers"] == "agent" else 1
        for k in range(watchers):
            handler = self.view.on_events if k == 0 else (lambda events: None)
            await self.etcd.watch(self.records.ctl_prefix.encode(), revision + 1, handler)
        if self.spec["mode"] == "hot":
            await asyncio.gather(*(self._declare(index, 1) for index in self.names))

    async def _declare(self, index: int, wants: int) -> None:
        if index not in self.leases:
            self.leases[index] = await self.etcd.grant(self.spec["ttl"])
        name = self.names[index]
        key = self.keys.rdzv_node(name)
        declaration = Declaration(name, "127.0.0.1", wants, os.getpid(), port=0)
        await self.etcd.put(key, declaration.to_json(key), self.leases[index])

    # -- one round, from nothing ---------------------------------------------------------

    async def join(self, index: int, target: int) -> None:
        """Declare for ``target`` and wait until it is sealed, claiming it if nobody holds it."""
        name = self.names[index]
        try:
            await self._declare(index, target)
            view = self.view
            while True:
                current = view.round
                if current is not None and current.number >= target:
                    if name in current.members:
                        emit(index=index, rank=current.members.index(name), world_size=current.world_size,
                             t=time.time())
                    else:
                        emit(index=index, error=f"round {current.number} sealed without {name}", t=time.time())
                    return
                unclaimed = view.claim is None or view.claim.round != target
                if unclaimed and self.sealer is None and not self.claiming:
                    claim = Claim(name, target)
                    self.claiming = True
                    try:
                        won = await self.etcd.compare_and_swap(
                            self.records.claim_key, claim.to_json(self.records.claim_key), view.claim_revision,
                            self.leases[index])
                    finally:
                        self.claiming = False
                    if won:
                        self.sealer = asyncio.create_task(self._seal(name, target, index))
                    await self.view._notify()  # the others of this process look again
                    if won or view.claim is not None:
                        continue
                    # Lost to a claim this view has not seen yet: wait for it, as RoundMember does.
                    try:
                        await view.wait(lambda: view.claim is not None or view.round is not None, 0.5)
                    except asyncio.TimeoutError:
                        pass
                    continue
                seen = (view.round_revision, view.claim_revision, self.claiming, self.sealer is None)
                await view.wait(lambda: (view.round_revision, view.claim_revision, self.claiming,
                                         self.sealer is None) != seen)
        except Exception as exc:  # noqa: BLE001 - a failed agent is a result the harness reports
            emit(index=index, error=f"{type(exc).__name__}: {exc}"[:300], t=time.time())

    async def _seal(self, name: str, target: int, index: int) -> None:
        """The claim holder: follow the declarations, seal when seal_due says so."""
        wake = asyncio.Event()
        declarations = Declarations(self.etcd, self.records, wake.set)
        await declarations.follow()
        current = self.view.round
        quorum_since = None
        while True:
            wake.clear()
            now = time.monotonic()
            # seal_due's own first test, kept O(1): it sorts every declaration once there are enough.
            enough = declarations.want_counts[target] >= self.settings.min_nodes
            quorum_since = (quorum_since or now) if enough else None
            live = list(declarations.live.values()) if enough else []
            if enough and rounds.seal_due(current, live, self.settings, quorum_since, now):
                candidates = rounds.wanting(current, live)
                members = rounds.next_members(current, candidates, self.settings.max_nodes)
                by_node = {d.node: d for d in candidates}
                sealed = Round(number=target, members=members, addrs=tuple(by_node[m].addr for m in members),
                               master_port=by_node[members[0]].port, sealed_at=round(time.time(), 6))
                if await self.etcd.compare_and_swap(self.records.round_key, sealed.to_json(self.records.round_key),
                                                    self.view.round_revision, also_delete=self.records.claim_key):
                    emit(seal_t=time.time(), members=len(members))
                declarations.stop()
                return
            timeout = None if quorum_since is None else max(0.0, quorum_since + self.settings.last_call - now)
            try:
                await asyncio.wait_for(wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    # -- hot: a sealed generation re-forms after one loss ------------------------------------

    async def run_hot(self) -> None:
        """Every worker of this process, from the sealed generation 1 until generation 2."""
        await self.view.wait(lambda: self.view.round is not None and self.view.round.number == 1, 60)
        current = self.view.round
        mine = [index for index in self.names if self.names[index] in current.members]
        if self.spec["policy"] == "every-member":
            followers = mine
        else:
            followers = [index for index in mine if self.names[index] in rounds.declaration_followers(current)]
        for index in followers:
            self.followed[index] = Declarations(self.etcd, self.records, lambda i=index: self._seen(i))
            await self.followed[index].follow()
        emit(running=len(mine), followers=len(followers))
        await self.go.wait()
        victim = self.spec["victim"]
        if victim in self.names:  # the lost worker: its lease ends (as when it is frozen past its TTL)
            emit(revoked_t=time.time())
            await self.etcd.leases.LeaseRevoke(rpc.LeaseRevokeRequest(ID=self.leases[victim]))
        await asyncio.gather(*(self._worker(index) for index in mine if index != victim))

    def _seen(self, index: int) -> None:
        """A follower's declarations changed: decide as RoundMember does, on its own view."""
        current = self.view.round
        if current is None or current.number != 1 or index in self.must_reform:
            return
        declarations = self.followed[index]
        if self.spec["policy"] == "every-member":
            if rounds.change_for(self.names[index], 1, current, declarations.live, self.settings.max_nodes).count:
                self.must_reform.add(index)
                self.reform_event.set()
            return
        seen = rounds.observed_change(current, declarations.live, self.settings.max_nodes)
        if rounds.reform_due(seen, current, self.view.reform):
            record = rounds.reform_record(seen, current, self.names[index])
            asyncio.get_running_loop().create_task(self.etcd.compare_and_swap(
                self.records.reform_key, record.to_json(self.records.reform_key), self.view.reform_revision))

    async def _worker(self, index: int) -> None:
        """A running worker: at its next look (here: at once), re-form if its generation must."""
        name, view = self.names[index], self.view
        if self.spec["policy"] == "every-member":
            while index not in self.must_reform and view.round.number == 1:
                self.reform_event.clear()
                await self.reform_event.wait()
        else:
            await view.wait(lambda: view.round.number != 1 or rounds.change_from_reform(
                name, 1, view.round, view.reform).count > 0)
        if index in self.followed and self.spec["policy"] != "every-member":
            self.followed.pop(index).stop()  # it re-declares: only the claim holder follows them now
        await self.join(index, 2)


async def serve(spec: dict) -> None:
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    base_rss = psutil.Process().memory_info().rss
    agents = Agents(spec)
    lines: asyncio.Queue = asyncio.Queue()
    loop.add_reader(sys.stdin.fileno(), lambda: lines.put_nowait(sys.stdin.readline()))
    try:
        await agents.setup()
    except Exception as exc:  # noqa: BLE001 - e.g. etcd refused: a result
        emit(setup_error=f"{type(exc).__name__}: {exc}"[:500])
        return
    emit(ready=len(agents.names), setup_s=time.monotonic() - started, rss=psutil.Process().memory_info().rss,
         base_rss=base_rss, watches=agents.etcd.watches)
    if spec["mode"] == "hot":
        hot = asyncio.create_task(agents.run_hot())  # noqa: F841 - the reference keeps the task from being collected
        line = (await lines.get()).strip()
        agents.events_at_go = agents.etcd.events
        if line == "go":
            agents.go.set()
    else:
        line = (await lines.get()).strip()
        agents.events_at_go = agents.etcd.events
        if line == "go":
            tasks = [asyncio.create_task(agents.join(index, 1)) for index in agents.names]  # noqa: F841
    while line not in ("stop", ""):
        line = (await lines.get()).strip()
    emit(events=agents.etcd.events - agents.events_at_go, watches=agents.etcd.watches, refused=agents.etcd.refused)
    emit(shutdown=len(agents.names), stuck=0)


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    asyncio.run(serve(spec))
    sys.stdout.flush()
    os._exit(0)  # the leases stay until their TTL or the harness's etcd goes: nothing to wait for


if __name__ == "__main__":
    main()
