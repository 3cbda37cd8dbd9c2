"""The progress series rank 0 appends for the dashboard: sampled, bounded, bound to the history's
lease, and never a reason for the trainer to stall. Real etcd; waits poll etcd, never sleep.

Layer tests/unit: no etcd, no processes. The other tests of this subject:
tests/contract/test_progress_history_etcd.py.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elasticctl.etcd.client import EtcdClient, EtcdSettings
from elasticctl.embedded_etcd import free_port
from elasticctl.job.keys import JobKeys
from elasticctl.job.records import ProgressSample
from elasticctl.job.progress import ProgressPublisher


UPDATE = {
    "epoch": 0,
    "loss": 0.5,
    "samples_per_s": 100.0,
    "world_size": 3,
    "last_checkpoint_step": None,
}


def test_a_dead_etcd_costs_the_publisher_nothing(run_id, caplog):
    dead = EtcdClient(
        EtcdSettings.from_string(f"127.0.0.1:{free_port()}", retry_timeout=0.3, read_timeout=0.2)
    )
    keys = JobKeys(run_id)
    publisher = ProgressPublisher(dead, keys.progress, interval=0.05, keys=keys, sample_interval=0)
    for step in range(100):  # returns at once although nothing reaches etcd
        publisher.publish(step=step, **UPDATE)
    publisher.close(timeout=30)
    assert "Dropped a progress update" in caplog.text


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            b'{"time": 10, "step": 3, "loss": 0.25, "samples_per_s": 9, "world_size": 2}',
            ProgressSample(10.0, 3, 0.25, 9.0, 2),
        ),
        (b'{"time": 10.5, "step": 0}', ProgressSample(10.5, 0)),
        # optional fields of the wrong type or out of range read as absent
        (
            b'{"time": 1, "step": 1, "loss": "x", "samples_per_s": -1, "world_size": 0}',
            ProgressSample(1.0, 1),
        ),
        (
            b'{"time": 1, "step": 1, "loss": NaN, "samples_per_s": Infinity, "world_size": 1.5}',
            ProgressSample(1.0, 1),
        ),
        (b'{"time": 1, "step": 1, "loss": 1e999, "world_size": true}', ProgressSample(1.0, 1)),
        (b'{"time": 1, "step": 1, "loss": ' + b"9" * 400 + b"}", ProgressSample(1.0, 1)),
        # time and step are required
        (b'{"step": 1}', None),
        (b'{"time": 1}', None),
        (b'{"time": -1, "step": 1}', None),
        (b'{"time": 1e300, "step": 1}', None),
        (b'{"time": 1, "step": -1}', None),
        (b'{"time": true, "step": 1}', None),
        (b'{"time": 1, "step": 1.0}', None),
        (b"", None),
        (b"[]", None),
        (b"\xff\xfe", None),
        (b"[" * 100_000, None),
    ],
)
def test_progress_samples_parse_or_read_as_none(raw, expected):
    assert ProgressSample.from_json(raw) == expected


def test_a_sample_round_trips():
    sample = ProgressSample(
        time=1700000000.123456, step=7, loss=0.125, samples_per_s=3.5, world_size=4
    )
    assert ProgressSample.from_json(sample.to_json().encode()) == sample


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=10,
)
FIELDS = st.sampled_from(["time", "step", "loss", "samples_per_s", "world_size", "x"])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.binary(max_size=200),
        st.dictionaries(FIELDS, JSON, max_size=6).map(lambda d: json.dumps(d).encode()),
    )
)
def test_random_progress_samples_parse_or_read_as_none(raw):
    sample = ProgressSample.from_json(raw)
    if sample is not None:
        assert 0 <= sample.time < 1e11 and sample.step >= 0
        assert ProgressSample.from_json(sample.to_json().encode()) == sample
