"""Keys under an etcd prefix, read once and then kept current by a watch.

The one way elasticctl follows keys that other processes write: read the prefix and
the revision it was read at, watch from the next revision, and when the stream
breaks (an etcd member restarts, a leader changes, history was compacted) read
everything again and watch from the new revision. Nothing polls.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

from elasticctl.errors import ElasticctlError
from elasticctl.etcd.client import EtcdClient, KeyValue

log = logging.getLogger(__name__)

_RETRY_DELAY = 0.2


class PrefixWatch:
    """Follows ``prefix``: :meth:`_load` gets a full read, :meth:`_apply` each watch response.

    Subclasses keep whatever view they need; both hooks run on the watch thread (the
    first :meth:`_load` on the caller's, in :meth:`start`).
    """

    def __init__(self, client: EtcdClient, prefix: str) -> None:
        self._client = client
        self.prefix = prefix
        self.revision = 0
        self._stopped = threading.Event()
        self._cancel: Callable[[], None] | None = None
        self._thread: threading.Thread | None = None

    def start(self):
        self._reload()
        if self._stopped.is_set():
            return self  # stopped while it loaded: no watch to start
        thread = threading.Thread(target=self._watch_forever, name=f"elasticctl-watch {self.prefix}", daemon=True)
        thread.start()
        self._thread = thread  # only once started: stop() on another thread may join it at once
        return self

    def stop(self) -> None:
        self._stopped.set()
        cancel = self._cancel
        if cancel is not None:
            with contextlib.suppress(Exception):
                cancel()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _load(self, kvs: list[KeyValue], revision: int) -> None:
        raise NotImplementedError

    def _apply(self, response) -> None:
        raise NotImplementedError

    def _reload(self) -> None:
        kvs, revision = self._client.get_prefix_at(self.prefix)
        self._load(kvs, revision)
        self.revision = max(self.revision, revision)

    def _watch_forever(self) -> None:
        while not self._stopped.is_set():
            try:
                responses, self._cancel = self._client.watch_prefix(self.prefix, self.revision + 1)
                if self._stopped.is_set():  # stop() ran before the cancel was there to call
                    self._cancel()
                    return
                for response in responses:
                    if self._stopped.is_set():
                        return
                    self._apply(response)
                    self.revision = max(self.revision, response.header.revision)
            except Exception as exc:  # noqa: BLE001 - any broken stream: re-read, then watch again
                if self._stopped.is_set():
                    return
                log.info("watch on %s broke (%s); re-reading", self.prefix, exc)
            if self._stopped.wait(_RETRY_DELAY):
                return
            try:
                self._reload()
            except ElasticctlError as exc:
                log.warning("cannot re-read %s: %s", self.prefix, exc)


class WatchedKeys(PrefixWatch):
    """The values under ``prefix`` by key suffix; ``on_change(values)`` after every change."""

    def __init__(self, client: EtcdClient, prefix: str,
                 on_change: Callable[[dict[str, bytes]], None] | None = None) -> None:
        super().__init__(client, prefix)
        self._on_change = on_change
        self._lock = threading.Lock()
        self._values: dict[str, bytes] = {}

    @property
    def values(self) -> dict[str, bytes]:
        with self._lock:
            return dict(self._values)

    def _name(self, key: bytes) -> str:
        return key.decode(errors="replace")[len(self.prefix):]

    def _load(self, kvs: list[KeyValue], revision: int) -> None:
        with self._lock:
            self._values = {self._name(kv.key): kv.value for kv in kvs}
        self._changed()

    def _apply(self, response) -> None:
        with self._lock:
            for event in response.events:
                if type(event).__name__ == "DeleteEvent":
                    self._values.pop(self._name(event.key), None)
                else:
                    self._values[self._name(event.key)] = event.value
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.values)
