"""A TCP proxy on loopback that can make a server answer late: for contract tests of what a client
does when etcd is slow rather than down.

It forwards bytes both ways unchanged (grpc over it works: HTTP/2 is just bytes to it). While its
``delay`` is set, every chunk it reads is passed on ``delay`` seconds later, in order: a chunk never
overtakes one read before it, so that lowering the delay drains what was held back first, as a
server that caught up after a slow while would.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time

_CHUNK = 65536


class SlowProxy:
    """Listens on 127.0.0.1 (``port``) and forwards each connection to ``host:target_port``."""

    def __init__(self, host: str, target_port: int) -> None:
        self._target = (host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.delay = 0.0
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="slow-proxy-accept", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(self._target)
            except OSError:
                client.close()
                continue
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets += [client, server]
            self._pump(client, server)
            self._pump(server, client)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        """Forward ``source`` to ``sink``: a reader stamps each chunk with when it is due, a writer
        sends it then (two threads, so that holding a chunk back never stops the reading)."""
        held: queue.Queue[tuple[float, bytes]] = queue.Queue()

        def read() -> None:
            due = 0.0
            while True:
                try:
                    data = source.recv(_CHUNK)
                except OSError:
                    data = b""
                due = max(due, time.monotonic() + self.delay)  # in order, whatever the delay now
                held.put((due, data))
                if not data:
                    return

        def write() -> None:
            while True:
                due, data = held.get()
                pause = due - time.monotonic()
                if pause > 0 and self._closed.wait(pause):
                    return
                try:
                    if not data:
                        sink.shutdown(socket.SHUT_WR)
                        return
                    sink.sendall(data)
                except OSError:
                    return

        threading.Thread(target=read, name="slow-proxy-read", daemon=True).start()
        threading.Thread(target=write, name="slow-proxy-write", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def __enter__(self) -> SlowProxy:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
