"""A minimal elastic worker for fault tests: all-reduce in a loop, one JSON line per step.

``--fail-node NODE --fail-at STEP``: the worker on that elasticctl node raises at that
step, every time it runs (a node whose own workers keep failing).
"""

import argparse
import datetime
import json
import time

import torch
import torch.distributed as dist

from elasticctl.job.environment import WorkerEnvironment
from elasticctl.train.script import restart_count

parser = argparse.ArgumentParser()
parser.add_argument("--record", required=True)
parser.add_argument("--steps", type=int, default=100000)
parser.add_argument("--step-sleep", type=float, default=0.05)
parser.add_argument("--fail-node", default=None)
parser.add_argument("--fail-at", type=int, default=5)
args = parser.parse_args()

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
environment = WorkerEnvironment.from_env()
node = environment.node
restart = restart_count(environment)
with open(args.record, "a", buffering=1) as record:
    for step in range(args.steps):
        if node == args.fail_node and step == args.fail_at:
            raise RuntimeError(f"injected failure on node {node} at step {step}")
        value = torch.ones(1)
        dist.all_reduce(value)
        record.write(json.dumps({"step": step, "node": node, "rank": dist.get_rank(),
                                 "world_size": int(value.item()), "restart": restart, "time": time.time()}) + "\n")
        time.sleep(args.step_sleep)
dist.barrier()
dist.destroy_process_group()
