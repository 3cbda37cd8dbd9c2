"""What training scripts import: the elastic runtime, its state, the sampler.

::

    import elasticctl.train as elastic

    state = elastic.State(model, optimizer, sampler=elastic.ResumableSampler(dataset))
    def train(state, group):                      # re-entered for every generation
        for x, y in DataLoader(dataset, batch_size=32, sampler=state.sampler):
            loss_fn(group.model(x), y).backward()
            state.commit(samples=len(x))          # a step boundary
    elastic.run(state, train, checkpoint_every=100)

The names load on first use (PEP 562): ``python -m elasticctl.train.entry`` and the
modules of this package that need no torch import none through this file.
"""

import importlib

_EXPORTS = {"Group": "elasticctl.train.group", "run": "elasticctl.train.runtime",
            "State": "elasticctl.train.state", "ResumableSampler": "elasticctl.train.sampler",
            "hsdp_mesh": "elasticctl.train.sharding.shards"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
