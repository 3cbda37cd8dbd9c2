"""Issue 10's correctness odds and ends, each reproduced with real processes and a real etcd."""

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
    # Item 13: the node must look for a request once more after torchrun exits.
    node = nodes("a", [*ELASTICCTL, "up", "--etcd", default_etcd.endpoint, "--job", run_id,
                       "--nnodes", "1", "--node-id", "a", DOWN_THEN_DIE])
    assert node.wait(120) == 0, node.log()
    assert "stopped (job down)" in node.log()


@pytest.mark.slow
def test_a_crashed_agent_is_recorded_as_failed_not_done(default_etcd, run_id, nodes):
    # Item 14: an agent that crashed (here: no second node within the join timeout) read as a
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
    # Item 15: `import elasticctl.rendezvous.backend` met itself half-initialised; etcd3 stayed unregistered.
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
    # Item 16: torch's backend tests expect ValueError for an invalid protocol or read_timeout.
    from torch.distributed.elastic.rendezvous import (
        RendezvousParameters,
        rendezvous_handler_registry,
    )

    params = RendezvousParameters("etcd3", default_etcd.endpoint, run_id, 1, 1, **conf)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        rendezvous_handler_registry.create_handler(params)


@pytest.mark.parametrize("run", ["jv/x", "jv/nodes", "abc\n"])
def test_run_ids_that_could_reach_another_jobs_keys_are_refused(default_etcd, run):
    # Item 5: --rdzv-id=jv/x landed inside job jv's prefix; `down --job jv` then deleted its keys.
    from torch.distributed.elastic.rendezvous import (
        RendezvousParameters,
        rendezvous_handler_registry,
    )

    params = RendezvousParameters("etcd3", default_etcd.endpoint, run, 1, 1)
    with pytest.raises(ValueError, match="run id"):
        rendezvous_handler_registry.create_handler(params)
    with EtcdClient(default_etcd.client_settings()) as client:
        assert not [kv for kv in client.get_prefix("/elasticctl/jobs/jv") if b"/jv/" in kv.key]


@pytest.mark.parametrize("conf", ["node_ttl=abc", "read_timeout=-3", "protocol=ftp", "join_timout=5"])
def test_bad_rdzv_conf_is_refused_before_anything_is_published_or_launched(default_etcd, run_id, conf):
    # Item 11: `up --rdzv-conf node_ttl=abc` launched torchrun, which printed a traceback.
    result = subprocess.run([*ELASTICCTL, "up", "--etcd", default_etcd.endpoint, "--job", run_id, "--nnodes", "1",
                             "--rdzv-conf", conf, DOWN_THEN_DIE], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert conf.split("=")[0] in lines[0]
    with EtcdClient(default_etcd.client_settings()) as client:
        assert client.get_prefix(Registry(client, run_id).keys.everything) == []
