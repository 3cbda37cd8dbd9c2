"""Which of a worker's TCP connections a failed generation shuts down (elasticctl/train/groups/connections.py):
the pure choices, on made-up connection tables; and the edge on real loopback sockets.

Layer tests/unit: no etcd, no training processes.
"""

from __future__ import annotations

import socket
from types import SimpleNamespace

import psutil
import pytest

from elasticctl.train.groups.connections import Connection, GenerationConnections, established, opened_by_build, to_sever

GLOO_A = Connection(7, ("127.0.0.1", 40001), ("127.0.0.1", 50001))
GLOO_B = Connection(8, ("127.0.0.1", 50002), ("127.0.0.1", 40002))
ETCD = Connection(9, ("127.0.0.1", 41000), ("127.0.0.1", 2379))
STORE = Connection(10, ("127.0.0.1", 41001), ("127.0.0.1", 29500))
STORE_SERVED = Connection(11, ("127.0.0.1", 29500), ("127.0.0.1", 41002))  # rank 0's end of a peer's store client
OLD = Connection(5, ("127.0.0.1", 40100), ("127.0.0.1", 50100))


def pconn(fd, laddr, raddr, status=psutil.CONN_ESTABLISHED):
    return SimpleNamespace(fd=fd, laddr=laddr, raddr=raddr, status=status)


@pytest.mark.parametrize("rows, expected", [
    ([pconn(7, ("127.0.0.1", 40001), ("127.0.0.1", 50001))], {GLOO_A}),
    # a listening socket (gloo's own listener: shut down, its thread ends the process) is never one
    ([pconn(3, ("0.0.0.0", 40001), (), psutil.CONN_LISTEN)], set()),
    # a connection its peer closed already, or no descriptor of this process
    ([pconn(7, ("127.0.0.1", 40001), ("127.0.0.1", 50001), psutil.CONN_CLOSE_WAIT)], set()),
    ([pconn(-1, ("127.0.0.1", 40001), ("127.0.0.1", 50001))], set()),
    ([pconn(None, ("127.0.0.1", 40001), ("127.0.0.1", 50001))], set()),
])
def test_only_established_connections_of_this_process_count(rows, expected):
    assert established(rows) == expected


@pytest.mark.parametrize("before, after, other_ports, expected", [
    # what the build opened, and nothing that was there before it
    ({OLD}, {OLD, GLOO_A, GLOO_B}, (), {GLOO_A, GLOO_B}),
    # etcd's and the generation store's (either end: a client's or rank 0's served one) carry no collective
    (set(), {GLOO_A, ETCD, STORE, STORE_SERVED}, (2379, 29500), {GLOO_A}),
    # a descriptor number reused for another socket during the build is a new connection
    ({Connection(7, ("127.0.0.1", 1), ("127.0.0.1", 2))}, {GLOO_A}, (), {GLOO_A}),
    (set(), set(), (2379,), set()),
])
def test_a_build_s_connections_are_those_it_opened_but_etcd_s_and_the_store_s(before, after, other_ports, expected):
    assert opened_by_build(frozenset(before), frozenset(after), other_ports) == expected


@pytest.mark.parametrize("recorded, now, expected", [
    ({GLOO_A, GLOO_B}, {GLOO_A, GLOO_B, ETCD}, {GLOO_A, GLOO_B}),
    ({GLOO_A, GLOO_B}, {GLOO_B}, {GLOO_B}),  # gone already: nothing to end
    # the same descriptor now holds another socket (closed, then reused): never touched
    ({GLOO_A}, {Connection(7, ("127.0.0.1", 40001), ("127.0.0.1", 2379))}, set()),
    (set(), {GLOO_A}, set()),
])
def test_only_a_recorded_connection_still_the_same_socket_is_shut_down(recorded, now, expected):
    assert to_sever(frozenset(recorded), frozenset(now)) == expected


def test_shut_down_connections_reach_the_other_end_and_leave_the_rest_alone():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        kept = socket.create_connection(("127.0.0.1", port))  # there before the "build"
        kept_peer, _ = server.accept()
        connections = GenerationConnections("w.0")
        before = GenerationConnections.current()
        built = socket.create_connection(("127.0.0.1", port))
        built_peer, _ = server.accept()
        try:
            # the server's accepted ends share the listening port, which the "build" did not open:
            # exclude nothing, so the server side of the new connection is recorded too
            assert connections.record_build(before, store_port=None) == 2
            assert connections.sever() == 2
            assert built.recv(1) == b""  # the other end sees the connection closed
            kept.sendall(b"x")
            assert kept_peer.recv(1) == b"x"  # what the build did not open still works
            assert connections.sever() == 0  # once: the record is spent
        finally:
            for sock in (kept, kept_peer, built, built_peer):
                sock.close()
