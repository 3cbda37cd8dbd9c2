"""A sharded training state as the state transfer moves it: local shards, with global shapes
taken from this worker's own parameters, never from the peer."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import torch

from elasticctl.train.state import State


class LocalShards:
    """A sharded :class:`State` as :mod:`elasticctl.train.state_transfer.transfer` moves it: every DTensor replaced by
    this worker's local shard (a view of it: received in place), turned back into DTensors of this
    worker's own mesh when loaded. Global shapes come from this worker's own parameters, never
    from the peer."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.optimizer = state.optimizer

    def objects(self) -> dict[str, Any]:
        return self.state.objects()

    def state_dict(self) -> dict[str, Any]:
        return _to_local(self.state.state_dict())

    def load_state_dict(self, received: dict[str, Any]) -> None:
        own = self.state.state_dict()
        parameters = [p for group in (self.optimizer.param_groups if self.optimizer else ()) for p in group["params"]]
        loaded = dict(received)
        loaded["model"] = _like(received.get("model"), own.get("model"))
        if "optimizer" in received and isinstance(received["optimizer"], dict):
            loaded["optimizer"] = _optimizer_like(received["optimizer"], parameters)
        self.state.load_state_dict(loaded)


def _to_local(tree: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        return tree.to_local()
    if isinstance(tree, dict):
        items = {key: _to_local(value) for key, value in tree.items()}
        return type(tree)(items) if isinstance(tree, collections.OrderedDict) else items
    if isinstance(tree, list):
        return [_to_local(value) for value in tree]
    return tree


def _like(received: Any, own: Any) -> Any:
    """``received``'s tensors as DTensors wherever ``own`` has one at the same key (its mesh, placements
    and global shape)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(received, dict) or not isinstance(own, dict):
        return received
    result = collections.OrderedDict() if isinstance(received, collections.OrderedDict) else {}
    for key, value in received.items():
        mine = own.get(key)
        result[key] = (DTensor.from_local(value, mine.device_mesh, mine.placements, shape=mine.shape,
                                          stride=mine.stride(), run_check=False)
                       if isinstance(mine, DTensor) and isinstance(value, torch.Tensor) else value)
    metadata = getattr(received, "_metadata", None)
    if metadata is not None:
        result._metadata = metadata  # type: ignore[attr-defined]
    return result


def _optimizer_like(received: dict[str, Any], parameters: Sequence[Any]) -> dict[str, Any]:
    """The optimizer's received state with each per-parameter tensor shaped like that parameter's
    local shard made a DTensor like the parameter (the state of parameter ``i`` is keyed ``i``)."""
    from torch.distributed.tensor import DTensor

    states = received.get("state")
    if not isinstance(states, dict):
        return received
    rebuilt = {}
    for index, values in states.items():
        parameter = parameters[index] if type(index) is int and 0 <= index < len(parameters) else None
        if not isinstance(values, dict) or not isinstance(parameter, DTensor):
            rebuilt[index] = values
            continue
        local = parameter.to_local()
        rebuilt[index] = {
            key: (DTensor.from_local(value, parameter.device_mesh, parameter.placements, shape=parameter.shape,
                                     stride=parameter.stride(), run_check=False)
                  if isinstance(value, torch.Tensor) and value.shape == local.shape and value.dim() > 0 else value)
            for key, value in values.items()}
    return {**received, "state": rebuilt}
