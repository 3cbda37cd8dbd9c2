"""The etcd3 RendezvousBackend against torch's documented set_state/get_state contract.

Layer tests/unit: no etcd, no processes. The other tests of this subject:
tests/contract/test_backend.py.
"""

from __future__ import annotations

import pytest
from support.rendezvous import torch_state
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from elasticctl.etcd.client import EtcdClient, EtcdSettings
from elasticctl.embedded_etcd import free_port
from elasticctl.rendezvous.backend import EtcdRendezvousBackend


S0, S1, S2, S3 = (torch_state(n) for n in range(4))


def test_unreachable_etcd_raises_connection_error_naming_the_endpoint(run_id):
    port = free_port()
    client = EtcdClient(EtcdSettings.from_string(f"127.0.0.1:{port}", retry_timeout=0.5, read_timeout=0.5))
    backend = EtcdRendezvousBackend(client, run_id)
    with pytest.raises(RendezvousConnectionError, match=f"127.0.0.1:{port}"):
        backend.get_state()
    with pytest.raises(RendezvousConnectionError, match=f"127.0.0.1:{port}"):
        backend.set_state(S0)
