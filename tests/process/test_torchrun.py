"""Plain ``torchrun --rdzv-backend=etcd3``: real agents and CPU/gloo workers on loopback."""

from __future__ import annotations

import time

import pytest
from support.helpers import read_records, torchrun_command, wait_for

from elasticctl.embedded_etcd import free_port

pytestmark = pytest.mark.slow


def _steps_at(records: list[dict], world: int, group_rank: int | None = None) -> list[dict]:
    return [r for r in records if r.get("world_size") == world and "event" not in r
            and (group_rank is None or r.get("group_rank") == group_rank)]


def test_two_nodes_form_a_world_and_train(default_etcd, run_id, nodes, tmp_path):
    record = tmp_path / "record.jsonl"
    args = ["--steps", "15", "--record", str(record)]
    a = nodes("a", torchrun_command(default_etcd.endpoint, run_id, "2", args))
    b = nodes("b", torchrun_command(default_etcd.endpoint, run_id, "2", args))
    assert a.wait(120) == 0, a.log()
    assert b.wait(60) == 0, b.log()
    records = read_records(record)
    assert {r["group_rank"] for r in _steps_at(records, 2)} == {0, 1}
    assert len(_steps_at(records, 2)) == 30
    assert sum(1 for r in records if r.get("event") == "done") == 2


def test_scale_up_where_the_joiner_takes_rank_1(default_etcd, run_id, nodes, tmp_path):
    # Regression: torch's shared agent TCPStore deadlocks this scale-up; the etcd3 backend must not.
    record = tmp_path / "record.jsonl"
    args = ["--steps", "100000", "--step-sleep", "0.05", "--record", str(record)]
    nodes("first", torchrun_command(default_etcd.endpoint, run_id, "1:2", args))
    wait_for(lambda: _steps_at(read_records(record), 1), 120, "training at world size 1")
    joined_at = time.time()
    nodes("joiner", torchrun_command(default_etcd.endpoint, run_id, "1:2", args))
    grown = wait_for(lambda: _steps_at(read_records(record), 2, group_rank=1), 90,
                     "the joiner training as group rank 1 at world size 2")
    assert grown[0]["time"] > joined_at
    assert _steps_at(read_records(record), 2, group_rank=0)


def test_survivor_reforms_after_sigkill_of_a_node(default_etcd, run_id, nodes, tmp_path):
    record = tmp_path / "record.jsonl"
    args = ["--steps", "100000", "--step-sleep", "0.05", "--record", str(record)]
    survivor = nodes("survivor", torchrun_command(default_etcd.endpoint, run_id, "1:2", args))
    victim = nodes("victim", torchrun_command(default_etcd.endpoint, run_id, "1:2", args))
    wait_for(lambda: _steps_at(read_records(record), 2), 120, "training at world size 2")
    victim.kill()
    killed_at = time.time()
    wait_for(lambda: [r for r in _steps_at(read_records(record), 1) if r["time"] > killed_at and r["step"] >= 5],
             120, "the survivor training alone after the kill")
    assert survivor.process.poll() is None


def test_unreachable_etcd_at_start_fails_fast_with_a_clear_error(run_id, nodes, tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    node = nodes("lonely", torchrun_command(endpoint, run_id, "1", ["--steps", "1"],
                                            rdzv_conf="connect_timeout=2"))
    assert node.wait(90) != 0
    assert f"cannot reach etcd at {endpoint}" in node.log()


def test_two_etcd_endpoints_one_of_them_dead(default_etcd, run_id, nodes, tmp_path):
    record = tmp_path / "record.jsonl"
    endpoints = f"127.0.0.1:{free_port()},{default_etcd.endpoint}"
    node = nodes("a", torchrun_command(endpoints, run_id, "1", ["--steps", "3", "--record", str(record)]))
    assert node.wait(120) == 0, node.log()
    assert len(_steps_at(read_records(record), 1)) == 3


# -- the sentence a user needs comes alone, without torch's traceback -----------------------------

def test_a_bad_rdzv_conf_is_one_line(default_etcd, run_id, nodes, tmp_path):
    node = nodes("bad", torchrun_command(default_etcd.endpoint, run_id, "1", ["--steps", "1"],
                                         rdzv_conf="recovery=bogus"))
    assert node.wait(60) == 2, node.log()
    lines = node.log().strip().splitlines()  # old: a 35-line traceback ending in the sentence
    assert lines == ["torchrun: error: The rendezvous option recovery ('bogus') must be one of: restart, hot."], lines


def test_unreachable_etcd_is_one_line(run_id, nodes, tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    node = nodes("lonely", torchrun_command(endpoint, run_id, "1", ["--steps", "1"], rdzv_conf="connect_timeout=2"))
    assert node.wait(90) == 1
    assert "Traceback" not in node.log(), node.log()
    assert node.log().strip().splitlines()[-1].startswith("torchrun: error: "), node.log()


def test_a_hot_script_that_raises_at_import_ends_with_the_stop_sentence_alone(default_etcd, run_id, nodes, tmp_path):
    script = tmp_path / "broken.py"
    script.write_text('raise RuntimeError("broken at import")\n')
    # torch's own budget unlimited (as elasticctl runs it): the handler's is the one spent.
    command = [*torchrun_command(default_etcd.endpoint, run_id, "1", [], max_restarts=1000,
                                 rdzv_conf="recovery=hot,max_restarts=1,quarantine_after=9")[:-1], str(script)]
    node = nodes("broken", command)
    assert node.wait(120) == 1, node.log()
    log = node.log()
    # The workers' own tracebacks stay (they say what broke); the agent's RendezvousError
    # traceback (about 50 lines, old code) is gone, its sentence is the last line.
    assert "RendezvousError" not in log and "ChildFailedError" not in log, log
    assert log.count("Traceback") == log.count("RuntimeError: broken at import"), log
    last = log.strip().splitlines()[-1]
    assert "The node 'broken' stops: its workers failed 2 times" in last and "restarts allowed" in last, log
