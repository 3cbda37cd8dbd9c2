"""Lease renewals over one long-lived ``LeaseKeepAlive`` stream per connection.

etcd renews a lease only through its bidirectional ``LeaseKeepAlive`` stream. pyetcd's
``refresh_lease`` opens a new stream for every renewal (and gRPC a thread to feed it): about
1.2 ms of the client's CPU a renewal against 0.3 ms for a read, measured on this project's
2-core machine. A node renews its rendezvous lease every ttl/3 seconds; a process with many
agents (a rendezvous bench of 1,000 handlers over 8 processes) spent a good part of the machine
on opening streams, which made the round longer, which made more renewals fall in it, until
some came too late and their leases expired. Here each renewal is one message on a stream that
stays open, answered on it in order.

A renewal not answered within the connection's timeout breaks the stream (the next renewal opens
another): a late answer must not be taken for the answer to a later renewal. The caller
(:meth:`elasticctl.etcd.client.EtcdClient.refresh_lease`) retries as it retries any request.
"""

from __future__ import annotations

import collections
import concurrent.futures
import queue
import threading

import grpc
from pyetcd import exceptions as etcd_exc
from pyetcd.etcdrpc import rpc_pb2 as etcdrpc

_CLOSE = None  # ends the stream of requests


class KeepAliveStream:
    """One ``LeaseKeepAlive`` stream on ``raw`` (a pyetcd client), shared by every renewal of
    the client's leases."""

    def __init__(self, raw) -> None:
        self.raw = raw
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiting: dict[int, collections.deque[concurrent.futures.Future]] = collections.defaultdict(
            collections.deque)
        self._broken: BaseException | None = None
        self._responses = raw.leasestub.LeaseKeepAlive(
            self._feed(), credentials=raw.call_credentials, metadata=raw.metadata)
        self._reader = threading.Thread(target=self._read, name="elasticctl-lease-keepalive", daemon=True)
        self._reader.start()

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def renew(self, lease_id: int, timeout: float) -> int:
        """Renew ``lease_id``; its new TTL (0: etcd no longer knows it). Raises the stream's
        gRPC error if it broke, or pyetcd's ConnectionTimeoutError after ``timeout`` s."""
        answer: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._broken is not None:
                raise self._broken
            self._waiting[lease_id].append(answer)
        self._requests.put(etcdrpc.LeaseKeepAliveRequest(ID=lease_id))
        try:
            return answer.result(timeout)
        except concurrent.futures.TimeoutError:
            late = etcd_exc.ConnectionTimeoutError(f"no answer to a lease renewal within {timeout:g} s")
            self._break(late)
            raise late from None

    def close(self) -> None:
        self._break(etcd_exc.ConnectionFailedError("the lease keep-alive stream was closed"))

    def join(self, timeout: float | None) -> None:
        if self._reader is not threading.current_thread():
            self._reader.join(timeout)

    # -- the stream's two ends --------------------------------------------------------

    def _feed(self):
        while True:
            request = self._requests.get()
            if request is _CLOSE:
                return
            yield request

    def _read(self) -> None:
        error: BaseException
        try:
            for response in self._responses:
                with self._lock:
                    waiting = self._waiting.get(response.ID)
                    answer = waiting.popleft() if waiting else None
                if answer is not None and not answer.done():
                    answer.set_result(response.TTL)
            error = etcd_exc.ConnectionFailedError("etcd ended the lease keep-alive stream")
        except grpc.RpcError as exc:
            # Cancelled: this client closed the connection (another request reconnects) or the
            # stream; whatever renewal waited may go again on a new one. Any other status says
            # what etcd said (a leader change, an expired token) and is judged as every request's.
            cancelled = exc.code() == grpc.StatusCode.CANCELLED if hasattr(exc, "code") else False
            error = etcd_exc.ConnectionFailedError("the lease keep-alive stream was cancelled") if cancelled else exc
        self._break(error)

    def _break(self, error: BaseException) -> None:
        """End the stream: every renewal waiting on it fails with ``error``."""
        with self._lock:
            first = self._broken is None
            if first:
                self._broken = error
            waiting = [answer for answers in self._waiting.values() for answer in answers]
            self._waiting.clear()
        if first:
            self._requests.put(_CLOSE)
            self._responses.cancel()
        for answer in waiting:
            if not answer.done():
                answer.set_exception(error)
