"""Moving a training state between the members of a generation: tensor by tensor, in bounded buckets.

When a generation forms and its members' steps differ, the members that hold the newest state
(:mod:`elasticctl.train.recovery.replicas`: its ``sources``, the lead first) send it to the
others, never as one whole-state blob:

1. The lead describes its state (:func:`describe`): its ``state_dict`` walked over dicts, lists
   and tuples in their order, each tensor replaced by ``None`` and listed with its path, dtype
   and shape. The description (step, fields, the optimizer's hyperparameters, the sampler's
   position: everything but the tensors' values) is a small ``torch.save`` blob broadcast to
   every member and read with ``weights_only=True`` (:func:`parse_description`): a peer can send
   wrong numbers, never code.
2. Every other member checks the description against its own state before anything is copied
   (:func:`check_description`, pure): another sender must hold exactly these tensors; a
   receiver's model must have exactly these tensors, shapes and dtypes, and whatever else it
   lacks (a joiner's fresh optimizer has no state yet) it allocates, up to
   :data:`ALLOCATION_FACTOR` times its model's bytes. What does not fit is a :class:`StateError`
   naming it, raised on that member only (its peers are told, and carry on without it).
3. The members tell each other whether they are ready (an all-gather of one flag). The tensors
   then go in buckets of at most ``bucket_bytes`` (:func:`elasticctl.train.buckets.plan_buckets`:
   a tensor of 1 MiB or more alone, smaller ones packed),
   dealt round-robin over the senders that are ready, point to point from a bucket's owner to
   each receiver, so that a holder never receives what it already holds and the senders send at
   the same time, several buckets in flight. A bucket that is one piece of one tensor goes out of,
   and comes into, that tensor itself; a bucket of several small tensors is packed into one flat
   buffer. A sender holds at most one bucket besides its state, a receiver one per sender.
4. A receiver loads the state dict rebuilt from the description and its own tensors, now filled
   (``load_state_dict`` of a tensor onto itself copies nothing).

The members are those of the current process group, or of any group the caller names: a sharded
state (:mod:`elasticctl.train.shards`) moves each shard index over the mesh's replicate group, as
local shards (the state dict of :class:`elasticctl.train.shards.LocalShards`), all groups at once.

Limits: a tensor that is not contiguous (state tensors are, in practice) is copied whole on the
sender for each of its buckets, and received into a new tensor that ``load_state_dict`` copies
in. Several senders are only ever members that trained together at one step (replicas, bit-identical),
so which of them sends a bucket does not matter; a tensor the script keeps per rank in ``fields``
comes from one of them, as it came from the one sender before.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from elasticctl.train.buckets import Bucket, bucket_owners, plan_buckets
from elasticctl.train.state import State, StateError

DEFAULT_BUCKET_BYTES = 64 * 2**20
MIN_BUCKET_BYTES = 256            # tests use small buckets; below this the messages are all overhead
MAX_BUCKET_BYTES = 2**30          # a receiver allocates one bucket per sender
# Tensors from this size travel alone, out of and into themselves: packing them would cost a copy
# on each side for no fewer messages worth counting (a message costs tens of microseconds).
PACK_BELOW_BYTES = 2**20
DESCRIPTION_MAX_BYTES = 64 * 2**20  # a description larger than this is refused unread
MAX_TENSORS = 2**20
MAX_DIMS = 64
# What a receiver allocates for tensors it lacks (a joiner's optimizer state, tensors in fields)
# is at most this many times its own model's bytes, plus the slack: Adam needs twice the model.
ALLOCATION_FACTOR = 4
ALLOCATION_SLACK = 64 * 2**20
DESCRIPTION_FORMAT = 1
WINDOW = 16  # buckets in flight on one member (sends or receives posted, not yet waited for)

# The dtypes a description may name, by name: a peer's string is looked up here, never in torch.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "complex64", "complex128", "int64", "int32",
                 "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2")
    if isinstance(getattr(torch, name, None), torch.dtype)
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

# The ready flags of step 3.
REFUSED, SENDS, RECEIVES = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of a described state: where it is in the state dict, its dtype and shape."""

    path: tuple[str | int, ...]
    dtype: str
    shape: tuple[int, ...]
    on_cpu: bool = True  # where the sender keeps it (an optimizer's step counter may stay on the CPU)

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def name(self) -> str:
        return ".".join(str(key) for key in self.path)


@dataclasses.dataclass(frozen=True)
class Transferred:
    """What one transfer moved (for the log)."""

    senders: tuple[int, ...]
    buckets: int
    nbytes: int
    seconds: float


# -- the description (pure) ------------------------------------------------------------------

def flatten(tree: Any) -> tuple[Any, list[tuple[tuple, torch.Tensor]]]:
    """``tree`` with each tensor replaced by None, and its tensors with their paths, in the walk's order."""
    tensors: list[tuple[tuple, torch.Tensor]] = []

    def take(node: Any, path: tuple) -> tuple[bool, Any]:
        if isinstance(node, torch.Tensor):
            tensors.append((path, node))
            return True, None
        return False, None

    return _walk(tree, (), take), tensors


def rebuild(skeleton: Any, tensors: Mapping[tuple, torch.Tensor]) -> Any:
    """The inverse of :func:`flatten`: ``skeleton`` with the tensor at each of ``tensors``' paths."""
    return _walk(skeleton, (), lambda node, path: (path in tensors, tensors.get(path)))


def _walk(node: Any, path: tuple, leaf: Callable[[Any, tuple], tuple[bool, Any]]) -> Any:
    """``node`` rebuilt through its dicts, lists and plain tuples, with what ``leaf`` returns
    wherever it says so (``(True, value)``); everything else is kept as it is."""
    replaced, value = leaf(node, path)
    if replaced:
        return value
    if isinstance(node, dict):
        return _same_mapping(node, {key: _walk(item, (*path, key), leaf) for key, item in node.items()})
    if isinstance(node, list):
        return [_walk(item, (*path, index), leaf) for index, item in enumerate(node)]
    if isinstance(node, tuple) and type(node) is tuple:
        return tuple(_walk(item, (*path, index), leaf) for index, item in enumerate(node))
    return node


def _same_mapping(original: dict, items: dict) -> dict:
    """A module's state dict is an OrderedDict whose ``_metadata`` (module versions) its loader reads."""
    if not isinstance(original, collections.OrderedDict):
        return items
    mapping = collections.OrderedDict(items)
    metadata = getattr(original, "_metadata", None)
    if isinstance(metadata, dict):
        mapping._metadata = metadata  # type: ignore[attr-defined]
    return mapping


def describe(state_dict: dict[str, Any], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
             ) -> tuple[bytes, list[TensorSpec], list[torch.Tensor]]:
    """The description blob of ``state_dict`` (with the lead's bucket size, which every member
    then uses), its tensors' specs and the tensors themselves."""
    skeleton, found = flatten(state_dict)
    specs, tensors = [], []
    for path, tensor in found:
        if tensor.dtype not in DTYPE_NAMES:
            raise StateError(f"The state's tensor '{'.'.join(map(str, path))}' has dtype {tensor.dtype}, "
                             "which a hot recovery cannot send.")
        specs.append(TensorSpec(path, DTYPE_NAMES[tensor.dtype], tuple(tensor.shape), tensor.device.type == "cpu"))
        tensors.append(tensor)
    buffer = io.BytesIO()
    torch.save({"format": DESCRIPTION_FORMAT, "state": skeleton, "bucket_bytes": bucket_bytes,
                "tensors": [[list(s.path), s.dtype, list(s.shape), s.on_cpu] for s in specs]}, buffer)
    return buffer.getvalue(), specs, tensors


def read_description(blob: bytes, what: str, expected_format: int) -> dict[str, Any]:
    """A peer's description blob as a dict of format ``expected_format``, read with
    ``weights_only=True`` (no pickle beyond tensors and plain containers); StateError naming
    ``what`` if it cannot be read or is of another format."""
    try:
        description = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as exc:  # whatever a malformed blob makes torch raise
        raise StateError(f"{what} cannot be read: {exc}") from exc
    if not isinstance(description, dict) or description.get("format") != expected_format:
        raise StateError(f"{what} is not one this worker reads.")
    return description


def parse_description(blob: bytes) -> tuple[dict[str, Any], list[TensorSpec], int]:
    """The skeleton, tensor specs and bucket size of a peer's description; StateError if it is not one."""
    description = read_description(blob, "The state description received", DESCRIPTION_FORMAT)
    skeleton, entries = description.get("state"), description.get("tensors")
    if not isinstance(skeleton, dict) or type(skeleton.get("step")) is not int:
        raise StateError("The state description received holds no training state.")
    if not isinstance(entries, list) or len(entries) > MAX_TENSORS:
        raise StateError("The state description received has no valid list of tensors.")
    bucket_bytes = description.get("bucket_bytes")
    if type(bucket_bytes) is not int or not MIN_BUCKET_BYTES <= bucket_bytes <= MAX_BUCKET_BYTES:
        raise StateError(f"The state description received has a bucket size out of bounds ({bucket_bytes!r:.40}).")
    specs = [_spec(entry, number) for number, entry in enumerate(entries)]
    paths = set()
    for spec in specs:
        if spec.path in paths:
            raise StateError(f"The state description received lists the tensor '{spec.name}' twice.")
        paths.add(spec.path)
        if not _holds_a_tensor_slot(skeleton, spec.path):
            raise StateError(f"The state description received lists a tensor '{spec.name}' its state has "
                             "no place for.")
    return skeleton, specs, bucket_bytes


def _spec(entry: Any, number: int) -> TensorSpec:
    if not (isinstance(entry, (list, tuple)) and len(entry) == 4):
        raise StateError(f"Tensor {number} of the state description received is malformed.")
    path, dtype, shape, on_cpu = entry
    if (not isinstance(path, (list, tuple)) or not path or len(path) > MAX_DIMS
            or not all(type(key) in (str, int) for key in path)):
        raise StateError(f"Tensor {number} of the state description received has no valid path.")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise StateError(f"Tensor {number} of the state description received has an unknown dtype "
                         f"({str(dtype)[:40]!r}).")
    if (not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS
            or not all(type(size) is int and 0 <= size < 2**62 for size in shape)):
        raise StateError(f"Tensor {number} of the state description received has no valid shape.")
    if type(on_cpu) is not bool:
        raise StateError(f"Tensor {number} of the state description received does not say where it lives.")
    return TensorSpec(tuple(path), dtype, tuple(shape), on_cpu)


def _holds_a_tensor_slot(skeleton: Any, path: tuple) -> bool:
    node = skeleton
    for key in path:
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, (list, tuple)) and type(key) is int and 0 <= key < len(node):
            node = node[key]
        else:
            return False
    return node is None


@dataclasses.dataclass(frozen=True)
class Own:
    """What a member holds at one path of its own state dict."""

    dtype: str
    shape: tuple[int, ...]
    contiguous: bool = True


def check_description(skeleton: Mapping[str, Any], specs: Sequence[TensorSpec], own: Mapping[tuple, Own], *,
                      objects: Collection[str], own_param_groups: Sequence[int] | None,
                      allocation_limit: int, sender: bool) -> list[bool]:
    """Whether a member can take (or, ``sender``, send) the described state: for each tensor, True if
    it goes into (comes out of) the member's own tensor, False if the receiver allocates it.

    ``own``: the member's tensors by path; ``objects``: the stateful objects it has;
    ``own_param_groups``: the number of parameters in each of its optimizer's groups (None: no
    torch optimizer). Raises StateError naming the first thing that does not fit."""
    for name in objects:
        if name not in skeleton:
            raise StateError(f"The state received has no '{name}'.")
    if own_param_groups is not None:
        groups = skeleton["optimizer"].get("param_groups") if isinstance(skeleton["optimizer"], dict) else None
        if (not isinstance(groups, list)
                or [len(g.get("params", ())) if isinstance(g, dict) and isinstance(g.get("params"), list) else -1
                    for g in groups] != list(own_param_groups)):
            raise StateError("The 'optimizer' state received has parameter groups of other sizes than this worker's.")
    described = {spec.path for spec in specs}
    for path in own:
        if path[0] == "model" and path not in described:
            raise StateError(f"The state received lacks the model's tensor '{'.'.join(map(str, path[1:]))}'.")
    reuse, allocated = [], 0
    for spec in specs:
        mine = own.get(spec.path)
        fits = mine is not None and mine.dtype == spec.dtype and mine.shape == spec.shape
        if sender and not fits:
            raise StateError(f"This sender's tensor '{spec.name}' differs from the lead sender's.")
        if spec.path[0] == "model" and not fits:
            theirs = f"{spec.dtype} {list(spec.shape)}"
            raise StateError(f"The model's tensor '{spec.name[len('model.'):]}' received is {theirs}, this "
                             "worker's is " + (f"{mine.dtype} {list(mine.shape)}." if mine else "missing."))
        in_place = fits and mine.contiguous
        if not in_place:
            allocated += spec.nbytes
            if allocated > allocation_limit:
                raise StateError(f"The state received needs more than {allocation_limit} bytes of new tensors "
                                 f"(at '{spec.name}'), far more than this worker's model: refused.")
        reuse.append(in_place)
    return reuse


def allocation_limit(own: Mapping[tuple, Own]) -> int:
    model_bytes = sum(DTYPES[o.dtype].itemsize * _numel(o.shape) for path, o in own.items() if path[0] == "model")
    return ALLOCATION_FACTOR * model_bytes + ALLOCATION_SLACK


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def check_bucket_bytes(bucket_bytes: int) -> int:
    if not MIN_BUCKET_BYTES <= bucket_bytes <= MAX_BUCKET_BYTES:
        raise ValueError(f"The state transfer's bucket size ({bucket_bytes} bytes) must be between "
                         f"{MIN_BUCKET_BYTES} and {MAX_BUCKET_BYTES}.")
    return bucket_bytes


# -- the transfer (I/O over the generation's process group) ----------------------------------

def transfer_state(state: State | Any, rank: int, sources: Sequence[int], *, device: torch.device,
                   transport: torch.device, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                   group: dist.ProcessGroup | None = None) -> Transferred:
    """Bring every member of ``group`` (default: the current process group) to the state of
    ``sources`` (the lead first); ``rank`` and ``sources`` are ranks in ``group``.

    Every member calls it with the same ``sources``; the lead's ``bucket_bytes`` is everyone's.
    ``state``: a :class:`State`, or a view of one with its ``state_dict``, ``load_state_dict``,
    ``objects`` and ``optimizer`` (a sharded state's local shards: elasticctl.train.shards).
    ``device``: where this member's new tensors go; ``transport``: where buckets travel from
    (CPU for gloo, the GPU for NCCL). Raises StateError on a member whose state the description
    does not fit (the others carry on without it)."""
    began = time.perf_counter()
    lead = sources[0]
    world = dist.get_world_size(group)
    if rank == lead:
        blob, specs, mine = describe(state.state_dict(), bucket_bytes)
    else:
        blob = b""
    size = torch.tensor([len(blob)], dtype=torch.int64, device=transport)
    dist.broadcast(size, group=group, group_src=lead)
    if rank != lead and not 0 < int(size.item()) <= DESCRIPTION_MAX_BYTES:
        raise StateError(f"The state description received claims {int(size.item())} bytes: refused.")
    buffer = (torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(transport) if rank == lead
              else torch.empty(int(size.item()), dtype=torch.uint8, device=transport))
    dist.broadcast(buffer, group=group, group_src=lead)

    refusal: StateError | None = None
    if rank == lead:
        flag = SENDS
    else:
        try:
            skeleton, specs, bucket_bytes = parse_description(buffer.cpu().numpy().tobytes())
            flag, mine = _take(state, skeleton, specs, device, sender=rank in sources)
        except StateError as exc:
            flag, refusal = REFUSED, exc
    del buffer
    flags = [torch.zeros(1, dtype=torch.int64, device=transport) for _ in range(world)]
    dist.all_gather(flags, torch.tensor([flag], dtype=torch.int64, device=transport), group=group)
    flags = [int(f.item()) for f in flags]
    senders = [lead] + [r for r in sources[1:] if flags[r] == SENDS]
    receivers = [r for r in range(world) if flags[r] == RECEIVES]
    if refusal is not None:
        raise refusal
    buckets = plan_buckets([(s.dtype, s.numel, s.itemsize) for s in specs], bucket_bytes, PACK_BELOW_BYTES)
    owners = bucket_owners(len(buckets), senders)
    if receivers:
        _move(buckets, owners, len(senders), mine, specs, rank, receivers, transport, group)
    if flag == RECEIVES:
        filled = {spec.path: tensor for spec, tensor in zip(specs, mine, strict=True)}
        state.load_state_dict(rebuild(skeleton, filled))
    return Transferred(tuple(senders), len(buckets), sum(s.nbytes for s in specs), time.perf_counter() - began)


def _take(state: State | Any, skeleton: dict[str, Any], specs: list[TensorSpec], device: torch.device,
          sender: bool) -> tuple[int, list[torch.Tensor]]:
    """This member's tensor for each spec (its own, or allocated), and whether it sends or receives."""
    _, found = flatten(state.state_dict())
    own_tensors = {path: tensor for path, tensor in found}
    own = {path: Own(DTYPE_NAMES.get(t.dtype, str(t.dtype)), tuple(t.shape), t.is_contiguous())
           for path, t in own_tensors.items()}
    optimizer = state.optimizer
    groups = ([len(g["params"]) for g in optimizer.state_dict()["param_groups"]]
              if isinstance(optimizer, torch.optim.Optimizer) else None)
    checks = dict(objects=state.objects().keys(), own_param_groups=groups, allocation_limit=allocation_limit(own))
    if sender:
        try:
            check_description(skeleton, specs, own, sender=True, **checks)
            return SENDS, [own_tensors[spec.path] for spec in specs]
        except StateError:
            pass  # its state is not the lead's after all: it receives it like the others
    reuse = check_description(skeleton, specs, own, sender=False, **checks)
    tensors = [own_tensors[spec.path] if in_place else
               torch.empty(spec.shape, dtype=DTYPES[spec.dtype], device="cpu" if spec.on_cpu else device)
               for spec, in_place in zip(specs, reuse, strict=True)]
    return RECEIVES, tensors


def _move(buckets: list[Bucket], owners: list[int], senders: int, tensors: list[torch.Tensor],
          specs: list[TensorSpec], rank: int, receivers: list[int], transport: torch.device,
          group: dist.ProcessGroup | None = None) -> None:
    """The buckets, point to point from each one's owner to every receiver, up to WINDOW of them in
    flight on each member: a bucket that lives in its tensor costs no memory, so a joiner's
    receives need not wait for each other; a packed one takes a buffer, at most one on a sender
    (its state + one bucket) and one per sender on a receiver.

    Every member posts its buckets in index order and only ever waits for its oldest one, so
    the lowest bucket not yet through is always posted on both of its sides: no deadlock."""
    receiving = rank in receivers
    most_buffers = senders if receiving else 1
    in_flight: collections.deque = collections.deque()  # (bucket, works, its tensor, is a buffer)
    buffers = 0

    def complete_oldest() -> None:
        nonlocal buffers
        bucket, works, payload, is_buffer = in_flight.popleft()
        for work in works:
            work.wait()
        if is_buffer:
            if receiving:
                _unpack(bucket, payload, tensors, specs)
            buffers -= 1

    for index, (owner, bucket) in enumerate(zip(owners, buckets, strict=True)):
        if rank != owner and not receiving:
            continue
        view = _single_view(bucket, tensors, transport)
        while in_flight and (len(in_flight) >= WINDOW or (view is None and buffers >= most_buffers)):
            complete_oldest()
        if rank == owner:
            payload = view if view is not None else _pack(bucket, tensors, transport)
            works = [dist.isend(payload, group=group, tag=index, group_dst=receiver) for receiver in receivers]
        else:
            payload = view if view is not None else torch.empty(bucket.nbytes, dtype=torch.uint8, device=transport)
            works = [dist.irecv(payload, group=group, tag=index, group_src=owner)]
        buffers += view is None
        in_flight.append((bucket, works, payload, view is None))
    while in_flight:
        complete_oldest()


def _single_view(bucket: Bucket, tensors: list[torch.Tensor], transport: torch.device) -> torch.Tensor | None:
    """The bytes of a one-piece bucket inside its tensor, if they can travel from there."""
    if len(bucket.pieces) != 1:
        return None
    piece = bucket.pieces[0]
    tensor = tensors[piece.tensor]
    if not tensor.is_contiguous() or tensor.device != transport:
        return None
    return tensor.view(-1)[piece.start:piece.start + piece.count].view(torch.uint8)


def _pack(bucket: Bucket, tensors: list[torch.Tensor], transport: torch.device) -> torch.Tensor:
    # reshape copies only a tensor that is not contiguous (state tensors are, in practice)
    parts = [tensors[p.tensor].reshape(-1)[p.start:p.start + p.count].to(transport) for p in bucket.pieces]
    return torch.cat(parts).view(torch.uint8)


def _unpack(bucket: Bucket, packed: torch.Tensor, tensors: list[torch.Tensor], specs: list[TensorSpec]) -> None:
    offset = 0
    for piece in bucket.pieces:
        length = piece.count * specs[piece.tensor].itemsize
        source = packed[offset:offset + length].view(DTYPES[bucket.dtype])
        tensors[piece.tensor].view(-1)[piece.start:piece.start + piece.count].copy_(source)
        offset += length
