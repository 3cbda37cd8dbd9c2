"""A tiny synthetic MLP trainer: the workhorse of elasticctl's tests and benchmarks.

Runs under plain ``torchrun`` or ``elasticctl``; CPU/gloo or GPU/NCCL. With
``--record FILE`` every rank appends one JSON line per step (step, rank, world
size, restart count, time), which tests assert on.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=1000, help="steps to train, then exit 0")
    parser.add_argument("--batch-size", type=int, default=32, help="per-worker batch size")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--step-sleep", type=float, default=0.0,
                        help="extra seconds per step, to stretch a test run")
    parser.add_argument("--log-every", type=int, default=50, help="rank 0 prints progress every N steps (0: never)")
    parser.add_argument("--record", default=None, help="append one JSON line per rank and step here")
    parser.add_argument("--pg-timeout", type=float, default=60.0,
                        help="process-group timeout in seconds (short, so a lost peer is noticed)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(1000 + rank)
    record = open(args.record, "a", buffering=1) if args.record else None
    host = socket.gethostname()

    for step in range(args.steps):
        x = torch.randn(args.batch_size, 16, generator=generator).to(device)
        y = x.sum(dim=1, keepdim=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if record is not None:
            record.write(json.dumps({
                "step": step, "rank": rank, "world_size": world, "restart": restart,
                "loss": round(loss.item(), 5), "time": time.time(), "host": host, "pid": os.getpid(),
                "node": os.environ.get("ELASTICCTL_NODE", ""), "group_rank": int(os.environ.get("GROUP_RANK", "0")),
            }) + "\n")
        if rank == 0 and args.log_every and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step}/{args.steps} loss {loss.item():.4f} world {world} restart {restart}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)

    if record is not None:
        record.write(json.dumps({"event": "done", "rank": rank, "world_size": world, "time": time.time()}) + "\n")
        record.close()
    # Let every rank finish its last collective before gloo tears its pairs down;
    # without it a fast rank's exit can abort a slower one ("terminate called ...").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
