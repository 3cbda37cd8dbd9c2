"""The runtime's phases, in process: one worker (a world of one, gloo on the CPU).

Restart mode as a plain ``python script.py`` runs it; hot mode on a real etcd, with the
environment the node's handler would give it. The training function, the ``wrap`` hook
(called while a generation forms) and ``on_event`` note the runtime's phase.

Layer tests/unit: no etcd, no processes. The other tests of this subject:
tests/contract/test_runtime_phases_hot.py.
"""

from __future__ import annotations

import os
import signal

from support.runtime_phases import Trace, _runtime, _step

from elasticctl.train.groups.membership import RestartMembership
from elasticctl.train.runtime import Phase


def test_restart_mode_trains_and_finishes(worker_env):
    trace = Trace()
    runtime = _runtime(trace, worker_env)
    assert isinstance(runtime.membership, RestartMembership) and runtime.phase is Phase.FORMING

    def train(state, group):
        while state.step < 3:
            _step(state)
            trace.note(f"step {state.step}")

    runtime.run(train)
    assert trace.seen == [("wrap 0", Phase.FORMING), ("step 1", Phase.TRAINING), ("step 2", Phase.TRAINING),
                          ("step 3", Phase.TRAINING)]
    assert runtime.phase is Phase.FINISHED
    assert sorted(p.name for p in worker_env.iterdir())  # the final checkpoint of step 3 is written


def test_restart_mode_stops_for_the_agent_at_the_boundary_after_sigterm(worker_env):
    trace = Trace()
    runtime = _runtime(trace, worker_env)

    def train(state, group):
        while True:
            _step(state)
            trace.note(f"step {state.step}")
            if state.step == 2:
                os.kill(os.getpid(), signal.SIGTERM)  # the agent stops its workers

    runtime.run(train)
    assert trace.seen == [("wrap 0", Phase.FORMING), ("step 1", Phase.TRAINING), ("step 2", Phase.TRAINING),
                          ("final_checkpoint signalled=True", Phase.LEAVING)]
    assert runtime.state.step == 3  # the boundary of step 3 is the one that acts on the stop
    assert runtime.phase is Phase.FINISHED
