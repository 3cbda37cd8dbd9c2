"""Correctness odds and ends of the launcher and the rendezvous, each reproduced with real
processes and a real etcd.

Layer tests/process: real processes (elasticctl, torchrun, workers, tools). The other tests of this
subject: tests/contract/test_hardening_settings.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.helpers import WORKERS, torchrun_command

from elasticctl.etcd.client import EtcdClient
from elasticctl.job.registry import Registry


ELASTICCTL = [sys.executable, "-m", "elasticctl.cli"]
DOWN_THEN_DIE = str(WORKERS / "down_then_die.py")


@pytest.mark.slow
def test_down_seen_only_after_torchrun_exited_still_exits_0(default_etcd, run_id, nodes):
    # The node must look for a request once more after torchrun exits.
    node = nodes("a", [*ELASTICCTL, "up", "--etcd", default_etcd.endpoint, "--job", run_id,
                       "--nnodes", "1", "--node-id", "a", DOWN_THEN_DIE])
    assert node.wait(120) == 0, node.log()
    assert "stopped (job down)" in node.log()


@pytest.mark.slow
def test_a_crashed_agent_is_recorded_as_failed_not_done(default_etcd, run_id, nodes):
    # An agent that crashed (here: no second node within the join timeout) used to read as a
    # clean finish, with `finished` written for the whole job.
    node = nodes("crasher", torchrun_command(default_etcd.endpoint, run_id, "2", ["--steps", "1"],
                                             rdzv_conf="join_timeout=2"))
    assert node.wait(120) != 0
    assert "did not complete within 2 s" in node.log()
    with EtcdClient(default_etcd.client_settings()) as client:
        registry = Registry(client, run_id)
        member = json.loads(client.get(registry.keys.member("crasher")).value)
        assert member["state"] == "failed", member
        assert client.get(registry.keys.finished) is None


def test_importing_the_rendezvous_module_first_registers_etcd3(default_etcd, run_id):
    # `import elasticctl.rendezvous.backend` used to meet itself half-initialised; etcd3 stayed
    # unregistered.
    code = (
        "import elasticctl.rendezvous.backend\n"
        "from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry\n"
        f"params = RendezvousParameters('etcd3', '{default_etcd.endpoint}', '{run_id}', 1, 1)\n"
        "handler = rendezvous_handler_registry.create_handler(params)\n"
        "print(handler.get_backend())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "etcd3"
    assert "circular import" not in result.stderr


@pytest.mark.parametrize("conf", ["node_ttl=abc", "read_timeout=-3", "protocol=ftp", "join_timout=5"])
def test_bad_rdzv_conf_is_refused_before_anything_is_published_or_launched(default_etcd, run_id, conf):
    # `up --rdzv-conf node_ttl=abc` used to launch torchrun, which printed a traceback.
    result = subprocess.run([*ELASTICCTL, "up", "--etcd", default_etcd.endpoint, "--job", run_id, "--nnodes", "1",
                             "--rdzv-conf", conf, DOWN_THEN_DIE], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert conf.split("=")[0] in lines[0]
    with EtcdClient(default_etcd.client_settings()) as client:
        assert client.get_prefix(Registry(client, run_id).keys.everything) == []
