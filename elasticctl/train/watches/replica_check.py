"""Silent-corruption detection from the replicas: the rule that names a diverged replica, and the
checksum it compares.

Data-parallel replicas hold bit-identical parameters after every step: the all-reduce hands every
rank the same gradient bytes and every rank applies the same update. A device that silently
computes or stores a wrong number makes one replica differ from the others, and nothing else in
training notices (its loss looks like any other's). So every ``--replica-check`` steps each
worker sends a checksum of its parameters (:func:`parameters_digest`), with the key of its replica
set, to every worker, and :func:`judge_replicas` decides:

* The replica set of a worker is the ranks that must hold the same bytes as it does: under DDP
  every rank (one key), under HSDP the ranks with the same shard index (the key is the index);
  a worker whose state has no replica (FSDP over every worker) has the key :data:`NO_REPLICA`
  and is compared with nobody, nor is any set of one member.
* A set whose strict majority agrees names every other member **diverged**: the majority is
  taken for the truth (one faulty device among three or more).
* A set with no strict majority (two replicas that differ, a 2-2 split, three different
  checksums) has no truth to go back to: **no majority**, and the job stops (the runtime raises
  :class:`ReplicasDisagree` on every rank at that boundary; a restart would resume from
  the newest checkpoint, which may already hold the diverged state, so the node stops instead
  and the user picks the checkpoint: one of the last step every replica agreed at, or older).

The rule is pure and table-tested; the exchange and what follows from a verdict (events,
eviction, the stop) are :mod:`elasticctl.train.watches.replica_watch`'s.

The checksum runs on the parameters' own device, with torch ops, so that no model is copied to
the host, and reads the parameters twice, with no temporary of their size: each parameter's
bytes are read as 32-bit words (bytes where the size or alignment does not allow it) and laid out
in rows of :data:`_WIDTH` (a parameter starts a new row; the last row is padded with zeros); the
exact integer sum of each row and of each column is taken (one reduction each), and the
checksum is the row sums weighted by their row's position summed modulo one 31-bit prime, beside
the column sums weighted by their column's position modulo another: a 62-bit number, the only one
that moves to the CPU. Why it catches a flipped bit: the bit changes one word by a power of two,
and so its row's sum by exactly that (the sums are exact), which no odd prime divides, times a
weight in [1, P-1], which P does not divide either: the row part modulo P always changes. Two
different elements swapped change the row part (different rows) or the column part (one row,
different columns), unless they differ by a multiple of the prime. Not a cryptographic hash: it
detects faults, not an adversary. (An earlier form weighted every word by its position, ten
passes of 64-bit arithmetic over the parameters: ten times slower on a CPU.)
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from elasticctl.errors import ElasticctlError

NO_REPLICA = -1  # the replica-set key of a worker whose state has no replica

# Two primes below 2**31: a sum reduced modulo one of them times a weight below 2**31 stays below
# 2**62, so no int64 product overflows; the row part takes one, the column part the other.
_PRIMES = (2_147_483_647, 2_147_483_629)
_WIDTH = 1024           # words per row: a row's exact sum of 32-bit words stays below 2**42
_CHUNK_ROWS = 1 << 12   # rows summed at once: bounds the padded copy of a tail to 16 MiB


class ReplicasDisagree(ElasticctlError):
    """Replicas that must hold the same parameters differ, with no majority to name the faulty one:
    training on would spread an unknown error, so the job stops."""


@dataclasses.dataclass(frozen=True)
class Diverged:
    """A rank whose checksum differs from the one most of its replica set agrees on."""

    rank: int
    replica_set: int
    agreeing: int  # members of the set that hold the majority's checksum
    members: int   # members of the set


@dataclasses.dataclass(frozen=True)
class NoMajority:
    """A replica set whose members hold different checksums, none held by more than half of them."""

    replica_set: int
    ranks: tuple[int, ...]
    checksums: int  # how many different checksums its members hold


@dataclasses.dataclass(frozen=True)
class ReplicaVerdict:
    """What one exchange found: the diverged ranks (by rank) and the sets without a majority (by key)."""

    diverged: tuple[Diverged, ...] = ()
    no_majority: tuple[NoMajority, ...] = ()

    @property
    def agree(self) -> bool:
        return not self.diverged and not self.no_majority


def judge_replicas(reports: Sequence[tuple[int, int]]) -> ReplicaVerdict:
    """The verdict on ``reports``: per rank (its index), (its checksum, its replica-set key).

    A set of one member, and the ranks keyed :data:`NO_REPLICA` (or any negative key), are
    compared with nobody."""
    sets: dict[int, list[int]] = {}
    for rank, (_, key) in enumerate(reports):
        if key >= 0:
            sets.setdefault(key, []).append(rank)
    diverged: list[Diverged] = []
    no_majority: list[NoMajority] = []
    for key in sorted(sets):
        ranks = sets[key]
        if len(ranks) < 2:
            continue
        counts = Counter(reports[rank][0] for rank in ranks)
        if len(counts) == 1:
            continue
        checksum, agreeing = counts.most_common(1)[0]
        if 2 * agreeing <= len(ranks):
            no_majority.append(NoMajority(key, tuple(ranks), len(counts)))
            continue
        diverged.extend(Diverged(rank, key, agreeing, len(ranks)) for rank in ranks if reports[rank][0] != checksum)
    return ReplicaVerdict(tuple(sorted(diverged, key=lambda d: d.rank)), tuple(no_majority))


# -- the checksum, on the device ----------------------------------------------------------------

def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat integer view: 32-bit words where its size and alignment allow,
    else bytes. A view of a contiguous tensor (no copy), a copy on its own device otherwise."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.numel() % 4 == 0 and raw.storage_offset() % 4 == 0:
        return raw.view(torch.int32)
    return raw


def _local(parameter: torch.Tensor) -> torch.Tensor:
    """A DTensor parameter's shard on this worker (what its replicas hold too), else the parameter."""
    to_local = getattr(parameter, "to_local", None)
    return to_local() if callable(to_local) else parameter


def tensors_digest(tensors: Iterable[torch.Tensor]) -> int:
    """The checksum of ``tensors``' bytes, in their order (see the module docstring); 0 for none.
    Computed on each tensor's device; only the result moves to the CPU."""
    row_prime, column_prime = _PRIMES
    rows_part: torch.Tensor | None = None     # the weighted row sums so far, modulo row_prime
    columns: torch.Tensor | None = None       # each column's exact sum so far
    row = 0  # the next row's position, across the tensors: moving bytes between tensors changes it
    for tensor in tensors:
        words = _words(tensor)
        if words.numel() == 0:
            continue
        device = words.device
        if rows_part is None:
            rows_part = torch.zeros((), dtype=torch.int64, device=device)
            columns = torch.zeros(_WIDTH, dtype=torch.int64, device=device)
        chunk_words = _CHUNK_ROWS * _WIDTH
        for start in range(0, words.numel(), chunk_words):
            chunk = words[start:start + chunk_words]
            if words.dtype == torch.uint8:
                chunk = chunk.to(torch.int32)  # a byte tensor's sums would wrap at 255
            if chunk.numel() % _WIDTH:
                chunk = torch.cat([chunk, chunk.new_zeros(_WIDTH - chunk.numel() % _WIDTH)])
            grid = chunk.view(-1, _WIDTH)
            row_sums = grid.sum(dim=1, dtype=torch.int64)  # exact: at most 1024 words below 2**32 each
            weights = torch.arange(row, row + grid.shape[0], dtype=torch.int64, device=device) % (row_prime - 1) + 1
            rows_part = (rows_part.to(device) + ((row_sums % row_prime) * weights % row_prime).sum()) % row_prime
            columns = columns.to(device) + grid.sum(dim=0, dtype=torch.int64)
            row += grid.shape[0]
    if rows_part is None:
        return 0
    column_weights = torch.arange(1, _WIDTH + 1, dtype=torch.int64, device=columns.device)
    columns_part = ((columns % column_prime) * column_weights % column_prime).sum() % column_prime
    return int((rows_part.to(columns.device) * (1 << 31) + columns_part).item())


def parameters_digest(module: torch.nn.Module) -> int:
    """The checksum of ``module``'s parameters (of a sharded module: this worker's local shards),
    in the module's order: equal on replicas that hold the same bytes, different after any one
    bit of them flipped."""
    return tensors_digest(_local(parameter) for parameter in module.parameters())
