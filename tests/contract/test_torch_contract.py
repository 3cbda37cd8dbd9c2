"""torch's rendezvous and agent contract, as torch's own elastic tests exercise it.

Each scenario is rebuilt with this project's code and a real etcd, not copied from
torch's test files: nodes whose workers finish far apart (the exit barrier must not
fail the job), options torch's launchers pass, threads after ``shutdown()`` and a
fork afterwards, ``is_closed()`` after ``shutdown()``, no process-wide side effect
of creating a handler, and quarantine under plain torchrun.

Layer tests/contract: a real etcd, no training processes. The other tests of this subject:
tests/process/test_torch_contract_processes.py.
"""

from __future__ import annotations

import os

import pytest

from elasticctl.embedded_etcd import free_port


def _create(endpoint: str, run_id: str, min_nodes: int = 1, max_nodes: int = 1, **conf):
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

    params = RendezvousParameters("etcd3", endpoint, run_id, min_nodes, max_nodes, local_addr="127.0.0.1", **conf)
    return rendezvous_handler_registry.create_handler(params)


# -- contract differences ---------------------------------------------------------------

@pytest.mark.parametrize("conf", [
    {"is_host": True},            # torch's agent tests, c10d's option
    {"store_type": "tcp"},        # c10d
    {"etcd_prefix": "/torchelastic/p2p"},  # torch's etcd (v2) handler
    {"timeout": 900},             # torch's launcher adds it to every backend's options
    {"rank": 0},                  # torchrun, for the static backend
])
def test_options_torchs_launchers_pass_are_accepted(default_etcd, run_id, conf):
    handler = _create(default_etcd.endpoint, run_id, **conf)
    try:
        assert handler.get_backend() == "etcd3"
    finally:
        handler.shutdown()


def test_an_unknown_option_is_still_one_sentence_naming_it(default_etcd, run_id):
    with pytest.raises(ValueError, match=r"^The rendezvous option 'is_hots' is unknown; [^\n]*\.$"):
        _create(default_etcd.endpoint, run_id, is_hots=True)


def test_is_closed_after_a_shutdown_that_closed_the_run(default_etcd, run_id):
    handler = _create(default_etcd.endpoint, run_id)
    handler.next_rendezvous()
    assert not handler.is_closed()
    handler.shutdown()
    assert handler.is_closed()
    other = _create(default_etcd.endpoint, run_id)
    try:
        assert other.is_closed()
    finally:
        other.shutdown()


def test_creating_a_handler_leaves_the_process_environment_alone(default_etcd, run_id, monkeypatch):
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    monkeypatch.delenv("ELASTICCTL_RESTARTS", raising=False)
    before = dict(os.environ)
    handler = _create(default_etcd.endpoint, run_id)
    try:
        assert dict(os.environ) == before
        # A c10d handler created afterwards in the same process shares its agent store, as by default.
        c10d = rendezvous_handler_registry.create_handler(RendezvousParameters(
            "c10d", f"127.0.0.1:{free_port()}", run_id, 1, 1, is_host=True))
        try:
            assert c10d.use_agent_store
        finally:
            c10d.shutdown()
    finally:
        handler.shutdown()
