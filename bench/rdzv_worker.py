"""One process of agents for bench.rendezvous: build its handlers, wait for "go", run one round.

Spoken over pipes, one JSON object a line; our stdout lines start with ``@rdzv `` so
that anything a library prints there is ignored. stdin: the spec, then ``go``, then
``stop`` (EOF counts as stop, so a harness that dies never leaves this process behind).
stdout: ``{"ready", "setup_s", "rss", "base_rss"}`` once every handler exists, then one
``{"index", "rank", "world_size", "t"}`` or ``{"index", "error"}`` per handler,
then ``{"shutdown", "stuck"}``.

Backends: any name torchrun's registry knows (``etcd3``: elasticctl's handler, ``c10d``:
torch's), and ``etcd3-dynamic``: torch's DynamicRendezvousHandler on elasticctl's
EtcdRendezvousBackend, the previous main's design, built with torch's public API.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import psutil

from elasticctl.job.environment import NODE as NODE_ENV  # the etcd3 handler's node id; the node sets it

PREFIX = "@rdzv "
# torch's DynamicRendezvousHandler on elasticctl's EtcdRendezvousBackend: the etcd3 design of the
# main before elasticctl's own handler (one pickled state every agent compare-and-swaps).
DYNAMIC = "etcd3-dynamic"
# Seconds for all shutdown() calls: a handler stuck in a round that never formed may not return.
SHUTDOWN_WAIT = 10.0

_out = threading.Lock()


def emit(**message) -> None:
    with _out:
        sys.stdout.write(PREFIX + json.dumps(message) + "\n")
        sys.stdout.flush()


def build(spec: dict) -> tuple[list, int]:
    """The handlers of this process's agents, and this process's RSS before the first one."""
    # Imported here: the registry loads the torchrun.handlers entry points (etcd3) at import.
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    base_rss = psutil.Process().memory_info().rss
    handlers = []
    for index in spec["indices"]:
        # One agent per process in torchrun: without its own node id every handler of this
        # process would share the etcd3 handler's default one (address and pid).
        os.environ[NODE_ENV] = f"agent{index}"
        extra = {"is_host": index == 0} if spec["backend"] == "c10d" else {}
        name = "etcd3" if spec["backend"] == DYNAMIC else spec["backend"]
        params = RendezvousParameters(
            name, spec["endpoint"], spec["run_id"], min_nodes=spec["agents"],
            max_nodes=spec["agents"], local_addr="127.0.0.1", **spec["conf"], **extra,
        )
        make = dynamic_on_etcd if spec["backend"] == DYNAMIC else get_rendezvous_handler
        handlers.append((index, make(params)))
    os.environ.pop(NODE_ENV, None)
    return handlers, base_rss


def dynamic_on_etcd(params):
    """torch's DynamicRendezvousHandler on elasticctl's EtcdRendezvousBackend and EtcdStore,
    with torch's public API only, as the previous main built it for each agent (its own etcd
    client and run lease; the join and last-call timeouts from --rdzv-conf; torch's
    heartbeat defaults). The previous main's liveness layer around it is not included."""
    import datetime

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    from elasticctl.rendezvous.backend import create_backend

    # As the previous main: the agents' store is the etcd store, not a TCPStore in rank 0.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    backend, store = create_backend(params)
    seconds = {key: int(params.get(key)) for key in ("join_timeout", "last_call_timeout")}
    timeout = RendezvousTimeout(join=datetime.timedelta(seconds=seconds["join_timeout"]),
                                last_call=datetime.timedelta(seconds=seconds["last_call_timeout"]))
    return DynamicRendezvousHandler.from_backend(
        params.run_id, store, backend, params.min_nodes, params.max_nodes, params.local_addr,
        timeout)


def join(index: int, handler, go: threading.Event) -> None:
    go.wait()
    try:
        info = handler.next_rendezvous()
        emit(index=index, rank=info.rank, world_size=info.world_size, t=time.time())
    except BaseException as exc:  # noqa: BLE001 - a failed agent is a result the harness reports
        emit(index=index, error=f"{type(exc).__name__}: {exc}"[:500], t=time.time())


def shut_down(handlers: list) -> int:
    """Call every handler's shutdown() at once; returns how many did not return in time."""
    threads = [threading.Thread(target=_shutdown_one, args=(h,), daemon=True) for _, h in handlers]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + SHUTDOWN_WAIT
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return sum(thread.is_alive() for thread in threads)


def _shutdown_one(handler) -> None:
    try:
        handler.shutdown()
    except Exception:  # noqa: BLE001, S110 - a failed round's teardown may fail; we exit anyway
        pass


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    started = time.monotonic()
    try:
        handlers, base_rss = build(spec)
    except Exception as exc:  # noqa: BLE001 - e.g. out of file descriptors at N=1000: a result
        emit(setup_error=f"{type(exc).__name__}: {exc}"[:500])
        sys.stdout.flush()
        os._exit(1)
    go = threading.Event()
    # Threads exist before "ready", so "go" only has to set an event.
    for index, handler in handlers:
        threading.Thread(target=join, args=(index, handler, go), daemon=True).start()
    rss = psutil.Process().memory_info().rss
    emit(ready=len(handlers), setup_s=time.monotonic() - started, rss=rss, base_rss=base_rss)
    if sys.stdin.readline().strip() == "go":
        go.set()
        sys.stdin.readline()  # "stop", or EOF
    emit(shutdown=len(handlers), stuck=shut_down(handlers))
    # Threads still inside next_rendezvous (a round that never formed) must not hold the exit.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
