"""Admission checks end to end: real `up`/`join` processes, a real etcd, loopback.

A node whose code differs from the job's, or whose own --check fails, is refused before it
registers (exit 1, one sentence naming the check), a node_refused event says so in the job's
history, and the nodes already training are not disturbed. Every wait is on records or etcd
keys, never a sleep. The unit tests of each rule: tests/unit/test_admission.py.
"""

from __future__ import annotations

import shutil
import sys

import pytest
from support.helpers import ELASTICCTL, MLP, wait_for
from support.jobs import TRAIN

from elasticctl.job.events import EventLog
from elasticctl.job.records import EventKind

FAIL_CHECK = f'{sys.executable} -c "import sys; print(\'no scratch space\'); sys.exit(1)"'
PASS_CHECK = f'{sys.executable} -c "import sys; sys.exit(0)"'


@pytest.fixture
def copied_job(job, tmp_path):
    """A job whose script is a copy of trainers/mlp.py in tmp_path: the test can change its bytes
    under the running job, as another host would have other code at the same path."""
    script = tmp_path / "mlp_copy.py"
    shutil.copyfile(MLP, script)
    j = job(train=[str(script), *TRAIN[1:]])
    return j, script


def join(j, name: str, *extra: str):
    return j.nodes(name, [*ELASTICCTL, "join", "--etcd", j.etcd.endpoint, "--job", j.name, "--node-id", name,
                          *extra])


def refusals(j, node: str) -> list:
    return [e for e in EventLog(j.client, j.registry.keys).read() if e.kind is EventKind.NODE_REFUSED
            and e.node == node]


def training_on(j, node: str) -> None:
    """Wait until ``node`` trains another step from now on (the refusal did not disturb it)."""
    last = max((r.get("step", 0) for r in j.records() if r.get("node") == node and "event" not in r), default=-1)
    wait_for(lambda: any(r.get("node") == node and "event" not in r and r.get("step", -1) > last
                         for r in j.records()), 60, f"node {node} training on")


def test_a_node_with_other_code_is_refused_and_the_job_trains_on(copied_job):
    j, script = copied_job
    j.up("a")
    j.wait_world(1, {"a"})
    spec = j.registry.read_spec()
    assert spec.script_sha256 is not None
    with script.open("a") as handle:  # this "host" now has other bytes at the job's script path
        handle.write("\n# edited on one host only\n")

    b = join(j, "b")
    assert b.wait(60) == 1, b.log()
    log = b.log()
    assert "check code" in log and "mlp_copy.py' differs on host" in log, log
    assert spec.script_sha256[:12] in log, log
    assert "install the same code on every host" in log, log

    events = wait_for(lambda: refusals(j, "b"), 30, "the node_refused event of b")
    assert "check code" in events[0].reason and spec.script_sha256[:12] in events[0].reason
    assert "b" not in j.registry.live_nodes()  # it never registered
    training_on(j, "a")


def test_skip_check_code_admits_that_node(copied_job):
    j, script = copied_job
    j.up("a")
    j.wait_world(1, {"a"})
    with script.open("a") as handle:
        handle.write("\n# edited on one host only\n")

    join(j, "b", "--skip-check", "code")
    j.wait_world(2, {"a", "b"})
    assert not refusals(j, "b")


def test_a_custom_check_that_fails_refuses_and_one_that_passes_admits(job):
    j = job()
    j.up("a")
    j.wait_world(1, {"a"})

    b = join(j, "b", "--check", FAIL_CHECK)
    assert b.wait(60) == 1, b.log()
    assert "check custom" in b.log() and "exited with status 1: no scratch space" in b.log(), b.log()
    events = wait_for(lambda: refusals(j, "b"), 30, "the node_refused event of b")
    assert "no scratch space" in events[0].reason
    training_on(j, "a")

    join(j, "c", "--check", PASS_CHECK)
    j.wait_world(2, {"a", "c"})
    assert not refusals(j, "c")


def test_a_second_up_with_other_code_is_an_admission_refusal_not_a_spec_conflict(copied_job):
    j, script = copied_job
    j.up("a")
    j.wait_world(1, {"a"})
    with script.open("a") as handle:
        handle.write("\n# edited on one host only\n")

    b = j.up("b")  # the same flags: the same spec, other code
    assert b.wait(60) == 1, b.log()
    assert "check code" in b.log() and "different spec" not in b.log(), b.log()
    wait_for(lambda: refusals(j, "b"), 30, "the node_refused event of b")
    training_on(j, "a")
