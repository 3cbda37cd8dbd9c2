"""The runtime's phases, in process: one worker (a world of one, gloo on the CPU).

Restart mode as a plain ``python script.py`` runs it; hot mode on a real etcd, with the
environment the node's handler would give it. The training function, the ``wrap`` hook
(called while a generation forms) and ``on_event`` note the runtime's phase.

Layer tests/contract: a real etcd, no training processes. The other tests of this subject:
tests/unit/test_runtime_phases.py.
"""

from __future__ import annotations

import os
import signal

from support.runtime_phases import Trace, _runtime, _step

from elasticctl.job import environment
from elasticctl.job.options import RecoveryMode
from elasticctl.job.settings import HotSettings, WorkerSettings
from elasticctl.train.groups.membership import HotMembership
from elasticctl.train.runtime import Phase


def test_hot_mode_re_forms_in_process_after_a_failure_and_leaves_with_the_job(worker_env, default_etcd, run_id,
                                                                                monkeypatch):
    monkeypatch.setenv(environment.ETCD, default_etcd.endpoint)
    monkeypatch.setenv(environment.JOB, run_id)
    monkeypatch.setenv(environment.NODE_ADDR, "127.0.0.1")
    monkeypatch.setenv(environment.WORKER_SETTINGS, WorkerSettings(
        RecoveryMode.HOT, hot=HotSettings(min_nodes=1, max_nodes=1, node_ttl=5)).to_json())
    trace = Trace()
    runtime = _runtime(trace, worker_env)
    assert isinstance(runtime.membership, HotMembership) and runtime.phase is Phase.FORMING
    failed = []

    def train(state, group):
        while True:
            _step(state)
            trace.note(f"step {state.step}")
            if state.step == 2 and not failed:
                failed.append(group.number)
                raise RuntimeError("a peer's collective failed")  # recovered in process
            if state.step == 4:
                os.kill(os.getpid(), signal.SIGTERM)

    runtime.run(train)
    first = failed[0]
    assert trace.seen == [
        (f"wrap {first}", Phase.FORMING), ("step 1", Phase.TRAINING), ("step 2", Phase.TRAINING),
        (f"wrap {first + 1}", Phase.RE_FORMING), ("step 3", Phase.TRAINING), ("step 4", Phase.TRAINING),
        # alone, it leaves with the whole job: a final checkpoint
        ("final_checkpoint signalled=True", Phase.LEAVING),
    ]
    assert runtime.phase is Phase.FINISHED
