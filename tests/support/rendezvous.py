"""Rendezvous states torch would write, and members of one run against a real etcd, each with its
own client and view."""

from __future__ import annotations

import threading

from elasticctl.etcd.client import EtcdClient
from elasticctl.job.keys import JobKeys
from elasticctl.rendezvous.member import RoundMember
from elasticctl.rendezvous.rounds import Settings
from elasticctl.rendezvous.view import RoundView


def torch_state(round_: int) -> bytes:
    """A real torch rendezvous state (the backend refuses anything else), told apart by its round."""
    import pickle

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    state = getattr(dynamic_rendezvous, "_RendezvousState")()  # noqa: B009 - torch's private state class
    state.round = round_
    return pickle.dumps(state)


class Run:
    """Members of one run, each with its own client and view, as separate agents would have."""

    def __init__(self, etcd, run_id: str, settings: Settings, node_ttl: int = 2, join_timeout: float = 30) -> None:
        self.etcd, self.keys = etcd, JobKeys(run_id)
        self.settings, self.node_ttl, self.join_timeout = settings, node_ttl, join_timeout
        self.members: list[RoundMember] = []
        self.clients: list[EtcdClient] = []

    def member(self, node: str, node_workers: int = 0) -> RoundMember:
        """A member named ``node``; ``node_workers``: as a worker of a sharded job's node that brings
        that many (named ``<node>.<local rank>``), admitted only with all of them."""
        client = EtcdClient(self.etcd.client_settings())
        self.clients.append(client)
        view = RoundView(client, self.keys).start()
        member = RoundMember(client, view, node, f"addr-{node}", self.settings, self.node_ttl, self.join_timeout,
                             node_workers=node_workers)
        self.members.append(member)
        return member

    def join_all(self, members: list[RoundMember]) -> dict[str, object]:
        results: dict[str, object] = {}

        def join(m: RoundMember) -> None:
            try:
                results[m.node] = m.join()
            except Exception as exc:  # noqa: BLE001 - reported to the test
                results[m.node] = exc

        threads = [threading.Thread(target=join, args=(m,)) for m in members]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    def close(self) -> None:
        for m in self.members:
            m.view.stop()
            if m._lease is not None:
                m._lease.stop(revoke=False)
        # Together: a client's close() may wait on stream threads another client of this process
        # opened at the same moment (EtcdClient._streaming), which end only when that one closes.
        closers = [threading.Thread(target=c.close) for c in self.clients]
        for t in closers:
            t.start()
        for t in closers:
            t.join()
