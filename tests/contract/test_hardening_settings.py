"""Correctness odds and ends of the launcher and the rendezvous, each reproduced with real
processes and a real etcd.

Layer tests/contract: a real etcd, no training processes. The other tests of this subject:
tests/process/test_hardening.py.
"""

from __future__ import annotations

import pytest

from elasticctl.etcd.client import EtcdClient


@pytest.mark.parametrize(("conf", "needle"), [
    ({"protocol": "ftp"}, "'ftp'"),
    ({"read_timeout": "abc"}, "'abc'"),
    ({"read_timeout": "-1"}, "'-1'"),
    ({"node_ttl": "abc"}, "node_ttl ('abc')"),
    ({"node_ttl": "99999999999999999999"}, "node_ttl"),
    ({"key_prefix": "/a/../b"}, "key_prefix"),
    ({"no_such_option": "1"}, "'no_such_option' is unknown"),
])
def test_bad_rendezvous_settings_are_value_errors_naming_the_value(default_etcd, run_id, conf, needle):
    # torch's backend tests expect ValueError for an invalid protocol or read_timeout.
    from torch.distributed.elastic.rendezvous import (
        RendezvousParameters,
        rendezvous_handler_registry,
    )

    params = RendezvousParameters("etcd3", default_etcd.endpoint, run_id, 1, 1, **conf)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        rendezvous_handler_registry.create_handler(params)


@pytest.mark.parametrize("run", ["jv/x", "jv/nodes", "abc\n"])
def test_run_ids_that_could_reach_another_jobs_keys_are_refused(default_etcd, run):
    # --rdzv-id=jv/x used to land inside job jv's prefix; `down --job jv` then deleted its keys.
    from torch.distributed.elastic.rendezvous import (
        RendezvousParameters,
        rendezvous_handler_registry,
    )

    params = RendezvousParameters("etcd3", default_etcd.endpoint, run, 1, 1)
    with pytest.raises(ValueError, match="run id"):
        rendezvous_handler_registry.create_handler(params)
    with EtcdClient(default_etcd.client_settings()) as client:
        assert not [kv for kv in client.get_prefix("/elasticctl/jobs/jv") if b"/jv/" in kv.key]
