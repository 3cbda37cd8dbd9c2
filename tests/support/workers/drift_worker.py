"""A worker that proves it was in the world, then finishes at once or when the test says so.

``--record FILE``: one JSON line at start and at the end (node, rank, world size, pid).
``--hold FIFO``: before finishing, block reading the named pipe until the test writes
to it (no polling: a blocked open/read is the wait).
"""

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist

from elasticctl.job.environment import WorkerEnvironment

ENVIRONMENT = WorkerEnvironment.from_env()
parser = argparse.ArgumentParser()
parser.add_argument("--record", required=True)
parser.add_argument("--hold", default=None)
args = parser.parse_args()


def record(event: str, **fields) -> None:
    with open(args.record, "a") as out:
        out.write(json.dumps({"event": event, "node": ENVIRONMENT.node,
                              "rank": int(os.environ["RANK"]), "pid": os.getpid(), "time": time.time(),
                              **fields}) + "\n")


dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
value = torch.ones(1)
dist.all_reduce(value)
world = int(value.item())
dist.destroy_process_group()
record("start", world_size=world)
if args.hold:
    with open(args.hold) as fifo:  # blocks until the test opens the pipe for writing
        fifo.read()
record("done", world_size=world)
