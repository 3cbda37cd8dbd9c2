"""A generation's store: a member that reaches it before its rank 0 listens connects as soon as it
listens, not after the TCPStore client's own backoff; a rank 0 that never listens is named.

Layer tests/unit: real sockets and real TCPStores on loopback, in this process."""

from __future__ import annotations

import datetime
import socket
import threading
import time

import pytest

from elasticctl.job.records import Round
from elasticctl.train.process_group import generation_store, wait_until_listening

LOOPBACK = "127.0.0.1"
TIMEOUT = datetime.timedelta(seconds=10)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


def _generation(port: int) -> Round:
    return Round(number=7, members=("a.0", "b.0"), addrs=(LOOPBACK, LOOPBACK), master_port=port)


def test_a_port_that_listens_is_seen_at_once():
    with socket.socket() as server:
        server.bind((LOOPBACK, 0))
        server.listen()
        assert wait_until_listening(LOOPBACK, server.getsockname()[1], timeout=5)


def test_a_port_nobody_opens_is_given_up_at_the_timeout():
    started = time.monotonic()
    assert not wait_until_listening(LOOPBACK, _free_port(), timeout=0.3)
    assert time.monotonic() - started < 5  # bounded by the timeout, not by a connect's own


def test_a_member_early_at_the_store_connects_once_rank_0_listens():
    port = _free_port()
    stores: dict[str, object] = {}
    refused_once = threading.Event()

    def member() -> None:
        with pytest.raises(OSError):  # rank 0 is not listening yet: this member is early
            socket.create_connection((LOOPBACK, port), timeout=1).close()
        refused_once.set()
        stores["member"] = generation_store(_generation(port), 1, TIMEOUT)

    early = threading.Thread(target=member)
    early.start()
    assert refused_once.wait(10)
    master = generation_store(_generation(port), 0, TIMEOUT)
    early.join(15)
    assert not early.is_alive()
    stores["member"].set("from-member", "1")
    assert master.get("from-member") == b"1"


def test_a_rank_0_that_never_listens_is_named():
    port = _free_port()
    with pytest.raises(TimeoutError, match=rf"generation 7 at 127\.0\.0\.1:{port} \(its rank 0\) did not listen"):
        generation_store(_generation(port), 1, datetime.timedelta(seconds=0.3))
