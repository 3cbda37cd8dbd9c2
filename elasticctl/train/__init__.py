"""What training scripts import: the elastic runtime, its state, the sampler.

::

    import elasticctl.train as elastic

    state = elastic.State(model, optimizer, sampler=elastic.ResumableSampler(dataset))
    def train(state, group):                      # re-entered for every generation
        for x, y in DataLoader(dataset, batch_size=32, sampler=state.sampler):
            loss_fn(group.model(x), y).backward()
            state.commit(samples=len(x))          # a step boundary
    elastic.run(state, train, checkpoint_every=100)
"""

from elasticctl.sampler import ResumableSampler
from elasticctl.train.runtime import Group, run
from elasticctl.train.state import State

__all__ = ["Group", "ResumableSampler", "State", "run"]
