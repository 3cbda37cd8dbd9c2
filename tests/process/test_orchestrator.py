"""The orchestrator end to end: real elasticctl processes, real torchrun, a real etcd, loopback.

Every wait is on the trainer's JSON record or on etcd keys, never a sleep.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

from support.helpers import ELASTICCTL, MLP, cli, read_records, wait_for
from support.jobs import ALLREDUCE, Job

from elasticctl.etcd.client import EtcdClient
from elasticctl.job.registry import Registry


def test_up_join_status_leave_join_down(job):
    j = job()
    a = j.up("a")
    wait_for(j.registry.read_spec, 60, "the job spec in etcd")
    b, c = j.join("b"), j.join("c")
    j.wait_world(3, {"a", "b", "c"})

    status = j.status()
    assert status["world_size"] == 3
    assert {n["id"] for n in status["nodes"]} == {"a", "b", "c"}
    assert {n["rendezvous"] for n in status["nodes"]} == {"training"}
    assert sorted(n["rank"] for n in status["nodes"]) == [0, 1, 2]
    assert status["spec"]["min_nodes"] == 1 and status["spec"]["max_nodes"] == 3
    # the trainer's rank 0 publishes its progress for `status`
    wait_for(lambda: (j.registry.progress() or {}).get("world_size") == 3, 60, "progress at world size 3")
    text = cli("status", "--etcd", j.etcd.endpoint, "--job", j.name)
    assert text.returncode == 0 and "world size 3" in text.stdout and "trainer   step" in text.stdout, text.stdout

    # leave: c exits 0, a and b continue at world 2 without spending a restart
    left_at = max(r["time"] for r in j.records())
    result = cli("leave", "--etcd", j.etcd.endpoint, "--job", j.name, "--node", "c")
    assert result.returncode == 0, result.stderr
    assert c.wait(60) == 0, c.log()
    smaller = j.wait_world(2, {"a", "b"}, since=left_at)
    assert {r["restart"] for r in smaller} == {0}

    # a later join grows the world again
    d = j.join("d")
    grown_at = max(r["time"] for r in j.records())
    grown = j.wait_world(3, {"a", "b", "d"}, since=grown_at)
    assert {r["restart"] for r in grown} == {0}

    # down: every node exits 0 and the job's keys are gone ...
    result = cli("down", "--etcd", j.etcd.endpoint, "--job", j.name)
    assert result.returncode == 0, result.stderr
    for node in (a, b, d):
        assert node.wait(60) == 0, node.log()
    # ... but the event history, which expires with its own lease
    left = [kv.key.decode() for kv in j.client.get_prefix(j.registry.keys.everything)]
    assert left and all(key.startswith(j.registry.keys.history) for key in left), left
    listed = cli("jobs", "--etcd", j.etcd.endpoint, "--json")
    assert j.name not in {entry["job"] for entry in json.loads(listed.stdout)}


def test_own_failure_counts_and_exhausted_node_stops_alone(job, tmp_path):
    # Node c's worker raises at step 5 every time: its own failure, not its peers'.
    j = job(extra=["--max-restarts", "1"], train=[ALLREDUCE, "--fail-node", "c", "--fail-at", "5"])
    c = j.start("a", "b", "c")["c"]
    assert c.wait(240) != 0
    assert "more than the 1 restarts allowed" in c.log() or "failed 2 times" in c.log(), c.log()
    recovered_at = max(r["time"] for r in j.records())
    survivors = j.wait_world(2, {"a", "b"}, since=recovered_at)
    assert {r["restart"] for r in survivors} == {0}, "collateral failures must not count"


def test_join_errors_are_one_sentence(default_etcd, run_id, tmp_path):
    missing = cli("join", "--etcd", default_etcd.endpoint, "--job", "no-such-job")
    assert missing.returncode != 0 and "The job 'no-such-job' does not exist" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1

    from elasticctl.embedded_etcd import free_port

    port = free_port()
    unreachable = cli("join", "--etcd", f"127.0.0.1:{port}", timeout=60)
    assert unreachable.returncode != 0 and f"127.0.0.1:{port}" in unreachable.stderr
    assert "Traceback" not in unreachable.stderr


def test_spec_conflict_and_missing_script_on_join(default_etcd, run_id, tmp_path):
    client = EtcdClient(default_etcd.client_settings())
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    registry = Registry(client, run_id)
    from elasticctl.etcd.lease import Lease
    from elasticctl.job.spec import JobSpec

    spec = JobSpec(name=run_id, script=str(script), min_nodes=1, max_nodes=2)
    registry.publish_spec(spec)
    lease = Lease(client, 5).start()
    try:
        registry.register_node({"host": "elsewhere"}, lease.id(), "other")  # a live node holds the job
        conflict = cli("up", "--dry-run", "--etcd", default_etcd.endpoint, "--job", run_id, "--nnodes", "1:4",
                       str(script))
        # --dry-run never writes; a real `up` must refuse the different spec
        assert conflict.returncode == 0
        real = cli("up", "--etcd", default_etcd.endpoint, "--job", run_id, "--nnodes", "1:4", str(script))
        assert real.returncode != 0
        assert f"The job '{run_id}' is already running with a different spec" in real.stderr
        assert "max_nodes 2 != 4" in real.stderr
        assert JobSpec.from_dict(json.loads(client.get(registry.keys.spec).value)) == spec

        script.unlink()
        gone = cli("join", "--etcd", default_etcd.endpoint, "--job", run_id)
        assert gone.returncode != 0 and f"'{script}' does not exist on this host" in gone.stderr
    finally:
        lease.stop(revoke=True)
        client.close()


def test_nproc_above_gpu_count_is_refused():
    result = subprocess.run([*ELASTICCTL, "up", "--dry-run", "--etcd", "127.0.0.1:2379", "--nnodes", "1",
                             "--nproc-per-node", "3", MLP], check=False, capture_output=True, text=True,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"})
    assert result.returncode != 0
    assert "processes per node (3) exceed the 2 GPUs" in result.stderr


def test_config_file_supplies_flags_and_flags_win(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text(
        "job: from-yaml\nnnodes: 2:4\netcd: 127.0.0.1:2379\nnproc-per-node: 1\n"
        f"script: {MLP}\nargs: [--steps, 9]\nenv: {{A: 1}}\n"
    )
    result = cli("up", "--config", str(config), "--dry-run", "--nnodes", "1:2")
    assert result.returncode == 0, result.stderr
    assert "--nnodes=1:2" in result.stdout and "--rdzv-id=from-yaml" in result.stdout
    assert result.stdout.rstrip().endswith("--steps 9")

    config.write_text("nnodes: 2\nbogus: 1\n")
    bad = cli("up", "--config", str(config), "--dry-run", MLP)
    assert bad.returncode != 0 and "unknown key 'bogus'" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_legacy_local_rank_script_runs_unchanged(default_etcd, run_id, tmp_path):
    script = tmp_path / "legacy.py"
    out = tmp_path / "out.txt"
    script.write_text(
        "import argparse, os\n"
        "p = argparse.ArgumentParser(); p.add_argument('--local_rank', type=int, required=True)\n"
        "p.add_argument('--out')\n"
        "a = p.parse_args()\n"
        "open(a.out, 'a').write(f\"{a.local_rank} {os.environ['LOCAL_RANK']}\\n\")\n"
    )
    result = cli("up", "--etcd", default_etcd.endpoint, "--job", run_id, "--nnodes", "1", "--nproc-per-node", "2",
                 "--legacy-local-rank", str(script), "--out", str(out), timeout=180)
    assert result.returncode == 0, result.stderr
    assert sorted(out.read_text().split("\n")[:-1]) == ["0 0", "1 1"]


def test_repeatedly_failing_node_is_quarantined_while_the_others_train(job):
    j = job(extra=["--max-restarts", "5", "--rdzv-conf", "quarantine_after=2,quarantine_seconds=30"],
            train=[ALLREDUCE, "--fail-node", "c", "--fail-at", "5"])
    j.start("a", "b", "c")
    member = wait_for(lambda: (j.registry.members().get("c") or {}).get("state") == "quarantined"
                      and j.registry.members()["c"], 180, "node c to be quarantined")
    assert member["restarts"] == 2
    status = {n["id"]: n for n in j.status()["nodes"]}
    assert status["c"]["rendezvous"] == "quarantined"
    quarantined_at = max(r["time"] for r in j.records())
    survivors = j.wait_world(2, {"a", "b"}, since=quarantined_at)
    assert {r["restart"] for r in survivors} == {0}


def test_etcd_blip_does_not_stop_training(nodes, run_id, tmp_path):
    from elasticctl.embedded_etcd import EmbeddedEtcd, free_port

    etcd = EmbeddedEtcd(data_dir=str(tmp_path / "etcd"), client_port=free_port(), peer_port=free_port())
    with etcd:
        j = Job(nodes, etcd, run_id, tmp_path, nnodes="2")
        try:
            a = j.up("a")
            wait_for(j.registry.read_spec, 60, "the job spec in etcd")
            b = j.join("b")
            j.wait_world(2, {"a", "b"})

            etcd.stop()
            stopped_at = time.time()
            # Training goes on without etcd for 4 s (a blip: shorter than the retry window).
            wait_for(lambda: max(r["time"] for r in j.records()) > stopped_at + 4, 60, "4 s of training without etcd")
            etcd.start()
            back_at = time.time()
            after_blip = j.wait_world(2, {"a", "b"}, since=back_at + 6)
            assert {r["restart"] for r in after_blip} == {0}
            assert a.process.poll() is None and b.process.poll() is None
            assert set(j.registry.live_nodes()) == {"a", "b"}
        finally:
            j.client.close()


def test_finished_job_runs_again_under_the_same_name(default_etcd, run_id, tmp_path):
    record = tmp_path / "record.jsonl"
    for attempt in (1, 2):
        result = cli("up", "--etcd", default_etcd.endpoint, "--job", run_id, "--nnodes", "1", MLP, "--steps", "3",
                     "--record", str(record), timeout=180)
        assert result.returncode == 0, result.stderr
        assert "training finished" in result.stderr
        done = [r for r in read_records(record) if r.get("event") == "done"]
        assert len(done) == attempt


def test_a_job_over_tls_with_client_certificates(tmp_path, run_id):
    from support.helpers import start_tls_etcd

    server, tls = start_tls_etcd(tmp_path)
    try:
        record = tmp_path / "record.jsonl"
        result = cli("up", "--etcd", server.endpoint, "--etcd-cacert", tls["cacert"], "--etcd-cert", tls["cert"],
                     "--etcd-key", tls["key"], "--job", run_id, "--nnodes", "1", MLP, "--steps", "5",
                     "--record", str(record), timeout=180)
        assert result.returncode == 0, result.stderr
        assert "protocol=https" in result.stderr  # torchrun's handler speaks TLS too
        assert [r["step"] for r in read_records(record) if "event" not in r] == [0, 1, 2, 3, 4]
        with EtcdClient(server.client_settings(**tls)) as client:
            assert Registry(client, run_id).progress() is not None  # the trainer published over TLS

        plain = cli("status", "--etcd", server.endpoint, "--job", run_id, timeout=60)
        assert plain.returncode != 0 and server.endpoint in plain.stderr
    finally:
        server.stop()
