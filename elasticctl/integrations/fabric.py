"""A Lightning Fabric loop in hot mode: Fabric set up on each generation of ``elasticctl.train.run``.

Under ``elasticctl up --recovery hot`` the survivors of a node's loss keep their processes, and a
joiner gets the state from a peer; the script's loop is a function that ``elasticctl.train.run``
re-enters with each generation of workers (``train(state, group)``). A Fabric loop becomes one by
making its ``Fabric`` there, on that generation::

    from elasticctl.integrations.fabric import Fabric, unwrapped   # was: from lightning.fabric import Fabric

    def train(state, group):                    # re-entered for every generation
        fabric = Fabric(group)                  # this generation's: its DDP on this generation's group
        model = fabric.setup(state.model)
        ...                                     # the loop: fabric.backward(loss), then state.commit()
    elastic.run(state, train, wrap=unwrapped)   # the model's DDP is Fabric's

:class:`Fabric` is Lightning's, with the world of the generation rather than torchrun's: torchrun
started the workers once and its ``RANK``/``WORLD_SIZE`` stay as they were, while the generation's
process group (the default group, formed by the runtime) has the ranks and the size of the
workers in it now. Fabric's DDP strategy finds that group up and joins it as it is.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.fabric import Fabric as LightningFabric
from lightning.fabric.plugins.environments import ClusterEnvironment

from elasticctl.errors import ConfigError
from elasticctl.integrations.loops import unwrapped
from elasticctl.train.group import Group

__all__ = ["Fabric", "unwrapped"]


class GenerationEnvironment(ClusterEnvironment):
    """Fabric's view of the world: the generation's ranks and size, whatever Fabric counts from
    its devices and nodes (its setters are for launchers that decide ranks; here the rendezvous
    decided them)."""

    def __init__(self, group: Group) -> None:
        super().__init__()
        self.group = group

    @property
    def creates_processes_externally(self) -> bool:
        return True  # torchrun did

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")  # unused: the group is up

    @property
    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", "0"))

    @staticmethod
    def detect() -> bool:
        return False  # only ever given

    def world_size(self) -> int:
        return self.group.world_size

    def set_world_size(self, size: int) -> None:
        pass

    def global_rank(self) -> int:
        return self.group.rank

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return self.group.local_rank

    def node_rank(self) -> int:
        return self.group.rank // max(1, self.group.local_world_size)

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        pass


class Fabric(LightningFabric):
    """Lightning's ``Fabric`` on one generation (``group``, as ``elasticctl.train.run`` hands it to
    the training function), launched: ``setup`` wraps the model in DDP on the generation's group.

    Every argument but ``group`` is Fabric's; ``accelerator`` defaults to the generation's device
    (``cuda`` or ``cpu``), ``devices`` and ``num_nodes`` to its shape, ``strategy`` to ``"ddp"``.
    Make one per generation (its ranks are that generation's), and set up ``state.model`` with it
    each time; leave the optimizer step to ``state.commit()``, which applies it at the step
    boundary, and the data to ``state.sampler`` (``setup_dataloaders`` would put Fabric's own
    sampler in its place).
    """

    def __init__(self, group: Group, **kwargs: Any) -> None:
        if not isinstance(group, Group):
            raise ConfigError(f"Fabric(group) takes the generation the training function was given, "
                              f"not a {type(group).__name__}.")
        kwargs.setdefault("accelerator", "cuda" if group.device.type == "cuda" else "cpu")
        kwargs.setdefault("devices", max(1, group.local_world_size))
        kwargs.setdefault("num_nodes", max(1, group.world_size // max(1, group.local_world_size)))
        kwargs.setdefault("strategy", "ddp")
        plugins = kwargs.get("plugins")
        plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [] if plugins is None else [plugins]
        kwargs["plugins"] = [*plugins, GenerationEnvironment(group)]
        super().__init__(**kwargs)
        self.launch()  # sets the strategy up on the group that is up; starts no process
