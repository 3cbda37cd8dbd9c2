"""Stragglers in real jobs: `elasticctl up` nodes in hot mode, one slowed by the trainer's
``--slow-node`` knob; named (event, metric, dashboard, `elasticctl events`) and, with
``--evict-stragglers``, asked to leave while the others go on in their own processes. A node
slow for fewer than the window's steps is never named. Every wait is on the job's records or
events, never a sleep; the jobs run far more steps than the tests need and end with them.
"""

from __future__ import annotations

import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support.helpers import MLP, cli, wait_for
from support.jobs import Job, after, steps_at

from elasticctl.dashboard.model import Reading, job_view
from elasticctl.dashboard.server import Dashboard as DashboardApp
from elasticctl.job.events import EventLog, render_line
from elasticctl.job.records import EventKind
from elasticctl.job.snapshot import Part

WINDOW, INTERVAL = 20, 5
SLOW = 0.2  # seconds a slowed node sleeps in a step, on top of everyone's --step-sleep 0.05


def straggler_job(nodes, etcd, run_id, tmp_path, *slowed: str, evict: str | None = None,
                  recovery: str = "hot") -> Job:
    train = [MLP, "--steps", "100000", "--step-sleep", "0.05", "--log-every", "0", "--checkpoint-every", "20",
             *(arg for node in slowed for arg in ("--slow-node", node))]
    extra = ["--recovery", recovery, "--checkpoint-dir", str(tmp_path / "checkpoints"),
             "--straggler-window", str(WINDOW), "--straggler-interval", str(INTERVAL),
             *(["--evict-stragglers", evict] if evict else [])]
    return Job(nodes, etcd, run_id, tmp_path, nnodes="2:3", extra=extra, train=train)


def events_of(job: Job, kind: EventKind, node: str | None = None) -> list:
    return [e for e in EventLog(job.client, job.registry.keys).read()
            if e.kind is kind and (node is None or e.node == node)]


def history(job: Job) -> str:
    return "\n".join(render_line(e) for e in EventLog(job.client, job.registry.keys).read())


def metric_samples(job: Job, name: str) -> dict:
    app = DashboardApp(job.client, job.registry.keys)
    families = text_string_to_metric_families(generate_latest(app.registry).decode())
    return {tuple(sorted(s.labels.items())): s.value for f in families for s in f.samples if s.name == name}


def first_step_at_world(job: Job, world: int) -> float:
    return min(r["time"] for r in steps_at(job.records(), world))


def test_a_slow_node_is_named_with_an_event_a_metric_and_a_dashboard_mark(nodes, default_etcd, run_id, tmp_path):
    job = straggler_job(nodes, default_etcd, run_id, tmp_path, f"c={SLOW}")
    job.start("a", "b", "c")
    started = first_step_at_world(job, 3)
    named = wait_for(lambda: events_of(job, EventKind.STRAGGLER, "c"), 120, "c named a straggler")[0]
    print(f"named {named.time - started:.2f} s after the first step at world 3 "
          f"(step {named.step}, ratio {named.ratio})")
    assert named.ratio > 1.5 and named.step >= WINDOW, render_line(named)
    assert events_of(job, EventKind.STRAGGLER, "a") == events_of(job, EventKind.STRAGGLER, "b") == [], history(job)

    ratios = wait_for(lambda: metric_samples(job, "elasticctl_straggler_ratio") or None, 30, "the ratio metric")
    assert list(ratios) == [(("elastic_job", run_id), ("node", "c"))] and ratios[next(iter(ratios))] > 1.5
    assert metric_samples(job, "elasticctl_straggler_events_total") == {(("elastic_job", run_id),): 1.0}
    snapshot = job.registry.snapshot(Part.DASHBOARD)
    rows = {row["id"]: row for row in job_view(Reading.of(snapshot, now=time.time()))["nodes"]}
    assert rows["c"]["straggler"] > 1.5 and rows["a"]["straggler"] is rows["b"]["straggler"] is None
    listed = cli("events", "--etcd", default_etcd.endpoint, "--job", run_id)
    assert any(" straggler " in line and " c " in line and "x the others' step time" in line
               for line in listed.stdout.splitlines()), listed.stdout
    # Naming is all it does without --evict-stragglers: c trains on
    since = named.time
    job.wait_world(3, {"a", "b", "c"}, since=since + 1.0)


def rate(records: list[dict], first: int, last: int) -> float:
    """Steps per second between two steps (one rank's lines: rank 0's)."""
    times = {r["step"]: r["time"] for r in records if "event" not in r and r["rank"] == 0 and first <= r["step"] <= last}
    return (last - first) / (times[last] - times[first])


@pytest.mark.parametrize("recovery", ["hot", "restart"])
def test_a_straggler_is_evicted_and_the_others_go_on_but_a_short_slowdown_is_not(
        nodes, default_etcd, run_id, tmp_path, recovery):
    # b is slow for WINDOW - 1 steps at the start, c from step 60 on
    job = straggler_job(nodes, default_etcd, run_id, tmp_path, f"b={SLOW}@5:{5 + WINDOW - 1}", f"c={SLOW}@60:100000",
                        evict="3", recovery=recovery)
    started = job.start("a", "b", "c")
    full = steps_at(job.records(), 3)
    pids = {r["node"]: r["pid"] for r in full}
    asked = wait_for(lambda: [e for e in events_of(job, EventKind.STRAGGLER, "c") if "evicted" in e.reason] or None,
                     180, "c evicted")[0]
    slowed_at = min(r["time"] for r in job.records() if r.get("node") == "c" and r.get("step") == 60)
    print(f"c evicted {asked.time - slowed_at:.2f} s after its first slow step (step {asked.step}, "
          f"ratio {asked.ratio})")
    assert asked.ratio > 3 and asked.step >= 60 + WINDOW, render_line(asked)
    assert started["c"].wait(60) == 0, started["c"].log()
    shrunk = job.wait_world(2, {"a", "b"}, since=asked.time)
    first = min(r["time"] for r in shrunk)
    print(f"{recovery}: first step at world 2 {first - asked.time:.2f} s after the eviction was decided")
    if recovery == "hot":
        assert {r["node"]: r["pid"] for r in shrunk} == {n: pids[n] for n in ("a", "b")}, "a survivor restarted"
    left = events_of(job, EventKind.LEAVE_REQUESTED, "c")
    assert left, history(job)
    # b, slow for fewer than WINDOW steps, was never named, let alone evicted
    assert events_of(job, EventKind.STRAGGLER, "b") == [], history(job)
    assert not any(e.node == "b" for e in events_of(job, EventKind.LEAVE_REQUESTED)), history(job)
    assert {r["node"] for r in after(job.records(), first + 1.0) if "event" not in r} <= {"a", "b"}
    resumed = min(r["step"] for r in shrunk)
    job.wait_world(2, {"a", "b"}, since=first + 1.0)
    wait_for(lambda: max(r["step"] for r in steps_at(job.records(), 2)) >= resumed + 40, 60, "40 steps at world 2")
    records = job.records()
    healthy, slowed = rate(steps_at(records, 3), 30, 55), rate(steps_at(records, 3), 65, 80)
    evicted = rate(steps_at(records, 2), resumed + 10, resumed + 40)
    print(f"{recovery}: steps/s healthy {healthy:.1f}, with the straggler {slowed:.1f}, after its eviction "
          f"{evicted:.1f} ({evicted / healthy:.2f}x healthy)")

