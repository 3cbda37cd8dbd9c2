"""`elasticctl dashboard`: the pure model (table-driven, planted records mixed in), the server's
JSON and /metrics against a real etcd, and its one-sentence errors. The live page in a real
browser during a real job: tests/test_dashboard_browser.py.

Layer tests/process: real processes (elasticctl, torchrun, workers, tools). The other tests of this
subject: tests/unit/test_dashboard.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.error
import urllib.request

import pytest
from support.dashboard import MEMBER, NODE, NOW, Dashboard, sample
from support.helpers import cli, wait_for
from prometheus_client.parser import text_string_to_metric_families

from elasticctl.etcd.client import EtcdClient
from elasticctl.job.events import EventLog
from elasticctl.job.keys import JobKeys
from elasticctl.job.records import EventKind, ProgressSample, record_json
from elasticctl.job.spec import JobSpec


# -- the server against a real etcd -----------------------------------------------------------


@pytest.fixture
def planted(default_etcd, run_id):
    client = EtcdClient(default_etcd.client_settings())
    keys = JobKeys(run_id)
    lease = client.grant_lease(30)
    client.put(keys.node("a"), NODE, lease=lease)
    client.put(keys.node("b"), b"\xff planted")
    client.put(keys.member("a"), MEMBER)
    spec = JobSpec(run_id, "train.py", min_nodes=1, max_nodes=3, max_restarts=4)
    client.put(keys.spec, record_json(spec.to_dict()))
    client.put(keys.progress, b'{"step": 50, "last_checkpoint_step": 40, "time": 1}')
    log = EventLog(client, keys)
    log.record(EventKind.ROUND_FORMED, "a", round=3, members=("a",), world_size=1)
    log.record(EventKind.RECOVERY_FINISHED, "a", round=3, duration=2.0)
    log.record(EventKind.CHECKPOINT_WRITTEN, "a", at=NOW - 30, step=40, duration=0.5)
    client.put(keys.event(NOW, "x", "bogus"), b'{"time": "garbage"}')
    client.put(keys.progress_sample(NOW - 4), sample(4, 10))
    client.put(keys.progress_sample(NOW - 2), sample(2, 30))
    client.put(keys.progress_sample(NOW - 1), b"NaN")
    dashboard = Dashboard(default_etcd.endpoint, "--job", run_id)
    yield dashboard, keys
    assert dashboard.stop() == 0
    client.revoke_lease(lease)
    client.close()


def test_the_page_json_and_metrics_come_from_etcd(planted):
    dashboard, keys = planted
    view = json.loads(dashboard.get("api/job"))
    assert view["job"] == keys.job and view["world_size"] == 1 and view["round"] == 3
    assert [n["id"] for n in view["nodes"]] == ["a"]
    assert 0 <= view["nodes"][0]["heartbeat_age"] <= 30, "from the node record's lease"
    assert [e["kind"] for e in view["events"]] == [
        "recovery_finished",
        "round_formed",
        "checkpoint_written",
    ]
    assert view["checkpoint"]["step"] == 40 and view["checkpoint"]["age"] >= 30
    assert view["samples"]["steps_per_s"] == [None, 10.0]

    page = dashboard.get("").decode()
    assert (
        'id="world-chart"' in page and "static/dashboard.js" in page and "://" not in page
    )  # no CDN
    assert b"uPlot" in dashboard.get("static/uPlot.iife.min.js")
    with pytest.raises(urllib.error.HTTPError):
        dashboard.get("static/../server.py")

    families = {
        f.name: f for f in text_string_to_metric_families(dashboard.get("metrics").decode())
    }
    value = {f.name: f.samples[0].value for f in families.values() if f.samples}
    assert value["elasticctl_world_size"] == 1 and value["elasticctl_round"] == 3
    assert (value["elasticctl_nnodes_min"], value["elasticctl_nnodes_max"]) == (1, 3)
    assert value["elasticctl_restart_budget"] == 4
    assert [(s.labels["node"], s.value) for s in families["elasticctl_node_restarts_spent"].samples] == [
        ("a", 1)
    ]
    assert value["elasticctl_dashboard_etcd_up"] == 1
    assert families["elasticctl_restarts_spent"].type == "counter"
    assert families["elasticctl_nodes"].samples[0].labels == {
        "elastic_job": keys.job,
        "state": "training",
    }
    recovery = {
        s.name: s for s in families["elasticctl_recovery_seconds"].samples if "le" not in s.labels
    }
    assert recovery["elasticctl_recovery_seconds_count"].value == 1
    assert recovery["elasticctl_recovery_seconds_sum"].value == 2.0
    assert (
        value["elasticctl_steps_per_second"] == 10.0
        and value["elasticctl_steps_since_checkpoint"] == 10
    )
    assert value["elasticctl_last_checkpoint_age_seconds"] >= 30
    assert value["elasticctl_checkpoint_write_seconds"] == 0.5
    assert families["elasticctl_checkpoint_write_seconds"].type == "gauge"
    latency = families["elasticctl_dashboard_etcd_request_duration_seconds"]
    assert latency.type == "histogram" and {s.labels.get("request") for s in latency.samples} >= {
        "range",
        "lease",
    }
    assert all(
        s.labels.get("elastic_job", keys.job) == keys.job and "job" not in s.labels
        for f in families.values()
        for s in f.samples
    )


# -- one-sentence errors ----------------------------------------------------------------------


def _one_sentence(result: subprocess.CompletedProcess, *named: str) -> None:
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    for text in named:
        assert text in result.stderr, result.stderr


@pytest.mark.parametrize(
    "listen",
    [
        "nohost",
        "127.0.0.1:http",
        "127.0.0.1:70000",
        "example.org:80",
        ":80",
        "127.0.0.1:",
        "[::1:80",
    ],
)
def test_a_bad_listen_is_one_sentence(listen):
    # checked before etcd: no etcd is needed to be told
    _one_sentence(cli("dashboard", "--etcd", "127.0.0.1:1", "--listen", listen), f"'{listen}'")


def test_a_taken_port_is_one_sentence(default_etcd, run_id):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        EtcdClient(default_etcd.client_settings()).put(JobKeys(run_id).spec, "{}")
        result = cli(
            "dashboard",
            "--etcd",
            default_etcd.endpoint,
            "--job",
            run_id,
            "--listen",
            f"127.0.0.1:{port}",
        )
    _one_sentence(result, f"127.0.0.1:{port}", "taken")


def test_an_address_not_on_this_host_is_one_sentence(default_etcd, run_id):
    EtcdClient(default_etcd.client_settings()).put(JobKeys(run_id).spec, "{}")
    result = cli(
        "dashboard", "--etcd", default_etcd.endpoint, "--job", run_id, "--listen", "192.0.2.1:8080"
    )
    _one_sentence(result, "192.0.2.1:8080")


def test_an_unknown_job_is_one_sentence(default_etcd):
    _one_sentence(
        cli("dashboard", "--etcd", default_etcd.endpoint, "--job", "no-such-job"), "'no-such-job'"
    )
    _one_sentence(cli("dashboard", "--etcd", default_etcd.endpoint, "--job", "a/b"), "'a/b'")


def test_a_job_that_is_down_is_shown_from_its_history(default_etcd, run_id):
    client = EtcdClient(default_etcd.client_settings())
    EventLog(client, JobKeys(run_id)).record(EventKind.JOB_DOWN, reason="by the test")
    dashboard = Dashboard(default_etcd.endpoint, "--job", run_id)
    try:
        view = wait_for(lambda: json.loads(dashboard.get("api/job")), 10, "the job's JSON")
        assert [e["kind"] for e in view["events"]] == ["job_down"] and view["nodes"] == []
    finally:
        assert dashboard.stop() == 0
        client.close()


def test_planted_records_in_etcd_change_neither_live_nodes_nor_the_time_axis(default_etcd, run_id):
    from werkzeug.test import Client

    from elasticctl.dashboard.server import Dashboard
    from elasticctl.job.registry import Registry

    keys = JobKeys(run_id)
    with EtcdClient(default_etcd.client_settings()) as client:
        lease = client.grant_lease(30)
        try:
            Registry(client, run_id).register_node(
                {"host": "h1", "addr": "127.0.0.1", "pid": 1, "state": "running", "joined_at": NOW}, lease,
                wanted_id="real")
            EventLog(client, keys).record(EventKind.NODE_JOINED, "real")
            now = wait_for(lambda: [e.time for e in EventLog(client, keys).read()], 10, "the event")[0]
            client.put(keys.progress_sample(now + 1), ProgressSample(time=now + 1, step=1).to_json())
            # Planted: a node record without a lease, a sample from 1970.
            client.put(keys.node("ghost"), NODE.replace(b'"a"', b'"ghost"'))
            client.put(keys.progress_sample(1.0), ProgressSample(time=1.0, step=0).to_json())
            view = json.loads(Client(Dashboard(client, keys)).get("/api/job").get_data(as_text=True))
            assert [n["id"] for n in view["nodes"]] == ["real"] and view["live_nodes"] == 1
            assert view["samples"]["time"] == [now + 1]
        finally:
            client.revoke_lease(lease)
            client.delete_prefix(keys.everything)


def test_a_malformed_spec_blanks_only_the_metrics_that_come_from_it(default_etcd, run_id):
    from werkzeug.test import Client

    from elasticctl.dashboard.server import Dashboard

    keys = JobKeys(run_id)
    with EtcdClient(default_etcd.client_settings()) as client:
        try:
            client.put(keys.spec, b'{"name": 5}')
            client.put(keys.member("a"), MEMBER)
            text = Client(Dashboard(client, keys)).get("/metrics").get_data(as_text=True)
            value = {f.name: f.samples[0].value for f in text_string_to_metric_families(text) if f.samples}
            assert value["elasticctl_dashboard_etcd_up"] == 1 and value["elasticctl_world_size"] == 1
            assert not {"elasticctl_nnodes_max", "elasticctl_restart_budget"} & set(value)
        finally:
            client.delete_prefix(keys.everything)


# -- one dashboard, every job ----------------------------------------------------------------------


def _metric(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _fetch(dashboard: Dashboard, path: str) -> tuple[int, dict]:
    try:
        return 200, json.loads(dashboard.get(path))
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


@pytest.fixture
def two_jobs(default_etcd, run_id):
    """Two jobs under a key prefix of their own: one running (a spec, a node), one down (its
    history alone)."""
    prefix = f"/t-{run_id}"
    client = EtcdClient(default_etcd.client_settings())
    running, down = JobKeys(f"{run_id}-a", prefix), JobKeys(f"{run_id}-b", prefix)
    lease = client.grant_lease(30)
    client.put(running.spec, record_json(JobSpec(running.job, "train.py", min_nodes=1, max_nodes=2).to_dict()))
    client.put(running.node("a"), NODE, lease=lease)
    client.put(running.member("a"), MEMBER)
    EventLog(client, running).record(EventKind.MEMBER_LOST, "c", round=2)
    EventLog(client, down).record(EventKind.JOB_DOWN, reason="by the test")
    yield prefix, running.job, down.job
    client.revoke_lease(lease)
    client.delete_prefix(prefix + "/")
    client.close()


def test_one_dashboard_serves_every_job_and_the_page_picks_one(default_etcd, two_jobs):
    prefix, running, down = two_jobs
    dashboard = Dashboard(default_etcd.endpoint, "--key-prefix", prefix)
    try:
        samples = _metric(dashboard.get("metrics").decode())
        for job in (running, down):
            assert samples[("elasticctl_dashboard_etcd_up", (("elastic_job", job),))] == 1
        assert samples[("elasticctl_world_size", (("elastic_job", running),))] == 1
        assert samples[("elasticctl_events_total", (("elastic_job", running), ("kind", "member_lost")))] == 1
        assert samples[("elasticctl_events_total", (("elastic_job", down), ("kind", "job_down")))] == 1
        assert all(dict(labels).get("elastic_job") in (running, down)
                   for name, labels in samples if name.startswith("elasticctl_")
                   and not name.startswith(("elasticctl_build_info", "elasticctl_dashboard_etcd_request")))

        assert _fetch(dashboard, "api/jobs") == (200, {"jobs": [running, down]})
        status, body = _fetch(dashboard, "api/job")  # two jobs: the page asks which
        assert status == 404 and body["jobs"] == [running, down] and "pick one" in body["error"]
        status, body = _fetch(dashboard, f"api/job?job={down}")
        assert status == 200 and body["job"] == down and [e["kind"] for e in body["events"]] == ["job_down"]
        status, body = _fetch(dashboard, "api/job?job=nope")
        assert status == 404 and "'nope'" in body["error"]
    finally:
        assert dashboard.stop() == 0


def test_job_narrows_a_dashboard_to_one_job(default_etcd, two_jobs):
    prefix, running, down = two_jobs
    dashboard = Dashboard(default_etcd.endpoint, "--key-prefix", prefix, "--job", running)
    try:
        samples = _metric(dashboard.get("metrics").decode())
        assert {dict(labels)["elastic_job"] for name, labels in samples
                if name == "elasticctl_dashboard_etcd_up"} == {running}
        assert _fetch(dashboard, "api/job")[1]["job"] == running  # its only job: no choice to make
        status, body = _fetch(dashboard, f"api/job?job={down}")
        assert status == 404 and body["jobs"] == [running]
    finally:
        assert dashboard.stop() == 0
