"""A convolutional model with BatchNorm, converted to SyncBatchNorm, on elasticctl's worker runtime.

SyncBatchNorm computes each batch's mean and variance over every worker's batch (one all-gather
per layer and step, on the default process group), so a BatchNorm model trains as it would on
one big batch. The port is one line, ``nn.SyncBatchNorm.convert_sync_batchnorm(model)``, plus the
runtime's shape (``elasticctl.train``: a State and a training function, as trainers/mlp.py):

* in **hot mode** (``elasticctl up --recovery hot``) the survivors of a lost node, and the
  workers a node joins, keep their processes: the runtime re-forms the default process group
  for each generation (in place, or anew), and the default group is the one SyncBatchNorm uses
  at every forward, so it follows the membership with no code of its own; the running
  statistics are buffers of the model, sent to a joiner with the rest of the state;
* in restart mode the same script resumes from the newest checkpoint.

torch runs SyncBatchNorm on GPUs only (it has no CPU kernels and refuses CPU tensors once a
process group exists), so on a machine without a GPU the script keeps plain BatchNorm and says
so: DDP then broadcasts rank 0's running statistics at each forward, and each worker normalises
with its own batch's statistics.

Run it::

    elasticctl up --nnodes 1:3 --recovery hot trainers/porting/sync_batchnorm.py
    elasticctl join --etcd HOST:2379              # more nodes, any time

``--record FILE``: every worker appends one JSON line per step (step, generation, rank, world
size, node, pid, a digest of the parameters before the step: equal on every replica), which
tests read.
"""

import argparse
import hashlib
import json
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:
    import elasticctl  # noqa: F401
except ImportError:  # run from a source checkout without `pip install`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import elasticctl.train as elastic
from elasticctl.job.environment import WorkerEnvironment
from elasticctl.train.script import run_main


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=16, help="per worker; SyncBatchNorm sees them all")
    parser.add_argument("--dataset-size", type=int, default=2048)
    parser.add_argument("--checkpoint-every", type=int, default=100, help="steps (with a checkpoint directory)")
    parser.add_argument("--step-sleep", type=float, default=0.0,
                        help="seconds to sleep after each step, to watch a short run (tests use it)")
    parser.add_argument("--record", default=None, help="append one JSON line per worker and step here")
    args = parser.parse_args()
    for name in ("steps", "batch_size", "dataset_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be at least 1.")
    if args.checkpoint_every < 0 or args.step_sleep < 0:
        parser.error("--checkpoint-every and --step-sleep must not be negative.")
    return args


def params_digest(model: nn.Module) -> str:
    """The parameters' sha256 (16 hex digits): replicas in step have the same. (Not the buffers:
    with plain BatchNorm each worker's running statistics differ until DDP's next broadcast.)"""
    sha = hashlib.sha256()
    for tensor in model.parameters():
        sha.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()[:16]


def main(args):
    node = WorkerEnvironment.from_env().node
    record = open(args.record, "a", buffering=1) if args.record else None  # noqa: SIM115 - open for the run
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")

    torch.manual_seed(0)
    # Small one-channel images; the target is their mean square. A convolution's batch
    # statistics cover every pixel, so even a last batch of one sample per worker has them.
    x = torch.randn(args.dataset_size, 1, 8, 8)
    dataset = TensorDataset(x, (x ** 2).mean(dim=(1, 2, 3)).unsqueeze(1))
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 1))
    if device.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # the port: every BatchNorm*d becomes one
    elif local_rank == 0:
        print("sync_batchnorm.py: no GPU: SyncBatchNorm runs on GPUs only, training with BatchNorm", flush=True)
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = elastic.State(model, optimizer, sampler=elastic.ResumableSampler(dataset))

    def train(state, group):  # re-entered for every generation of workers
        while state.step < args.steps:
            if state.sampler.epoch_done:
                state.sampler.set_epoch(state.sampler.epoch + 1)
            for inputs, targets in DataLoader(dataset, batch_size=args.batch_size, sampler=state.sampler):
                before = params_digest(model) if record else None
                loss = nn.functional.mse_loss(group.model(inputs.to(device)), targets.to(device))
                loss.backward()
                if record:
                    record.write(json.dumps({
                        "step": state.step, "generation": group.number, "rank": group.rank,
                        "world_size": group.world_size, "node": node, "pid": os.getpid(),
                        "loss": round(loss.item(), 6), "params": before, "time": time.time()}) + "\n")
                state.commit(samples=len(inputs), loss=loss.item())  # a step boundary
                if group.rank == 0 and state.step % 100 == 0:
                    print(f"step {state.step} loss {loss.item():.4f} world {group.world_size}", flush=True)
                if state.step >= args.steps:
                    return
                time.sleep(args.step_sleep)

    elastic.run(state, train, checkpoint_every=args.checkpoint_every)


if __name__ == "__main__":
    run_main(main, parse_args())
