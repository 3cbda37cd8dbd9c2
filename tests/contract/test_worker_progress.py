"""The worker library in real torchrun processes (etcd3 rendezvous, CPU/gloo, loopback): the mlp trainer
loses a node, is told to leave, is killed mid-save, finds a corrupt checkpoint, and always resumes
from the newest complete checkpoint without repeating or skipping a sample of the epoch.

Layer tests/contract: a real etcd, no training processes. The other tests of this subject:
tests/process/test_worker.py, tests/unit/test_worker_lr_policy.py.
"""

from __future__ import annotations

import json

import pytest

from elasticctl.etcd.client import EtcdClient


pytestmark = pytest.mark.slow


def test_progress_publisher_rate_limits_and_never_blocks_on_a_dead_etcd(default_etcd, run_id, caplog):
    import pyetcd

    from elasticctl.etcd.client import EtcdSettings
    from elasticctl.embedded_etcd import free_port
    from elasticctl.job.progress import ProgressPublisher

    update = {"epoch": 0, "loss": 1.0, "samples_per_s": 1.0, "world_size": 1, "last_checkpoint_step": None}
    publisher = ProgressPublisher(EtcdClient(default_etcd.client_settings()), f"/{run_id}/progress")
    for step in range(1000):
        publisher.publish(step=step, **update)
    publisher.close()
    host, port = default_etcd.endpoint.rsplit(":", 1)
    value, meta = pyetcd.client(host, int(port)).get(f"/{run_id}/progress")
    assert json.loads(value)["step"] == 999, "the last update is flushed on close"
    assert meta.version <= 3, f"{meta.version} puts for a burst of 1000 updates"

    dead = EtcdClient(EtcdSettings.from_string(f"127.0.0.1:{free_port()}", retry_timeout=0.5, read_timeout=0.2))
    publisher = ProgressPublisher(dead, "/nowhere/progress", interval=0.1)
    for step in range(1000):  # returns at once although no put can succeed
        publisher.publish(step=step, **update)
    publisher.close(timeout=30)
    assert "Dropped a progress update" in caplog.text
