"""The one description of a training state that members send each other: what a receiver reads from
a peer before any tensor moves, and checks against its own state.

A description is a small ``torch.save`` blob of a dict, read with ``weights_only=True`` (no pickle
beyond tensors and plain containers: a peer can send wrong numbers, never code), of at most
:data:`DESCRIPTION_MAX_BYTES`:

- ``format``: :data:`DESCRIPTION_FORMAT`;
- ``state``: the state dict walked over dicts, lists and tuples in their order (:func:`flatten`),
  each tensor replaced by ``None``: the step, fields, the optimizer's hyperparameters, the
  sampler's position, everything but the tensors' values;
- ``tensors``: ``[path, dtype, shape, on_cpu]`` of each tensor that travels after the
  description, in this order (the replicas' transfer, :mod:`elasticctl.train.state_transfer.transfer`);

and the optional sections of its users:

- ``bucket_bytes``: the lead's bucket size, which every member then uses (the transfer);
- ``sharded``: ``[path, dtype, global shape, on_cpu]`` of each sharded tensor whose rows travel
  after it, resharded (the peer copies, :mod:`elasticctl.train.recovery.from_peer_copies`);
- ``values``: ``[path, tensor, on_cpu]`` of small tensors carried in the description itself
  (the peer copies: the optimizer's step counters), at most :data:`VALUES_MAX_BYTES` in all.

:func:`describe_state` writes one; :func:`read_description` reads one, checking every section's
shape (valid paths each with a place in ``state``, listed once across the sections; known dtypes;
shapes in bounds); StateError for anything else, never another error. What a member then checks
against its own state is its user's: :func:`check_description` for the transfer (exactly the
model's tensors; what it lacks allocated up to :data:`ALLOCATION_FACTOR` times its model's bytes).
"""

from __future__ import annotations

import collections
import dataclasses
import io
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch

from elasticctl.train.state import StateError

DESCRIPTION_FORMAT = 1
DESCRIPTION_MAX_BYTES = 64 * 2**20  # a description larger than this is refused unread
VALUES_MAX_BYTES = 64 * 2**20       # the tensors carried in a description (the optimizer's counters...)
MAX_TENSORS = 2**20
MAX_DIMS = 64
MIN_BUCKET_BYTES = 256            # tests use small buckets; below this the messages are all overhead
MAX_BUCKET_BYTES = 2**30          # a receiver allocates one bucket per sender
# What a receiver allocates for tensors it lacks (a joiner's optimizer state, tensors in fields)
# is at most this many times its own model's bytes, plus the slack: Adam needs twice the model.
ALLOCATION_FACTOR = 4
ALLOCATION_SLACK = 64 * 2**20

# The dtypes a description may name, by name: a peer's string is looked up here, never in torch.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "complex64", "complex128", "int64", "int32",
                 "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2")
    if isinstance(getattr(torch, name, None), torch.dtype)
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


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


@dataclasses.dataclass(frozen=True)
class Description:
    """A description as read (see the module docstring); the optional sections empty (or None) when absent."""

    state: dict[str, Any]
    tensors: list[TensorSpec]
    bucket_bytes: int | None = None
    sharded: list[TensorSpec] = dataclasses.field(default_factory=list)
    values: dict[tuple, tuple[torch.Tensor, bool]] = dataclasses.field(default_factory=dict)  # path -> (value, on_cpu)


def describe_state(state: Any, tensors: Sequence[TensorSpec] = (), *, bucket_bytes: int | None = None,
                   sharded: Sequence[TensorSpec] = (), values: Sequence[tuple[tuple, torch.Tensor, bool]] = ()) -> bytes:
    """The description blob of the skeleton ``state`` (tensors replaced by None) with these sections."""
    description: dict[str, Any] = {"format": DESCRIPTION_FORMAT, "state": state,
                                   "tensors": [[list(s.path), s.dtype, list(s.shape), s.on_cpu] for s in tensors]}
    if bucket_bytes is not None:
        description["bucket_bytes"] = bucket_bytes
    if sharded:
        description["sharded"] = [[list(s.path), s.dtype, list(s.shape), s.on_cpu] for s in sharded]
    if values:
        description["values"] = [[list(path), value, on_cpu] for path, value, on_cpu in values]
    buffer = io.BytesIO()
    torch.save(description, buffer)
    return buffer.getvalue()


def read_description(blob: bytes, what: str = "the state description received") -> Description:
    """A peer's description blob, every section checked (see the module docstring); StateError naming
    ``what`` if it cannot be read, is of another format or is malformed."""
    name = what[:1].upper() + what[1:]
    if len(blob) > DESCRIPTION_MAX_BYTES:
        raise StateError(f"{name} is {len(blob)} bytes, more than {DESCRIPTION_MAX_BYTES}: refused.")
    try:
        description = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as exc:  # whatever a malformed blob makes torch raise
        raise StateError(f"{name} cannot be read: {exc}") from exc
    if not isinstance(description, dict) or description.get("format") != DESCRIPTION_FORMAT:
        raise StateError(f"{name} is not one this worker reads.")
    skeleton = description.get("state")
    if not isinstance(skeleton, dict) or type(skeleton.get("step")) is not int:
        raise StateError(f"{name} holds no training state.")
    sections = {}
    for section in ("tensors", "sharded", "values"):
        entries = description.get(section, [] if section != "tensors" else None)
        if not isinstance(entries, list) or len(entries) > MAX_TENSORS:
            raise StateError(f"{name} has no valid list of {section}.")
        sections[section] = entries
    bucket_bytes = description.get("bucket_bytes")
    if bucket_bytes is not None and (type(bucket_bytes) is not int
                                     or not MIN_BUCKET_BYTES <= bucket_bytes <= MAX_BUCKET_BYTES):
        raise StateError(f"{name} has a bucket size out of bounds ({bucket_bytes!r:.40}).")
    tensors = [_spec(entry, number, what, "tensors") for number, entry in enumerate(sections["tensors"])]
    sharded = [_spec(entry, number, what, "sharded tensors") for number, entry in enumerate(sections["sharded"])]
    values, listed, carried = {}, [], 0
    for number, entry in enumerate(sections["values"]):
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[1], torch.Tensor)
                and entry[1].dtype in DTYPE_NAMES and type(entry[2]) is bool):
            raise StateError(f"Value {number} of {what} is malformed.")
        _check_path(entry[0], number, what, "values")
        carried += entry[1].numel() * entry[1].element_size()
        if carried > VALUES_MAX_BYTES:
            raise StateError(f"{name} carries more than {VALUES_MAX_BYTES} bytes of tensors in itself: refused.")
        values[tuple(entry[0])] = (entry[1], entry[2])
        listed.append(tuple(entry[0]))
    paths: set[tuple] = set()
    for path in [*(s.path for s in tensors), *(s.path for s in sharded), *listed]:
        shown = ".".join(map(str, path))
        if path in paths:
            raise StateError(f"{name} lists the tensor '{shown}' twice.")
        paths.add(path)
        if not _holds_a_tensor_slot(skeleton, path):
            raise StateError(f"{name} lists a tensor '{shown}' its state has no place for.")
    return Description(skeleton, tensors, bucket_bytes, sharded, values)


def _check_path(path: Any, number: int, what: str, section: str) -> None:
    if (not isinstance(path, (list, tuple)) or not path or len(path) > MAX_DIMS
            or not all(type(key) in (str, int) for key in path)):
        raise StateError(f"Tensor {number} of {what} ({section}) has no valid path.")


def _spec(entry: Any, number: int, what: str, section: str) -> TensorSpec:
    if not (isinstance(entry, (list, tuple)) and len(entry) == 4):
        raise StateError(f"Tensor {number} of {what} ({section}) is malformed.")
    path, dtype, shape, on_cpu = entry
    _check_path(path, number, what, section)
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise StateError(f"Tensor {number} of {what} ({section}) has an unknown dtype "
                         f"({str(dtype)[:40]!r}).")
    if (not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS
            or not all(type(size) is int and 0 <= size < 2**62 for size in shape)):
        raise StateError(f"Tensor {number} of {what} ({section}) has no valid shape.")
    if type(on_cpu) is not bool:
        raise StateError(f"Tensor {number} of {what} ({section}) does not say where it lives.")
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
