"""Run a ``torch.distributed.launch``-era script that expects ``--local_rank=N``.

torchrun passes the local rank only as ``LOCAL_RANK`` (or as the dashed
``--local-rank``, which most tutorial parsers reject). This shim replaces itself
with the script and hands it the underscored flag, so the worker keeps its pid.

    python -m elasticctl.legacy_local_rank [--module] SCRIPT [ARGS...]
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> None:
    module = bool(argv) and argv[0] == "--module"
    if module:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: python -m elasticctl.legacy_local_rank [--module] SCRIPT [ARGS...]")
    script, *args = argv
    local_rank = os.environ.get("LOCAL_RANK", "0")
    target = ["-m", script] if module else [script]
    os.execv(sys.executable, [sys.executable, "-u", *target, f"--local_rank={local_rank}", *args])


if __name__ == "__main__":
    main(sys.argv[1:])
