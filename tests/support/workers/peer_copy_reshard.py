"""Peer copies between real processes without elasticctl's rendezvous (tests/process/test_peer_copy_reshard.py).

``python peer_copy_reshard.py PORT join``: workers 0 and 1 train 5 steps as a world of 2 while worker
2 waits; then the three form a world of 3 (worker 2 a newcomer with a fresh model) and sync their
shards; each prints one JSON line as below (the digest expected: the world of 2's at that step).

``python peer_copy_reshard.py PORT``: 3 spawned workers (gloo, loopback) shard trainers/lm.py's
model over a 1-D mesh of 3 (width 36: uneven shards), train 8 steps with copy rounds every 3 (and
at the first boundary), and print the digest of the full state (parameters and optimizer) after
each step. Worker 2 then exits (its node lost); workers 0 and 1 form a world of 2 on a new
store, re-wrap, and sync their shards (elasticctl.train.recovery.state_sync with the peer copies): each
prints one JSON line with the step it went back to, the digest of the full state there, the
digest the world of 3 had at that step, and the step after one more training step.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import select
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "trainers"))


def full_digest(model, optimizer) -> str:
    digest = hashlib.sha256()
    for _, parameter in model.named_parameters():
        digest.update(parameter.full_tensor().detach().numpy().tobytes())
    for parameter in (p for group in optimizer.param_groups for p in group["params"]):
        values = optimizer.state.get(parameter, {})
        for key in sorted(values):
            value = values[key]
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            digest.update(key.encode() + value.detach().float().numpy().tobytes())
    return digest.hexdigest()[:16]


@dataclasses.dataclass
class Group:  # the fields of elasticctl.train.Group that the re-wrap and the copies read
    number: int
    rank: int
    world_size: int
    members: tuple
    device: torch.device = torch.device("cpu")
    local_rank: int = 0
    local_world_size: int = 1
    mesh_groups: object = None  # a mesh of each generation's own (run(..., sharded=True))


def worker(rank: int, port: int, mode: str = "loss") -> None:
    from lm import LanguageModel, bigram_dataset
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from elasticctl.train.sharding.buddy_copies import PeerCopies
    from elasticctl.train.sharding.shards import ShardedModel
    from elasticctl.train.state import State

    def wrap(model, group):
        mesh = init_device_mesh("cpu", (group.world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def train_step(state, data, rank):
        x, y = data.tensors[1][rank * 4:(rank + 1) * 4], data.tensors[2][rank * 4:(rank + 1) * 4]
        torch.nn.functional.cross_entropy(state.model(x), y.reshape(-1)).backward()
        state.commit()

    if mode == "join":
        return join(rank, port, wrap, train_step)
    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0)
    dist.init_process_group("gloo", store=dist.PrefixStore("first", store), rank=rank, world_size=3)
    torch.manual_seed(0)
    model = LanguageModel(64, 32, 36, 2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = State(model, optimizer, peer_copies=3)
    sharded = ShardedModel(wrap)
    group = Group(1, rank, 3, ("a.0", "b.0", "c.0"))
    sharded.rewrap(state, group)
    state.live = True
    copies = PeerCopies(3, worker=f"w{rank}", timeout=datetime.timedelta(seconds=30), bucket_bytes=4096)
    data = bigram_dataset(64, 32, 64, 0)
    digests = {}
    for _ in range(8):
        train_step(state, data, rank)
        digests[state.step] = full_digest(state.model, optimizer)
        copies.at_boundary(state, sharded, group)
    copies._round_done.wait()  # the last round is agreed (or not) on every worker before one leaves
    dist.barrier()
    if rank == 2:
        os._exit(0)
    copies.freeze()
    dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", port + 1, 2, rank == 0)
    dist.init_process_group("gloo", store=dist.PrefixStore("second", store), rank=rank, world_size=2)
    trained = state.step
    sharded.rewrap(state, Group(2, rank, 2, ("a.0", "b.0")))
    events = []
    sync = state_sync(state, rank, sharded, copies, events)
    sync.in_sync = 1  # both trained in the first mesh
    sync.sync_shards(rank, 2, 2, trained)
    back_to, digest = state.step, full_digest(state.model, optimizer)
    train_step(state, data, rank)
    print_line({"rank": rank, "trained": trained, "step": back_to, "digest": digest,
                "expected": digests.get(back_to), "then": state.step, "events": events})
    dist.destroy_process_group()
    os._exit(0)  # gloo's teardown at interpreter exit can abort (pytorch#190489)


def join(rank: int, port: int, wrap, train_step) -> None:
    from lm import LanguageModel, bigram_dataset

    from elasticctl.train.sharding.buddy_copies import PeerCopies
    from elasticctl.train.sharding.shards import ShardedModel
    from elasticctl.train.state import State

    torch.manual_seed(0)
    model = LanguageModel(64, 32, 36, 2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = State(model, optimizer, peer_copies=3)
    sharded = ShardedModel(wrap)
    copies = PeerCopies(3, worker=f"w{rank}", timeout=datetime.timedelta(seconds=30), bucket_bytes=4096)
    events = []
    sync = state_sync(state, rank, sharded, copies, events)
    data = bigram_dataset(64, 32, 64, 0)
    digests = {}
    gate = dist.TCPStore("127.0.0.1", port + 2, 3, rank == 0)
    if rank < 2:
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
        dist.init_process_group("gloo", store=dist.PrefixStore("first", store), rank=rank, world_size=2)
        group = Group(1, rank, 2, ("a.0", "b.0"))
        sync.rewrap(group)
        state.live = True
        sync.in_sync = 1
        for _ in range(5):
            train_step(state, data, rank)
            digests[state.step] = full_digest(state.model, optimizer)
            copies.at_boundary(state, sharded, group)
        copies._round_done.wait()
        dist.barrier()
        copies.freeze()
        dist.destroy_process_group()
    gate.add("joined", 1)
    gate.wait(["go"]) if rank else (gate.set("go", "1") if _until(gate, 3) else None)
    trained = state.step if state.live else -1
    store = dist.TCPStore("127.0.0.1", port + 1, 3, rank == 0)
    dist.init_process_group("gloo", store=dist.PrefixStore("second", store), rank=rank, world_size=3)
    group = Group(2, rank, 3, ("a.0", "b.0", "c.0"))
    sync.rewrap(group)
    sync.sync_shards(rank, 3, 2, trained)
    back_to, digest = state.step, full_digest(state.model, optimizer)
    expected = [None]
    dist.broadcast_object_list(expected, src=0) if rank else None
    if rank == 0:
        expected = [digests.get(back_to)]
        dist.broadcast_object_list(expected, src=0)
    train_step(state, data, rank)
    print_line({"rank": rank, "trained": trained, "step": back_to, "digest": digest, "expected": expected[0],
                "then": state.step, "events": events})
    dist.destroy_process_group()
    os._exit(0)


def state_sync(state, rank: int, sharded, copies, events: list):
    """The runtime's state sync of this worker, on CPU, its events into ``events``."""
    from elasticctl.train.recovery.state_sync import GenerationStateSync

    return GenerationStateSync(state, device=torch.device("cpu"), transport=torch.device("cpu"), bucket_bytes=4096,
                               restore_from_checkpoint=lambda **event: None,
                               emit=lambda kind, **fields: events.append({"event": kind, **fields}),
                               worker=f"w{rank}", sharded=sharded, peer_copies=copies)


def print_line(record: dict) -> None:
    """One JSON line in one write: the workers share the parent's stdout pipe, and print() issues the text
    and its newline as two writes when stdout is unbuffered, so two workers' lines could interleave (seen
    in CI: one line holding two records). A pipe write up to PIPE_BUF bytes is atomic."""
    line = (json.dumps(record) + "\n").encode()
    assert len(line) <= select.PIPE_BUF, len(line)
    os.write(sys.stdout.fileno(), line)


def _until(gate, count: int) -> bool:
    while int(gate.add("joined", 0)) < count:
        pass
    return True


if __name__ == "__main__":
    mode = sys.argv[2] if len(sys.argv) > 2 else "loss"
    mp.start_processes(worker, args=(int(sys.argv[1]), mode), nprocs=3, start_method="spawn", join=True)
