"""Is a declared process still there? A port it listens on while it lives, and a probe.

A member's declaration stays in etcd until its lease ends (``node_ttl``, seconds), so a
re-formation after a crash would wait its whole last call for a process that no longer
exists. The kernel knows sooner: when a process dies, its sockets close with it, and a
connection to its listening port is refused at once (a RST, on the same host or across the
network). So every declaring process listens on a port of its own (:class:`AlivePort`,
``Declaration.alive_port``), and a thread of its own answers each connection with one byte;
the sealer, waiting for a member that has not re-declared, connects once (:func:`probe`):

* refused: the process is gone; the round is sealed without waiting for it;
* the byte came: the process runs (it is slow to notice, e.g. on a loaded machine): it will
  declare, and is worth waiting for longer than a last call;
* anything else (no byte in time: a frozen process, whose kernel still completes the
  handshake; a machine powered off; a network cut): not known; wait as before.

A refusal can only be wrong towards a re-formation more (a live member sealed out
re-declares as a newcomer), never towards training beside a member. Nothing is read
from the prober.
"""

from __future__ import annotations

import enum
import errno
import logging
import socket
import threading

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 0.2  # seconds; a refusal comes back within a round trip, the byte soon after
# Probes of one declaration before "no answer" stands: a process starved of CPU (the overload
# test: every core busy) can miss one probe's 0.2 s and answer the next.
PROBE_ATTEMPTS = 3
# A member found running is probed again after this long while it stays silent: found running a
# moment before it died (a host's processes are killed one by one; the first death is what made
# the others re-declare), it would otherwise be waited for until its lease ends.
REPROBE_ALIVE = 0.5
ALIVE_BYTE = b"+"


class Liveness(enum.Enum):
    ALIVE = "alive"
    GONE = "gone"
    UNKNOWN = "unknown"


def probe(addr: str, port: int, timeout: float = PROBE_TIMEOUT) -> Liveness:
    """Connect to ``addr:port`` once and say what that shows of the process listening there."""
    try:
        with socket.create_connection((addr, port), timeout=timeout) as connection:
            return Liveness.ALIVE if connection.recv(1) == ALIVE_BYTE else Liveness.UNKNOWN
    except ConnectionRefusedError:
        return Liveness.GONE
    except OSError as exc:  # a timeout included
        if exc.errno == errno.ECONNREFUSED:
            return Liveness.GONE
        return Liveness.UNKNOWN


class AlivePort:
    """A port this process listens on until :meth:`close` (or its death): see the module doc."""

    def __init__(self, addr: str) -> None:
        self.port = 0
        self._sock: socket.socket | None = None
        try:
            family = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0][0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.bind((addr, 0))
            sock.listen(64)
        except OSError as exc:
            # Not an address of this host (a NAT, a name for another interface): no probes of
            # this process, the others wait for its lease as before.
            log.info("no liveness port on %s (%s); a loss of this process is seen when its lease ends", addr, exc)
            return
        self._sock, self.port = sock, sock.getsockname()[1]
        threading.Thread(target=self._accept, args=(sock,), name="elasticctl-alive-port", daemon=True).start()

    def _accept(self, sock: socket.socket) -> None:
        while True:
            try:
                connection, _ = sock.accept()
            except OSError:
                return  # closed
            try:
                connection.sendall(ALIVE_BYTE)
            except OSError:
                pass  # the prober gave up already
            finally:
                connection.close()

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        sock.close()
