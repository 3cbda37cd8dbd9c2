"""Hot spares: a node beyond --nnodes MAX starts its workers and waits warm,
trains nothing and forces no re-formation; when a member is lost it takes the place at the
survivors' own re-formation (the world never stays short); a spare that dies is just gone.
Real `elasticctl up`/`join` processes on a real etcd; every wait is on a record or a key."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.dashboard import Dashboard
from support.helpers import WORKERS, wait_for
from support.jobs import Job, after, steps_at

from elasticctl.job.keys import JobKeys
from elasticctl.job.records import Round

pytestmark = pytest.mark.slow
HOT = str(WORKERS / "hot.py")


def generation(job: Job) -> Round:
    record = json.loads(job.client.get(JobKeys(job.name).generations().rdzv_round).value)
    return Round(number=record["round"], members=tuple(record["members"]))


def declared_pid(job: Job, worker: str) -> int | None:
    """The pid in ``worker``'s generation declaration: it started and waits in the rendezvous."""
    kv = job.client.get(JobKeys(job.name).generations().rdzv_node(worker))
    return None if kv is None else json.loads(kv.value)["pid"]


def dashboard_spares(dashboard: Dashboard) -> tuple[dict, dict, dict]:
    """What `elasticctl dashboard` shows of the spares: the page JSON's count, each node's state,
    and the /metrics samples of the spare families (by name and state label)."""
    view = json.loads(dashboard.get("api/job"))
    metrics = {(s.name, s.labels.get("state")): s.value
               for f in text_string_to_metric_families(dashboard.get("metrics").decode()) for s in f.samples
               if s.name in ("elasticctl_spares", "elasticctl_spares_expected", "elasticctl_nodes")}
    return view["spares"], {n["id"]: n["state"] for n in view["nodes"]}, metrics


def test_a_spare_waits_warm_and_takes_a_lost_nodes_place_in_the_same_reformation(nodes, default_etcd, run_id,
                                                                                   tmp_path):
    job = Job(nodes, default_etcd, run_id, tmp_path, nnodes="1:3",
              extra=["--recovery", "hot", "--node-ttl", "3", "--spares", "1"], train=[HOT])
    started = job.start("a", "b", "c")
    full = generation(job)
    assert full.world_size == 3

    started["d"] = job.join("d")
    spare_pid = wait_for(lambda: declared_pid(job, "d.0"), 120, "d's worker waiting in the rendezvous")
    status = wait_for(lambda: (s := job.status())["spares"] == ["d"] and s, 60, "status naming d a spare")
    assert {n["id"]: n["rendezvous"] for n in status["nodes"]}["d"] == "spare", status
    assert status["spares_expected"] == 1 and status["world_size"] == 3, status
    dashboard = Dashboard(default_etcd.endpoint, "--job", job.name)
    try:  # the dashboard counts the same spare: its page and /metrics
        spares, states, metrics = dashboard_spares(dashboard)
        assert spares == {"waiting": ["d"], "expected": 1, "short": 0}, spares
        assert states["d"] == "spare" and "spare" not in (states["a"], states["b"], states["c"]), states
        assert metrics[("elasticctl_spares", None)] == 1 and metrics[("elasticctl_spares_expected", None)] == 1
        assert metrics[("elasticctl_nodes", "spare")] == 1, metrics
    finally:
        assert dashboard.stop() == 0
    # Warm and idle: a spare forces no re-formation and trains no step while the world is full.
    since = max(r["time"] for r in job.records())
    wait_for(lambda: len(steps_at(after(job.records(), since), 3)) >= 30 or None, 120, "30 more steps at world 3")
    assert generation(job).number == full.number, "a spare forced a re-formation"
    assert not [r for r in job.records() if r.get("node") == "d" and "event" not in r], "a spare trained"

    killed_at = max(r["time"] for r in job.records())
    started["c"].kill()
    back = job.wait_world(3, {"a", "b", "d"}, since=killed_at)
    # (a and b may log a step or two of the old generation before they notice the kill)
    assert min(r["generation"] for r in back if r["node"] == "d") == full.number + 1, \
        "the spare was not admitted at the survivors' re-formation"
    assert not [r for r in after(job.records(), killed_at) if "event" not in r and r["world_size"] == 2], \
        "the world stayed short"
    assert {r["pid"] for r in back if r["node"] == "d"} == {spare_pid}, "the spare's worker was started again"
    assert min(r["step"] for r in back if r["node"] == "d") > 0, "the spare did not get the state"

    # A spare that dies is just gone: e waits, is killed, and the world of three never re-forms.
    started["e"] = job.join("e")
    wait_for(lambda: declared_pid(job, "e.0"), 120, "e's worker waiting in the rendezvous")
    at = generation(job).number
    started["e"].kill()
    wait_for(lambda: declared_pid(job, "e.0") is None or None, 60, "e's declaration gone with its lease")
    since = max(r["time"] for r in job.records())
    wait_for(lambda: len(steps_at(after(job.records(), since), 3)) >= 30 or None, 120, "30 more steps at world 3")
    assert generation(job).number == at, "a dead spare forced a re-formation"
