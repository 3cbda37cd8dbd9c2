"""The ``torchrun.handlers`` entry point of the ``etcd3`` rendezvous.

torch loads its out-of-tree handlers while ``torch.distributed.elastic.rendezvous``
is being imported, so this module must not import that package (nor
:mod:`elasticctl.rendezvous`, which does) at import time: ``import
elasticctl.rendezvous`` would otherwise meet itself half-initialised and leave
``etcd3`` unregistered in that process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def create_rdzv_handler(params: Any) -> Any:
    """Build the handler for torchrun's ``RendezvousParameters``."""
    from elasticctl.rendezvous import create_rdzv_handler as create

    return create(params)


def handler_factory() -> Callable[[Any], Any]:
    """The entry point: torch calls it once and registers the returned creator."""
    return create_rdzv_handler
