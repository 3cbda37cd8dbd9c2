"""Time one rendezvous round of N agents: the etcd3 backend next to torch's c10d backend.

Each agent is torch's DynamicRendezvousHandler in its own thread of one process,
so the figure is the rendezvous protocol itself, not torch's import time.
Run: python -m bench.rendezvous --agents 2 8 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import uuid

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from elasticctl.etcd_server import EmbeddedEtcd, free_port


def one_round(backend: str, endpoint: str, agents: int) -> float:
    """Seconds from the first agent's join to the last agent's completed rendezvous."""
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    conf = {"last_call_timeout": 1, "join_timeout": 120}
    handlers = []
    for index in range(agents):
        extra = {"is_host": index == 0} if backend == "c10d" else {}
        params = RendezvousParameters(backend, endpoint, run_id, agents, agents, local_addr="127.0.0.1",
                                      **conf, **extra)
        handlers.append(get_rendezvous_handler(params))
    done: list[float] = []
    errors: list[BaseException] = []

    def join(handler) -> None:
        try:
            handler.next_rendezvous()
            done.append(time.monotonic())
        except BaseException as exc:  # noqa: BLE001 (any failure of a thread is reported below)
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(h,)) for h in handlers]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    elapsed = max(done) - start
    for handler in handlers:
        handler.shutdown()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agents", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    results = []
    with EmbeddedEtcd(client_port=0, peer_port=0) as etcd:
        for agents in args.agents:
            for backend in ("etcd3", "c10d"):
                times = []
                for _ in range(args.repeat):
                    endpoint = etcd.endpoint if backend == "etcd3" else f"127.0.0.1:{free_port()}"
                    times.append(one_round(backend, endpoint, agents))
                row = {"backend": backend, "agents": agents, "min": min(times),
                       "median": statistics.median(times), "max": max(times)}
                results.append(row)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
