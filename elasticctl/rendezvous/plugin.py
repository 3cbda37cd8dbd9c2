"""The ``torchrun.handlers`` entry point of the ``etcd3`` rendezvous.

torch loads its out-of-tree handlers while ``torch.distributed.elastic.rendezvous``
is being imported, so this module must not import that package (nor
:mod:`elasticctl.rendezvous.backend`, which does) at import time: ``import
elasticctl.rendezvous.backend`` would otherwise meet itself half-initialised and leave
``etcd3`` unregistered in that process.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

# The exit status of a torchrun whose etcd3 options are wrong: click's and argparse's for a
# usage error, so a wrapper script can tell it from a training failure (1).
EXIT_BAD_OPTIONS = 2


def create_rdzv_handler(params: Any) -> Any:
    """Build the handler for torchrun's ``RendezvousParameters``.

    A :class:`~elasticctl.errors.ConfigError` (a bad ``--rdzv-conf``, run id, endpoint) is the
    user's mistake, said in one sentence: it is printed alone, first, and torchrun exits 2,
    instead of ending a 35-line traceback. Another ElasticctlError (etcd unreachable) is
    printed the same way, exit 1.
    """
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from elasticctl.errors import ConfigError, ElasticctlError
    from elasticctl.rendezvous.backend import create_rdzv_handler as create

    if not _inside_torchrun():
        return create(params)  # a program that embeds torch's launcher gets the exception itself
    try:
        return create(params)
    except ConfigError as exc:
        print(f"torchrun: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_BAD_OPTIONS) from None
    except (ElasticctlError, RendezvousConnectionError) as exc:  # etcd unreachable: one sentence too
        print(f"torchrun: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def _inside_torchrun() -> bool:
    """Whether this process is torchrun's command line (``torchrun`` or ``python -m
    torch.distributed.run``), whose user reads the first lines; not a program using torch's
    launcher API in process, which must get the exception rather than an exit."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return getattr(spec, "name", None) == "torch.distributed.run" or \
        sys.argv[0].rsplit("/", 1)[-1] == "torchrun"


def handler_factory() -> Callable[[Any], Any]:
    """The entry point: torch calls it once and registers the returned creator."""
    return create_rdzv_handler
