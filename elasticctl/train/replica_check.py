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
eviction, the stop) are :mod:`elasticctl.train.replica_watch`'s.

The checksum runs on the parameters' own device, with torch ops, so that no model is copied to
the host: each parameter's bytes are read as 32-bit words (bytes where the size or alignment
does not allow it), each word weighted by its position in the model, summed modulo two 31-bit
primes; only the final 62-bit number moves to the CPU. Why primes: a single flipped bit changes
a word by a power of two, which no odd prime divides, times a weight in [1, P-1], which P does
not divide either, so the sum modulo P always changes; two elements swapped change it unless
they are equal. Not a cryptographic hash: it detects faults, not an adversary.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from elasticctl.errors import ElasticctlError

NO_REPLICA = -1  # the replica-set key of a worker whose state has no replica

# Two primes below 2**31: a word below 2**32 times a weight below 2**31 stays below 2**63, so
# no int64 product overflows; two of them give a 62-bit checksum.
_PRIMES = (2_147_483_647, 2_147_483_629)
_CHUNK_WORDS = 1 << 22  # words weighed at once: bounds the temporary int64 tensors to 32 MiB each


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
    sums: list[torch.Tensor] | None = None
    position = 0  # of the next word, across the tensors: moving bytes between tensors changes it
    for tensor in tensors:
        words = _words(tensor)
        if words.numel() == 0:
            continue
        if sums is None:
            sums = [torch.zeros((), dtype=torch.int64, device=words.device) for _ in _PRIMES]
        for start in range(0, words.numel(), _CHUNK_WORDS):
            chunk = words[start:start + _CHUNK_WORDS].to(torch.int64)
            if words.dtype == torch.int32:
                chunk = chunk & 0xFFFFFFFF  # as unsigned: every word in [0, 2**32)
            positions = torch.arange(position + start, position + start + chunk.numel(), dtype=torch.int64,
                                     device=chunk.device)
            for index, prime in enumerate(_PRIMES):
                weights = positions % (prime - 1) + 1  # in [1, P-1]: never a multiple of P
                total = sums[index].to(chunk.device) + ((chunk * weights) % prime).sum()
                sums[index] = total % prime
        position += words.numel()
    if sums is None:
        return 0
    first, second = sums[0], sums[1].to(sums[0].device)
    return int((first * (1 << 32) + second).item())


def parameters_digest(module: torch.nn.Module) -> int:
    """The checksum of ``module``'s parameters (of a sharded module: this worker's local shards),
    in the module's order: equal on replicas that hold the same bytes, different after any one
    bit of them flipped."""
    return tensors_digest(_local(parameter) for parameter in module.parameters())
