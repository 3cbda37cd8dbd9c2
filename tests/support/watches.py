"""A watch as the runtime's reporter sees it: after each of its calls, the verdicts it concluded,
as the reporter would record them ((kind, fields with the node where one was named)) and the
nodes it would ask to leave."""

from __future__ import annotations

import functools

from elasticctl.train.watches.verdicts import Eviction, Finding


def collecting(watch, events: list, leaves: list | None = None, kinds_only: bool = False):
    """``watch``, its ``at_boundary`` and ``before_step`` draining its verdicts into ``events`` and
    ``leaves`` after each call (raising or not, as the supervisor does)."""

    def drain() -> None:
        for verdict in watch.verdicts.take():
            if isinstance(verdict, Finding):
                fields = dict(verdict.fields) if verdict.node is None else {"node": verdict.node, **verdict.fields}
                events.append(verdict.kind if kinds_only else (verdict.kind, fields))
            elif isinstance(verdict, Eviction) and leaves is not None:
                leaves.append(verdict.node)

    for name in ("at_boundary", "before_step"):
        call = getattr(watch, name, None)
        if call is None:
            continue

        @functools.wraps(call)
        def drained(*args, _call=call, **kwargs):
            try:
                return _call(*args, **kwargs)
            finally:
                drain()

        setattr(watch, name, drained)
    return watch
