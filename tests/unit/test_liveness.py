"""The liveness port and its probe, on real sockets on loopback (no etcd, no torch)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest
from support.helpers import wait_for

from elasticctl.rendezvous.liveness import AlivePort, Liveness, probe


def test_a_listening_process_is_alive_and_gone_once_it_closes():
    port = AlivePort("127.0.0.1")
    assert port.port
    assert probe("127.0.0.1", port.port) is Liveness.ALIVE
    assert probe("127.0.0.1", port.port) is Liveness.ALIVE  # accepted and dropped: any number of probes
    port.close()
    assert probe("127.0.0.1", port.port) is Liveness.GONE
    port.close()  # idempotent


def test_an_address_of_another_host_gives_no_port():
    assert AlivePort("192.0.2.1").port == 0  # TEST-NET-1: never an address of this host


@pytest.fixture
def child_with_port():
    code = textwrap.dedent("""
        import sys, time
        from elasticctl.rendezvous.liveness import AlivePort
        print(AlivePort("127.0.0.1").port, flush=True)
        time.sleep(600)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    yield child, int(child.stdout.readline())
    child.kill()
    child.wait()


def test_a_killed_process_is_gone_at_once(child_with_port):
    child, port = child_with_port
    assert probe("127.0.0.1", port) is Liveness.ALIVE
    child.kill()
    child.wait()
    assert probe("127.0.0.1", port) is Liveness.GONE


def test_a_stopped_process_is_neither_gone_nor_alive(child_with_port):
    # The kernel completes the handshake for a frozen process, but nobody answers: a freeze is
    # the lease's to judge, and not worth a longer wait either.
    child, port = child_with_port
    os.kill(child.pid, signal.SIGSTOP)
    try:
        # kill() returns before the child stops: on a loaded machine it may still answer a probe
        stopped = psutil.Process(child.pid)
        wait_for(lambda: stopped.status() == psutil.STATUS_STOPPED, 30, "the child to stop")
        assert probe("127.0.0.1", port) is Liveness.UNKNOWN
    finally:
        os.kill(child.pid, signal.SIGCONT)
    # Woken, it answers again once the scheduler runs it: on a loaded machine that may take longer
    # than one probe's 0.2 s, so the probes go on (as the sealer's do, every REPROBE_ALIVE).
    assert wait_for(lambda: probe("127.0.0.1", port) is Liveness.ALIVE, 30, "the woken process to answer")
