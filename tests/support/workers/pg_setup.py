"""One worker's process-group set-up across generations, for tests/test_generation_setup.py.

``--fail-first``: this worker first meets a generation whose set-up fails on it alone (it is
rank 0 of a world of 2 whose rank 1 never comes: init_process_group times out), then sets up
the next generation with its peer. Prints one JSON line with the all-reduced sum.
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch
import torch.distributed as dist

from elasticctl.job.records import Round
from elasticctl.train.groups.process_group import build_generation_group, reset_group_counter

parser = argparse.ArgumentParser()
parser.add_argument("--rank", type=int, required=True)
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--failed-port", type=int, default=0, help="a generation whose set-up fails here first")
args = parser.parse_args()
cpu = torch.device("cpu")

if args.failed_port:
    failed = Round(number=3, members=("w.0", "ghost.0"), addrs=("127.0.0.1", "127.0.0.1"), master_port=args.failed_port)
    try:
        build_generation_group(failed, 0, "gloo", datetime.timedelta(seconds=2), cpu)
        raise SystemExit("the set-up of generation 3 should have failed")
    except RuntimeError as exc:  # gloo: a peer that never connected
        print(json.dumps({"failed": 3, "error": str(exc)[:200]}), flush=True)
    if not dist.is_initialized():
        reset_group_counter()

generation = Round(number=4, members=("w.0", "v.0"), addrs=("127.0.0.1", "127.0.0.1"), master_port=args.port)
build_generation_group(generation, args.rank, "gloo", datetime.timedelta(seconds=60), cpu)
total = torch.tensor([args.rank + 1])
dist.all_reduce(total)
print(json.dumps({"generation": 4, "rank": args.rank, "sum": int(total.item())}), flush=True)
dist.destroy_process_group()
