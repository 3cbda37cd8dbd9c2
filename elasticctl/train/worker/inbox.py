"""The worker's inbox: what happens outside the training thread reaches the worker as an event
put here, and one thread of the worker's drains it. A signal handler only puts (``SimpleQueue.put``
is reentrant, safe in a handler that interrupted a put): it never reaches into the worker's parts
between two bytecodes of the training thread.

The inbox keeps what the training thread reads at its next step boundary (the stop request, noted
by the put itself and read once there: train/worker/step_boundary.py), and its thread carries out
at once what cannot wait for a boundary, as the lifecycle says (:func:`elasticctl.train.worker.lifecycle.on_stop_request`): the
end of a wait for a generation, the start of the stop bound."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StopRequested:
    """The worker was told to stop (SIGTERM), at ``at`` (monotonic)."""

    at: float = dataclasses.field(default_factory=time.monotonic)


InboxEvent = StopRequested
_CLOSED = object()


class Inbox:
    """Events for worker ``worker``, each handed to ``handle`` on the inbox's own thread, in order."""

    def __init__(self, worker: str, handle: Callable[[InboxEvent], None]) -> None:
        self.worker = worker
        # Set by the put itself (one assignment, as safe in a handler as the put): the next step
        # boundary reads it, not whenever the inbox's thread gets to the event.
        self.stop_requested = False
        self._handle = handle
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def put(self, event: InboxEvent) -> None:
        """From any thread, or a signal handler."""
        if isinstance(event, StopRequested):
            self.stop_requested = True
        self._queue.put(event)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._drain, name="elasticctl-inbox", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Handle what is in the inbox, then stop draining it."""
        self._queue.put(_CLOSED)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _drain(self) -> None:
        while (event := self._queue.get()) is not _CLOSED:
            try:
                self._handle(event)
            except Exception:  # noqa: BLE001 - one event's failure must not end the inbox
                log.exception("[%s] handling %r failed", self.worker, event)
