"""Hot recovery's state transfer: bytes per second and the sender's memory, against the floor.

Processes on 127.0.0.1 (CPU, gloo; torch.multiprocessing): ranks 0 .. N-2 hold the same trained
state (a model of plain 1024x1024 Linear layers and Adam with its moments: the state is about
three times the parameters), the last rank is a joiner with a fresh model and an empty Adam. Three
ways to bring the joiner to the state, interleaved, their order rotated per repeat:

* ``new``: :func:`elasticctl.train.state_transfer.transfer.transfer_state`, buckets of ``--bucket-mb`` dealt
  over every holder, point to point into the joiner's own tensors;
* ``warm``: the same into a receiver that already holds tensors of every shape (a survivor one
  step behind; an untimed transfer first): the joiner's cost of mapping fresh memory for its
  optimizer state (about 1 s per GB here) is out of this row, as it is out of ``raw``'s;
* ``old``: what the runtime did before: rank 0 ``torch.save``s the whole state into one blob, its
  size and then the blob are broadcast to every other rank, which ``torch.load``s it;
* ``raw``: one ``dist.broadcast`` from rank 0 of a flat tensor of the state's bytes, allocated and
  touched before the clock starts: the floor (the network alone).

Before each repeat the joiner's optimizer state is dropped (a joiner allocates it). The time is
rank 0's, from a barrier to the barrier after the transfer. Memory: each rank samples its RSS
(psutil, every millisecond) during the transfer; reported is the peak over the RSS just before,
at rank 0 (a sender) and at the joiner. A check after the first ``new`` transfer: the joiner's
state digest equals the holders'.

Run: python -m bench.state_transfer [--quick] [--sizes-mb 64 512 2048] [--procs 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elasticctl.train.state import State
from elasticctl.train.state_transfer.transfer import DEFAULT_BUCKET_BYTES, transfer_state

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
WIDTH = 1024
LAYER_BYTES = 4 * WIDTH * (WIDTH + 1)  # one Linear's weight and bias, float32
METHODS = ("new", "warm", "old", "raw")
ONCE_FROM_MB = 2048  # states this large run one repeat (a shared 2-core machine)
# The old path holds about three copies of the state per process at its peak (the blob, its
# copy into a tensor, what torch.load makes of it): 3 processes at 2 GB would need ~20 GB.
OLD_UP_TO_MB = 1024


def build_state(state_mb: int, holder: bool) -> State:
    layers = max(1, round(state_mb * 2**20 / 3 / LAYER_BYTES))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    state = State(model, optimizer, samples_seen=0)
    if holder:  # one Adam step, a parameter's gradient at a time (no second copy of the model)
        for parameter in model.parameters():
            parameter.grad = torch.full_like(parameter, 0.01)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.step, state.live = 1, True
    return state


def state_bytes(state: State) -> int:
    total = sum(t.numel() * t.element_size() for t in state.model.state_dict().values())
    for per_param in state.optimizer.state.values():
        total += sum(t.numel() * t.element_size() for t in per_param.values() if isinstance(t, torch.Tensor))
    return total


def digest(state: State) -> str:
    sha = hashlib.sha256()
    for tensor in state.model.state_dict().values():
        sha.update(tensor.numpy().tobytes())
    for index in sorted(state.optimizer.state_dict()["state"]):
        for key, value in sorted(state.optimizer.state_dict()["state"][index].items()):
            sha.update(key.encode() + value.numpy().tobytes())
    return sha.hexdigest()[:16]


class PeakRss:
    """The peak RSS over the RSS at the start, sampled every millisecond while in the block."""

    def __init__(self) -> None:
        self.process = psutil.Process()

    def __enter__(self) -> PeakRss:
        self.base = self.peak = self.process.memory_info().rss
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def delta(self) -> int:
        return self.peak - self.base


def old_transfer(state: State, rank: int) -> None:
    """The runtime's transfer before the buckets: one whole-state blob from rank 0."""
    blob = state.to_bytes() if rank == 0 else b""
    size = torch.tensor([len(blob)], dtype=torch.int64)
    dist.broadcast(size, 0)
    buffer = (torch.frombuffer(bytearray(blob), dtype=torch.uint8) if rank == 0
              else torch.empty(int(size.item()), dtype=torch.uint8))
    del blob
    dist.broadcast(buffer, 0)
    if rank != 0:
        state.load_bytes(buffer.numpy().tobytes(), torch.device("cpu"))


def raw_buffer(nbytes: int) -> torch.Tensor:
    return torch.ones(nbytes, dtype=torch.uint8)  # its pages mapped: the floor is the network alone


def worker(rank: int, world: int, port: int, state_mb: int, repeats: int, methods: tuple[str, ...],
           bucket_bytes: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    joiner = rank == world - 1
    state = build_state(state_mb, holder=not joiner)
    size = torch.tensor([state_bytes(state) if rank == 0 else 0], dtype=torch.int64)
    dist.broadcast(size, 0)
    nbytes = int(size.item())
    holders = tuple(range(world - 1))
    samples = []
    for repeat in range(repeats):
        order = methods[repeat % len(methods):] + methods[:repeat % len(methods)]
        for method in order:
            if method == "warm":  # the receiver holds every tensor already
                transfer_state(state, rank, holders, device=torch.device("cpu"), transport=torch.device("cpu"),
                               bucket_bytes=bucket_bytes)
            if joiner:  # not live; a joiner has no optimizer state, unless warm
                if method != "warm":
                    state.optimizer.state.clear()
                state.live = False
            buffer = raw_buffer(nbytes) if method == "raw" else None
            dist.barrier()
            with PeakRss() as memory:
                began = time.perf_counter()
                if method in ("new", "warm"):
                    transfer_state(state, rank, holders, device=torch.device("cpu"), transport=torch.device("cpu"),
                                   bucket_bytes=bucket_bytes)
                elif method == "old":
                    old_transfer(state, rank)
                else:
                    dist.broadcast(buffer, 0)
                dist.barrier()
                seconds = time.perf_counter() - began
            buffer = None
            peaks = torch.tensor([memory.delta, memory.base], dtype=torch.int64)
            gathered = [torch.zeros_like(peaks) for _ in range(world)]
            dist.all_gather(gathered, peaks)
            check = None
            if repeat == 0 and method == "new":
                mine = torch.tensor(list(bytes.fromhex(digest(state))), dtype=torch.uint8)
                digests = [torch.zeros_like(mine) for _ in range(world)]
                dist.all_gather(digests, mine)
                check = all(torch.equal(d, digests[0]) for d in digests)
            if rank == 0:
                samples.append({"repeat": repeat, "method": method, "seconds": seconds,
                                "sender_rss_delta": int(gathered[0][0]), "sender_rss_before": int(gathered[0][1]),
                                "joiner_rss_delta": int(gathered[-1][0]), "identical": check})
    if rank == 0:
        results.put({"state_mb": state_mb, "state_bytes": nbytes, "procs": world, "bucket_bytes": bucket_bytes,
                     "samples": samples})
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_size(state_mb: int, procs: int, repeats: int, methods: tuple[str, ...], bucket_bytes: int) -> dict:
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(worker, args=(procs, free_port(), state_mb, repeats, methods, bucket_bytes, results),
                       nprocs=procs, join=True, start_method="spawn")
    return results.get()


def summarise(run: dict) -> dict:
    rows = {}
    for method in {s["method"] for s in run["samples"]}:
        mine = [s for s in run["samples"] if s["method"] == method]
        seconds = statistics.median(s["seconds"] for s in mine)
        rows[method] = {"median_s": round(seconds, 4), "bytes_per_s": run["state_bytes"] / seconds,
                        "sender_rss_delta_max": max(s["sender_rss_delta"] for s in mine),
                        "joiner_rss_delta_max": max(s["joiner_rss_delta"] for s in mine),
                        "repeats": len(mine)}
    identical = [s["identical"] for s in run["samples"] if s["identical"] is not None]
    return {"state_mb": run["state_mb"], "state_bytes": run["state_bytes"], "procs": run["procs"],
            "bucket_bytes": run["bucket_bytes"], "identical": all(identical) if identical else None, **rows}


def table(summaries: list[dict]) -> str:
    lines = ["| state | procs | method | median s | MB/s | × raw | sender RSS peak over before "
             "| joiner RSS peak over before |", "|---|---|---|---|---|---|---|---|"]
    for row in summaries:
        raw = row.get("raw", {}).get("bytes_per_s")
        for method in METHODS:
            if method not in row:
                continue
            m = row[method]
            ratio = f"{m['bytes_per_s'] / raw:.2f}" if raw else "-"
            lines.append(f"| {row['state_bytes'] / 2**20:.0f} MiB | {row['procs']} | {method} | {m['median_s']:.3f} | "
                         f"{m['bytes_per_s'] / 1e6:.0f} | {ratio} | {m['sender_rss_delta_max'] / 2**20:.0f} MiB | "
                         f"{m['joiner_rss_delta_max'] / 2**20:.0f} MiB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 MB only")
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--procs", type=int, default=3, help="holders + one joiner")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--bucket-mb", type=int, default=DEFAULT_BUCKET_BYTES // 2**20)
    parser.add_argument("--once-from-mb", type=int, default=ONCE_FROM_MB,
                        help="states this large run one repeat (a shared 2-core machine)")
    parser.add_argument("--old-up-to-mb", type=int, default=OLD_UP_TO_MB,
                        help="larger states skip the old whole-blob path (its memory: ~3x the state per process)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    sizes = [64] if args.quick else args.sizes_mb
    load_before = os.getloadavg()
    summaries, runs = [], []
    for size in sizes:
        repeats = 1 if size >= args.once_from_mb else args.repeats
        methods = tuple(m for m in args.methods if m != "old" or size <= args.old_up_to_mb)
        run = run_size(size, args.procs, repeats, methods, args.bucket_mb * 2**20)
        runs.append(run)
        summaries.append(summarise(run))
        print(json.dumps(summaries[-1]), flush=True)
    print(table(summaries))
    now = datetime.datetime.now(datetime.timezone.utc)
    output = args.output or RESULTS / f"{now:%Y-%m-%d-%H%M}-state-transfer-{args.procs}p.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                                              "torch": torch.__version__, "platform": platform.platform(),
                                              "load_before": load_before, "load_after": os.getloadavg()},
                                  "summaries": summaries, "runs": runs}, indent=1))
    print(f"wrote {output}")
    return 0 if all(s["identical"] is not False for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
