"""A task run on its own thread whenever it is asked for, latest-wins: the rendezvous view's watch
threads ask for the member's ``ctl/reform`` publish (an etcd write) without waiting for it.

A write on a watch thread delays every event queued behind it by a round trip (or by the
client's whole retry time while etcd is away). Here the watch only raises a flag; the writer
thread runs the task, which reads the view as it is by then. Asks that arrive while it runs
collapse into one more run: the queue is at most one deep, so it never backs up, and the last
change is never left out (the run after it sees it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class LatestWinsWriter:
    """Runs ``task()`` on one thread of its own (started at the first :meth:`request`), again
    after each :meth:`request`, never more than once behind: requests made while it runs
    collapse into one run after it. :meth:`stop` ends the thread; requests after it do nothing."""

    def __init__(self, task: Callable[[], None], name: str) -> None:
        self._task = task
        self._name = name
        self._lock = threading.Lock()
        self._wanted = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.runs = 0  # how many times the task ran (for tests and logs)

    def request(self) -> None:
        """Ask for one more run of the task, with whatever state it reads then (returns at once)."""
        with self._lock:
            if self._stopped:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._wanted.set()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            if self._stopped:
                return
            self._wanted.clear()  # before the task: a request made during it runs it once more
            try:
                self._task()
            except Exception:  # noqa: BLE001 - the writer outlives one failed write
                log.exception("%s: the task failed; it runs again at the next request", self._name)
            self.runs += 1

    def stop(self, timeout: float | None = None) -> None:
        """Stop taking requests and wait up to ``timeout`` for a run in progress to end."""
        with self._lock:
            self._stopped = True
            thread = self._thread
        self._wanted.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
