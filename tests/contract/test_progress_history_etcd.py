"""The progress series rank 0 appends for the dashboard: sampled, bounded, bound to the history's
lease, and never a reason for the trainer to stall. Real etcd; waits poll etcd, never sleep.

Layer tests/contract: a real etcd, no training processes. The other tests of this subject:
tests/unit/test_progress_history.py.
"""

from __future__ import annotations

import json

from support.helpers import wait_for

from elasticctl.job.events import EventLog
from elasticctl.job.keys import JobKeys
from elasticctl.job.records import EventKind, ProgressSample
from elasticctl.job.progress import ProgressPublisher


UPDATE = {
    "epoch": 0,
    "loss": 0.5,
    "samples_per_s": 100.0,
    "world_size": 3,
    "last_checkpoint_step": None,
}


def test_samples_are_sampled_bounded_and_share_the_event_history_lease(etcd_client, run_id):
    keys = JobKeys(run_id)
    EventLog(etcd_client, keys).record(
        EventKind.NODE_JOINED, "a"
    )  # the history's lease exists first
    publisher = ProgressPublisher(
        etcd_client, keys.progress, interval=0.01, keys=keys, sample_interval=0.05, max_samples=4
    )
    step = 0

    def published_enough() -> bool:
        nonlocal step
        step += 1
        publisher.publish(step=step, **UPDATE)
        return step >= 200 and len(etcd_client.get_prefix(keys.progress_samples)) == 4

    wait_for(published_enough, 30, "four samples after 200 updates", interval=0.01)
    publisher.close()
    kvs = etcd_client.get_prefix(keys.progress_samples)
    samples = [ProgressSample.from_json(kv.value) for kv in kvs]
    assert len(kvs) == 4 and None not in samples
    assert [s.step for s in samples] == sorted(s.step for s in samples)
    assert samples[-1].step > 100, "the oldest samples are the ones deleted"
    assert all(s.world_size == 3 and s.loss == 0.5 and s.samples_per_s == 100.0 for s in samples)
    assert {kv.lease for kv in kvs} == {int(etcd_client.get(keys.events_lease).value)}
    # sampled: far fewer samples written than updates published (the bound aside)
    assert json.loads(etcd_client.get(keys.progress).value)["step"] == step
