"""Keys back to names: the one place a job's keys are parsed (elasticctl/job/keys.py).

Layer tests/unit: no etcd. The records under these keys: tests/contract/test_registry.py.
"""

from __future__ import annotations

import pytest

from elasticctl.job.keys import JobKeys, job_of, jobs_root, name_under, probe_key


def test_a_name_under_a_prefix_is_the_rest_of_the_key_in_bytes_or_text():
    keys = JobKeys("j", "/p")
    assert name_under(keys.failures(3), keys.failure(3, "n1").encode()) == "n1"
    assert name_under(keys.events, keys.events + "0001-a-b") == "0001-a-b"
    assert name_under(keys.everything, keys.history) == "history/"


def test_bytes_that_are_not_utf8_are_replaced_not_an_error():
    keys = JobKeys("j")
    assert name_under(keys.nodes, keys.nodes.encode() + b"n\xff") == "n\ufffd"


def test_a_key_not_under_the_prefix_is_refused():
    keys = JobKeys("j")
    with pytest.raises(ValueError, match="is not under"):
        name_under(keys.nodes, keys.members + "n1")


def test_node_of_job_of_and_the_probe_key():
    keys = JobKeys("job-1", "/custom/")
    assert keys.node_of(keys.node("n-2").encode()) == "n-2"
    assert keys.node_of(keys.nodes + "a/b") == "a/b"  # a planted key: the caller checks the name
    assert job_of(keys.spec, "/custom/") == "job-1"
    assert job_of(keys.nodes, "/custom") == "job-1"
    assert not probe_key("/custom").startswith(keys.everything)
    assert probe_key("/custom").startswith(jobs_root("/custom"))
