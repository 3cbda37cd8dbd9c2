"""A crash in hot mode costs the same at every shape: real worker processes on a real etcd.

On gloo a peer's death reaches at once only the survivors whose pending collective waits on it
directly; the others wait on those survivors. Beyond three workers, some survivor always waits
on another survivor, and before the failed generation's connections were shut down
(elasticctl/train/groups/connections.py) that survivor waited out its collective's timeout, the node
TTL. Here every survivor's generation must end by a peer's closed connection, never by a
timeout: read from each survivor's own account of why its generation ended, not from a clock.
The node TTL is long (20 s) so that nothing but a collective's timeout could take that long.
"""

from __future__ import annotations

import re

import pytest
from test_churn import kill_node, processes_of, start_node, wait_nodes
from test_hot import HotJob, check_replicas_and_samples, hot_job  # noqa: F401 - the fixture

from elasticctl.job.settings import HotSettings

# "[d.0] generation 1 ends at step 30: RuntimeError: ... Connection closed by peer ..."
ENDED = re.compile(r"\[(?P<worker>[\w.-]+)\] generation (?P<generation>\d+) ends at step \d+: (?P<why>.*)")


def why_generation_ended(log: str, generation: int) -> list[str]:
    """What a worker's log says ended ``generation``."""
    return [m["why"] for m in ENDED.finditer(log) if int(m["generation"]) == generation]


@pytest.mark.parametrize(("nodes_count", "per_node"), [(5, 1), (3, 2)], ids=["5x1", "3x2"])
def test_every_survivor_of_a_kill_learns_of_it_from_a_peer_not_from_a_timeout(hot_job, nodes_count, per_node):
    job = hot_job(HotSettings(min_nodes=1, max_nodes=nodes_count, node_ttl=20, last_call=1.0, reform_last_call=0.5))
    names = [chr(ord("a") + i) for i in range(nodes_count)]
    for name in names:
        start_node(job, name, per_node)
    wait_nodes(job, set(names), per_node, 0.0)
    pids = {r["pid"] for r in job.steps()}

    victim, survivors = names[-1], set(names[:-1])
    failed = max(r["generation"] for r in job.steps())
    killed_at = job.last_time()
    kill_node(job, victim, per_node)
    wait_nodes(job, survivors, per_node, killed_at)

    for node in sorted(survivors):
        for process in processes_of(node, per_node):
            log = job.workers[process].log()
            ended = why_generation_ended(log, failed)
            assert ended, f"{process} never said why generation {failed} ended\n{log[-3000:]}"
            assert not any("Timed out" in why for why in ended), \
                f"{process} waited out its collective's timeout: {ended}"
    after = [r for r in job.steps() if r["time"] > killed_at and r["node"] in survivors]
    assert {r["pid"] for r in after} <= pids, "a survivor's worker restarted"
    check_replicas_and_samples(job.steps())
