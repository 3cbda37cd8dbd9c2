"""The TCP connections of a generation's gloo groups, and how a failed generation ends them at once.

On gloo a peer's death reaches only the collectives that wait on it directly: the dead peer's
neighbours in the collective's pattern raise at once, the others wait on those neighbours until
the collective's timeout (hot mode's is the node TTL). Neither ``abort()`` nor destroying the
group closes a survivor's connections (pinned in tests/process/test_torch_reconfigure.py; the
DDP module, the mesh and torch's own bookkeeping may all still hold the group), so beyond a
world of three every crash cost the node TTL. What does reach a waiting peer at once is its
connection closing, as the dead peer's did.

So a survivor whose own collective failed (not one that timed out: a frozen peer, which every
survivor waits out alike) shuts its ends of the failed generation's connections down with
``shutdown(2)``: every peer whose collective waits on it sees the connection closed at once,
fails, and does the same, so the failure crosses the whole world in a few round trips, on the
training group and the gloo side group of an NCCL job alike. The descriptors stay gloo's: it
closes them when the group goes.

Which connections: those this process opened while it built the generation's gloo groups
(recorded around the build on the training thread: the training group where it is gloo alone,
else only the gloo side group of the step boundaries, since an NCCL group's own sockets are
its abort's business), less the ports of etcd and the generation's store,
and only while each is still the same socket (a descriptor number reused for another socket is
never touched). Connections a kept group brought over from an earlier generation stay recorded
while they live. The choice is :func:`to_sever` (pure, table-tested); :class:`GenerationConnections`
is the edge that reads the process's sockets and shuts them down.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
from collections.abc import Iterable

import psutil

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Connection:
    """One established TCP connection of this process: its descriptor and both ends."""

    fd: int
    local: tuple[str, int]
    remote: tuple[str, int]


def established(connections: Iterable[object]) -> frozenset[Connection]:
    """The established TCP connections among ``connections`` (psutil's ``pconn`` tuples: fd,
    family, type, laddr, raddr, status)."""
    found = set()
    for conn in connections:
        if conn.fd is None or conn.fd < 0 or conn.status != psutil.CONN_ESTABLISHED or not conn.raddr:
            continue
        found.add(Connection(conn.fd, (conn.laddr[0], conn.laddr[1]), (conn.raddr[0], conn.raddr[1])))
    return frozenset(found)


def opened_by_build(before: frozenset[Connection], after: frozenset[Connection],
                    other_ports: Iterable[int]) -> frozenset[Connection]:
    """The connections a group build opened: in ``after`` and not ``before``, neither end on one
    of ``other_ports`` (etcd's, the generation store's: they carry no collective)."""
    ports = set(other_ports)
    return frozenset(c for c in after - before if c.local[1] not in ports and c.remote[1] not in ports)


def to_sever(recorded: frozenset[Connection], now: frozenset[Connection]) -> frozenset[Connection]:
    """The recorded connections that are still open as the same socket (same descriptor, same two
    ends): those, and only those, are shut down."""
    return recorded & now


class GenerationConnections:
    """The connections of this worker's generations' groups (see the module docstring).

    ``record_build()`` brackets a build on the training thread; ``sever()`` may run on any thread
    (the training thread after its step failed, a watcher that learnt of a loss)."""

    def __init__(self, worker: str, other_ports: Iterable[int] = ()) -> None:
        self.worker = worker
        self._other_ports = frozenset(other_ports)
        self._lock = threading.Lock()
        self._recorded: frozenset[Connection] = frozenset()

    @staticmethod
    def current() -> frozenset[Connection]:
        return established(psutil.Process().net_connections(kind="tcp"))

    def record_build(self, before: frozenset[Connection], store_port: int | None) -> int:
        """Add what the build since ``before`` (:meth:`current` then) opened; forget recorded
        connections that are gone. Returns how many are recorded."""
        now = self.current()
        ports = self._other_ports | ({store_port} if store_port else set())
        with self._lock:
            self._recorded = to_sever(self._recorded, now) | opened_by_build(before, now, ports)
            return len(self._recorded)

    def sever(self) -> int:
        """Shut down every recorded connection still open: a collective pending on one raises, here
        and at its other end. Returns how many were shut down."""
        with self._lock:
            chosen, self._recorded = to_sever(self._recorded, self.current()), frozenset()
        severed = 0
        for conn in chosen:
            try:
                # A duplicate of the descriptor: shutdown(2) acts on the socket, and closing the
                # duplicate leaves gloo's descriptor open, for gloo to close.
                with socket.socket(fileno=os.dup(conn.fd)) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
                severed += 1
            except OSError:  # closed in between, or never connected: nothing left to end
                continue
        if severed:
            log.info("[%s] shut down %d connection(s) of the failed generation's groups, so that every "
                     "peer's pending collective ends now", self.worker, severed)
        return severed
