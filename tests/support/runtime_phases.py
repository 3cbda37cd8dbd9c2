"""One worker's runtime in process (a world of one, gloo on the CPU), its phases traced by its hooks."""

from __future__ import annotations

import torch
from torch import nn

from elasticctl.train.runtime import Phase, Runtime
from elasticctl.train.state import State


def _state() -> State:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return State(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _step(state: State) -> None:
    state.model(torch.randn(3, 4)).sum().backward()
    state.commit(samples=3)


class Trace:
    """The phases a run went through, as its hooks saw them."""

    def __init__(self) -> None:
        self.runtime: Runtime | None = None
        self.seen: list[tuple[str, Phase]] = []

    def note(self, what: str) -> None:
        self.seen.append((what, self.runtime.phase))

    def wrap(self, model, group):
        self.note(f"wrap {group.number}")  # while the generation forms
        return model

    def on_event(self, kind, **fields):
        if kind == "final_checkpoint":
            self.note(f"final_checkpoint signalled={fields['signalled']}")


def _runtime(trace: Trace, checkpoints) -> Runtime:
    trace.runtime = Runtime(_state(), checkpoint_dir=str(checkpoints), wrap=trace.wrap, on_event=trace.on_event,
                            async_checkpoint=False)
    return trace.runtime
