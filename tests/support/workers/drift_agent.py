"""One elastic agent, as torchrun's ``launch_agent`` builds it, with a short exit barrier.

torchrun gives its agent a fixed exit barrier of 300 s, so two nodes whose workers
finish more than that apart take minutes to reproduce. This script builds the same
agent from torch's public API (the ``etcd3`` handler through torch's rendezvous
registry, a ``WorkerSpec``, a ``LocalElasticAgent``) with ``--exit-barrier`` seconds
instead, then calls the handler's ``shutdown()`` as ``launch_agent`` does. It exits 0
when the agent's workers succeeded, 1 otherwise, and prints the run result as one line.

    drift_agent.py ENDPOINT RUN_ID NNODES EXIT_BARRIER SCRIPT [SCRIPT_ARGS...]
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry


def main() -> int:
    endpoint, run_id, nnodes, exit_barrier, script, *script_args = sys.argv[1:]
    params = RendezvousParameters("etcd3", endpoint, run_id, int(nnodes), int(nnodes), local_addr="127.0.0.1",
                                  last_call_timeout=1)
    handler = rendezvous_handler_registry.create_handler(params)
    spec = WorkerSpec(role="trainer", local_world_size=1, entrypoint=sys.executable,
                      args=("-u", script, *script_args), rdzv_handler=handler, max_restarts=0,
                      monitor_interval=0.1)
    agent = LocalElasticAgent(spec, logs_specs=DefaultLogsSpecs(), start_method="spawn",
                              exit_barrier_timeout=float(exit_barrier))
    try:
        result = agent.run()
    finally:
        handler.shutdown()
    print(f"agent result: {result.state.name}", flush=True)
    return 1 if result.is_failed() else 0


if __name__ == "__main__":
    sys.exit(main())
