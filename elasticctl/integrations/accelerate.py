"""An ``accelerate`` loop in hot mode: an ``Accelerator`` on each generation of ``elasticctl.train.run``.

Under ``elasticctl up --recovery hot`` the survivors of a node's loss keep their processes, and a
joiner gets the state from a peer; the script's loop is a function that ``elasticctl.train.run``
re-enters with each generation of workers (``train(state, group)``). An ``accelerate`` loop
becomes one by making its ``Accelerator`` there, on that generation::

    from elasticctl.integrations.accelerate import Accelerator, unwrapped  # was: from accelerate import Accelerator

    def train(state, group):                    # re-entered for every generation
        accelerator = Accelerator(group)        # this generation's: its DDP on this generation's group
        model = accelerator.prepare(state.model)
        ...                                     # the loop: accelerator.backward(loss), then state.commit()
    elastic.run(state, train, wrap=unwrapped)   # the model's DDP is accelerate's

accelerate keeps its state (``PartialState``, ``AcceleratorState``, ``GradientState``) in objects
shared by the whole process and read once: a second ``Accelerator`` would see the first
generation's world. :class:`Accelerator` clears them before it is made, so that it reads the
generation's process group (the default group, formed by the runtime), its ranks and its size.
What relies on those internals is here alone, pinned by tests/unit/test_loop_integrations_contract.py.
"""

from __future__ import annotations

from typing import Any

import accelerate
from accelerate.state import AcceleratorState, GradientState

from elasticctl.errors import ConfigError
from elasticctl.integrations.loops import unwrapped
from elasticctl.train.group import Group

__all__ = ["Accelerator", "unwrapped"]


class Accelerator(accelerate.Accelerator):
    """accelerate's ``Accelerator`` on one generation (``group``, as ``elasticctl.train.run`` hands
    it to the training function): ``prepare(model)`` wraps it in DDP on the generation's group.

    Every argument but ``group`` is accelerate's; ``cpu`` defaults to whether the generation's
    device is the CPU. Make one per generation and prepare ``state.model`` with it each time;
    leave the optimizer step to ``state.commit()``, which applies it at the step boundary, and the
    data to ``state.sampler`` (a prepared DataLoader would shard it again).
    """

    def __init__(self, group: Group, **kwargs: Any) -> None:
        if not isinstance(group, Group):
            raise ConfigError(f"Accelerator(group) takes the generation the training function was given, "
                              f"not a {type(group).__name__}.")
        # accelerate's process-wide state, read once: the generation's group replaces the last one's
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        kwargs.setdefault("cpu", group.device.type == "cpu")
        super().__init__(**kwargs)
        if (self.num_processes, self.process_index) != (group.world_size, group.rank):
            raise ConfigError(
                f"accelerate sees {self.num_processes} processes, this one at {self.process_index}, where the "
                f"generation has {group.world_size} workers, this one at rank {group.rank}: it would train "
                "a model of its own (on a host without CUDA, pass cpu=True).")

