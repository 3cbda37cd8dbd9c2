"""A hot-recovery worker for tests: a tiny MLP on elasticctl.train, one JSON line per step.

Each line: the step about to be applied, the generation, rank and world size, the pid, the
global sampler position before the step and the per-worker batch (so the positions a step
covered are known from any one worker's line), the loss, and a digest of the parameters
before the step (equal on every replica of a generation, or the replicas diverged).
"""

import argparse
import hashlib
import json
import logging
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import elasticctl.train as elastic
from elasticctl.job.environment import WorkerEnvironment

ENVIRONMENT = WorkerEnvironment.from_env()

parser = argparse.ArgumentParser()
parser.add_argument("--record", required=True)
parser.add_argument("--steps", type=int, default=100000)
parser.add_argument("--step-sleep", type=float, default=0.02)
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--dataset-size", type=int, default=4096)
parser.add_argument("--checkpoint-every", type=int, default=0)
parser.add_argument("--state-mb", type=int, default=0, help="ballast in the state: a transfer that takes a while")
parser.add_argument("--claim-step", type=int, default=None,
                    help="an impostor for tests: constant weights, and it claims to have trained this far")
parser.add_argument("--hidden", type=int, default=16, help="another width: a worker whose state does not fit")
parser.add_argument("--transfer-bucket-bytes", type=int, default=None,
                    help="the state transfer's bucket size (small: many buckets from every sender)")
parser.add_argument("--log-transfers", action="store_true", help="log the runtime's INFO lines (what was sent)")
parser.add_argument("--backend-named", default=None, metavar="NAME",
                    help="train on torch's gloo registered as the backend NAME (torch's public Backend.register_"
                         "backend): to the runtime a training backend that is not gloo, as NCCL is not, so it "
                         "builds its gloo side group for the boundary collectives on a machine without GPUs")
parser.add_argument("--stop-after-read-at", type=int, default=None, metavar="N",
                    help="SIGTERM this worker at its N-th step boundary at world 2, right after it read the stop flag")
parser.add_argument("--pg-timeout", type=float, default=None,
                    help="the training group's collective timeout in seconds (default: the node TTL)")
args = parser.parse_args()
if args.log_transfers:
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")

torch.manual_seed(0)
generator = torch.Generator().manual_seed(1)
dataset = TensorDataset(torch.arange(args.dataset_size), torch.randn(args.dataset_size, 8, generator=generator),
                        torch.randn(args.dataset_size, 1, generator=generator))
# NCCL on a GPU per worker where there are GPUs (the runtime picks the same device), else gloo
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
model = nn.Sequential(nn.Linear(8, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1))
if args.state_mb:
    model.register_buffer("ballast", torch.zeros(args.state_mb * 2**18))  # float32: 4 bytes each
model.to(device)
state = elastic.State(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                      sampler=elastic.ResumableSampler(dataset, num_replicas=1, rank=0, seed=3))
if args.claim_step is not None:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(7.0)
    state.step, state.live = args.claim_step, True
record = open(args.record, "a", buffering=1)  # noqa: SIM115 - open for the run


def digest(module: nn.Module) -> str:
    sha = hashlib.sha256()
    for tensor in module.state_dict().values():
        sha.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()[:16]


def train(state: elastic.State, group: elastic.Group) -> None:
    while state.step < args.steps:
        if state.sampler.epoch_done:
            state.sampler.set_epoch(state.sampler.epoch + 1)
        for index, x, y in DataLoader(dataset, batch_size=args.batch_size, sampler=state.sampler):
            before = digest(model)
            loss = nn.functional.mse_loss(group.model(x.to(device)), y.to(device))
            loss.backward()
            record.write(json.dumps({
                "step": state.step, "generation": group.number, "rank": group.rank,
                "world_size": group.world_size, "node": ENVIRONMENT.node, "pid": os.getpid(),
                "epoch": state.sampler.epoch, "position": state.sampler.consumed, "batch": len(index),
                "indices": index.tolist(), "loss": round(loss.item(), 6), "params": before, "time": time.time(),
            }) + "\n")
            state.commit(samples=len(index), loss=loss.item())
            if state.step >= args.steps:
                return
            time.sleep(args.step_sleep)


options = {"transfer_bucket_bytes": args.transfer_bucket_bytes} if args.transfer_bucket_bytes else {}
if args.pg_timeout:
    options["pg_timeout"] = args.pg_timeout
if args.backend_named:
    dist.Backend.register_backend(
        args.backend_named, lambda store, rank, size, timeout: dist.ProcessGroupGloo(store, rank, size, timeout),
        devices=["cpu"])
    options["backend"] = args.backend_named
if args.stop_after_read_at is not None:
    import signal

    from elasticctl.train.worker import executor

    boundaries_at_2 = []

    def stop_after_read(runtime) -> None:
        if runtime.running_generation is None or runtime.group.world_size != 2:
            return
        boundaries_at_2.append(runtime.state.step)
        if len(boundaries_at_2) == args.stop_after_read_at:
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before this call returns

    executor.after_stop_flag_read = stop_after_read
elastic.run(state, train, checkpoint_every=args.checkpoint_every, **options)
record.write(json.dumps({"event": "done", "step": state.step, "pid": os.getpid(), "time": time.time(),
                         "node": ENVIRONMENT.node}) + "\n")
