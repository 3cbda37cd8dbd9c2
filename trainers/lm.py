"""A tiny transformer language model: the sharded (HSDP) workhorse of elasticctl's tests.

A decoder-only transformer (``--layers`` blocks of width ``--hidden``, ``--heads`` heads, causal
attention) learns next-token prediction on a synthetic language: sequences of ``--seq-len + 1``
tokens drawn from a fixed random bigram table over ``--vocab`` tokens (seeded by ``--seed``), so
the loss falls towards the table's entropy within a few hundred steps on a CPU.

``--shard hsdp`` shards the model with FSDP2 (``fully_shard`` of each block and of the whole
model) on :func:`elasticctl.train.hsdp_mesh`: replicated across nodes, sharded within a node.
Checkpoints are then sharded (DCP, resharded on load at another world size) and, with
``--recovery hot``, a lost node's shards are restored from their replicas on the other nodes,
in process. ``--shard fsdp`` shards over every worker instead (no replica: in hot mode a
changed world restores the newest sharded checkpoint, resharded, in process; with
``--peer-copies K`` each worker sends its shards to a buddy on another node every K steps, and a
lost node is restored from those copies in memory, re-doing at most K steps). The default,
``--shard none``, is plain DDP.

Everything else (the record, checkpoints, the LR policy, fault injection, the straggler knob)
is trainers/mlp.py's, whose training loop this script runs with its own model, data and loss:
see ``python trainers/mlp.py --help``. With ``--record-params`` a sharded run's step lines carry
``shard`` (the index of the shard the worker holds) and the digest of its local shards.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

try:
    import elasticctl  # noqa: F401
except ImportError:  # run from a source checkout without `pip install`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from mlp import Task, build_parser, check_args, train  # trainers/ is the script's directory
from torch import nn
from torch.utils.data import TensorDataset

import elasticctl.train as elastic
from elasticctl.train.script import run_main

SHARDINGS = ("none", "hsdp", "fsdp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser(__doc__)
    parser.set_defaults(hidden=32, lr=0.003, batch_size=8, dataset_size=2048, log_every=20)
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=2, help="attention heads (they divide --hidden)")
    parser.add_argument("--vocab", type=int, default=64, help="tokens of the synthetic language")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per training sequence")
    parser.add_argument("--shard", choices=SHARDINGS, default="none",
                        help="'hsdp': FSDP2 sharded within a node, replicated across nodes; 'fsdp': sharded "
                             "over every worker, no replica (hot mode restores a resize from the checkpoint); "
                             "'none': DDP")
    parser.add_argument("--peer-copies", type=int, default=0, metavar="K",
                        help="with --shard fsdp under --recovery hot: every K steps each worker sends its shards to "
                             "a buddy on another node, restored from memory when a node is lost (0: no copies)")
    args = check_args(parser, parser.parse_args(argv))
    if args.peer_copies < 0:
        parser.error(f"--peer-copies ({args.peer_copies}) must be 0 (no copies) or more steps.")
    if args.peer_copies and args.shard != "fsdp":
        parser.error(f"--peer-copies needs --shard fsdp (with --shard {args.shard} the replicas are the copies).")
    for name in ("layers", "heads", "vocab", "seq_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be at least 1.")
    if args.hidden % args.heads:
        parser.error(f"--heads ({args.heads}) must divide --hidden ({args.hidden}).")
    return args


def bigram_dataset(size: int, seq_len: int, vocab: int, seed: int) -> TensorDataset:
    """(index, tokens, next tokens) of ``size`` sequences from a random bigram table: a language
    with something to learn (each token makes a few successors likely)."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.softmax(3 * torch.randn(vocab, vocab, generator=generator), dim=1)
    tokens = torch.empty(size, seq_len + 1, dtype=torch.int64)
    tokens[:, 0] = torch.randint(vocab, (size,), generator=generator)
    for position in range(1, seq_len + 1):
        tokens[:, position] = torch.multinomial(table[tokens[:, position - 1]], 1, generator=generator).squeeze(1)
    return TensorDataset(torch.arange(size), tokens[:, :-1], tokens[:, 1:])


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, each with its residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm, self.mlp_norm = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.projection = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.projection(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.mlp_norm(x))


class LanguageModel(nn.Module):
    def __init__(self, vocab: int, seq_len: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.position = nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        # A buffer travels with the model, not in its shards: the re-wrap of each generation carries it.
        self.register_buffer("positions", torch.arange(seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The next-token logits of every position, one row each (batch x length rows: a tensor of its
        own, not a view, which FSDP's backward hook on the output needs)."""
        x = self.embedding(tokens) + self.position(self.positions[:tokens.shape[1]])
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).flatten(0, 1))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, targets.reshape(-1))


def fsdp_mesh(group: elastic.Group):
    """One dimension over every worker of the generation: each shard has no replica."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(group.device.type, (group.world_size,))


MESHES = {"hsdp": elastic.hsdp_mesh, "fsdp": fsdp_mesh}


def shard_model(model: LanguageModel, group: elastic.Group, sharding: str) -> nn.Module:
    """FSDP2 on this generation's mesh: each block its own unit, then the rest."""
    from torch.distributed.fsdp import fully_shard

    mesh = MESHES[sharding](group)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def lm_task(args: argparse.Namespace, device: torch.device) -> Task:
    model = LanguageModel(args.vocab, args.seq_len, args.hidden, args.layers, args.heads).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    dataset = bigram_dataset(args.dataset_size, args.seq_len, args.vocab, args.seed)
    # "hsdp": the wrap shards on elastic.hsdp_mesh, which the runtime keeps across generations.
    options = ({"wrap": functools.partial(shard_model, sharding=args.shard),
                "sharded": "hsdp" if args.shard == "hsdp" else True}
               if args.shard != "none" else {})
    return Task(model, optimizer, dataset, next_token_loss, options,
                {"peer_copies": args.peer_copies} if args.peer_copies else {})


def main() -> None:
    run_main(lambda args: train(args, lm_task), parse_args())


if __name__ == "__main__":
    main()
