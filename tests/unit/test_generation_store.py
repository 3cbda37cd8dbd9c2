"""A generation's store: a member that reaches it before its rank 0 listens connects as soon as it
listens, not after the TCPStore client's own backoff; a rank 0 that never listens is named.

Layer tests/unit: real sockets and real TCPStores on loopback, in this process; the bounds of the
wait for a port to listen on a clock of the test's own (a wall-time bound reads at random on a
loaded machine)."""

from __future__ import annotations

import contextlib
import datetime
import socket
import threading

import pytest
from support.clock import FakeClock

from elasticctl.job.records import Round
from elasticctl.train.groups.process_group import LISTEN_POLL_S, generation_store, wait_until_listening

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


def test_a_port_nobody_opens_is_given_up():
    assert not wait_until_listening(LOOPBACK, _free_port(), timeout=0.3)


class _Connects:
    """A made-up connect on a FakeClock: refused ``refusals`` times (at once, as on a live host),
    or, ``unreachable``, each attempt spends its whole timeout (a host that never answers)."""

    def __init__(self, clock: FakeClock, refusals: int | None = None, unreachable: bool = False) -> None:
        self.clock, self.refusals, self.unreachable = clock, refusals, unreachable
        self.timeouts: list[float] = []

    def __call__(self, address, timeout: float):
        self.timeouts.append(timeout)
        if self.unreachable:
            self.clock.advance(timeout)
            raise TimeoutError("timed out")
        if self.refusals is None or len(self.timeouts) <= self.refusals:
            raise ConnectionRefusedError("refused")
        return contextlib.nullcontext()


P = LISTEN_POLL_S


@pytest.mark.parametrize("timeout, connect_timeouts", [
    # each connect is bounded by what is left of the timeout (at most 1 s), not by its own; the
    # one after the deadline by the shortest, 0.05 s
    (0.25, [0.25, 0.05]),
    (2.5, [1.0, 1.0, 2.5 - 2 * (1.0 + P), 0.05]),
])
def test_a_host_that_never_answers_is_given_up_at_the_timeout(timeout, connect_timeouts):
    clock = FakeClock()
    began = clock.now
    connects = _Connects(clock, unreachable=True)
    assert not wait_until_listening(LOOPBACK, 1, timeout, clock=clock, sleep=clock.sleep, connect=connects)
    assert connects.timeouts == pytest.approx(connect_timeouts)
    assert clock.pauses == [P] * (len(connect_timeouts) - 1)
    assert clock.now - began == pytest.approx(timeout + P + 0.05)  # the timeout, one poll, one shortest connect


def test_a_port_refused_until_the_timeout_is_polled_briskly_up_to_it():
    clock = FakeClock()
    began = clock.now
    connects = _Connects(clock)
    assert not wait_until_listening(LOOPBACK, 1, 0.1, clock=clock, sleep=clock.sleep, connect=connects)
    assert set(clock.pauses) == {P} and len(connects.timeouts) == len(clock.pauses) + 1
    assert 0.1 <= clock.now - began < 0.1 + P  # the last attempt is at the deadline, none after it


def test_a_port_that_listens_after_refusals_is_seen_at_the_next_poll():
    clock = FakeClock()
    connects = _Connects(clock, refusals=2)
    assert wait_until_listening(LOOPBACK, 1, 5, clock=clock, sleep=clock.sleep, connect=connects)
    assert clock.pauses == [P, P] and connects.timeouts == [1.0, 1.0, 1.0]


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
