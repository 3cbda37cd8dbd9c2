"""A job that runs for days. Nothing it needs may expire or vanish while it runs, and
a missing round or generation record while members live is never read as "no job yet".

Contract tests on a real etcd (the run lease, members writing their round back, a newcomer
that waits, forged and replayed records), then real `elasticctl up`/`join` jobs in restart
and hot mode with the run's ttl shortened to seconds: they run for 3 x ttl, then a join, a kill
and a leave complete, the round records are deleted in turn, and no second world ever trains.

Layer tests/process: real processes (elasticctl, torchrun, workers, tools). The other tests of this
subject: tests/contract/test_long_running.py.
"""

from __future__ import annotations

from support.helpers import wait_for


TTL = 3  # seconds: the run's keys of an abandoned run expire after this


# -- whole jobs, both modes --------------------------------------------------------------------

def groups_overlap(records: list[dict], group_of) -> list[str]:
    """Pairs of training groups whose rank-0 steps interleave in time: two worlds at once."""
    spans: dict[object, list[float]] = {}
    for r in records:
        if "event" in r or r.get("rank") != 0:
            continue
        span = spans.setdefault(group_of(r), [r["time"], r["time"]])
        span[0], span[1] = min(span[0], r["time"]), max(span[1], r["time"])
    ordered = sorted(spans.items(), key=lambda item: item[1][0])
    return [f"{k1} {s1} and {k2} {s2}" for (k1, s1), (k2, s2) in zip(ordered, ordered[1:]) if s2[0] < s1[1]]


def last_time(job) -> float:
    return max(r["time"] for r in job.records())


def test_restart_mode_after_three_ttls_absorbs_a_join_a_kill_a_leave_and_a_deleted_round(
        nodes, default_etcd, run_id, tmp_path):
    from test_orchestrator import Job, cli

    job = Job(nodes, default_etcd, run_id, tmp_path, extra=["--node-ttl", "3", "--rdzv-conf",
                                                            f"ttl={TTL},last_call_timeout=1"])
    a = job.up("a")
    first = job.wait_world(1, {"a"})[0]["time"]
    wait_for(lambda: last_time(job) > first + 3 * TTL, 120, "three ttl periods of training")
    round_key = job.registry.keys.rdzv_round
    assert job.client.get(round_key) is not None, "the round record expired while the job ran"

    b = job.join("b")
    job.wait_world(2, {"a", "b"}, since=first + 3 * TTL)
    killed_at = last_time(job)
    b.kill()
    job.wait_world(1, {"a"}, since=killed_at)

    c = job.join("c")
    job.wait_world(2, {"a", "c"}, since=last_time(job))
    assert cli("leave", "--etcd", default_etcd.endpoint, "--job", run_id, "--node", "c").returncode == 0
    assert c.wait(60) == 0, c.log()
    job.wait_world(1, {"a"}, since=last_time(job))

    # Deleted records while a member lives: written back; the next joiner is absorbed.
    for key in (round_key, job.registry.keys.run_lease):
        job.client.delete(key)
        wait_for(lambda key=key: job.client.get(key) is not None, 30, f"{key} written back")
    d = job.join("d")
    job.wait_world(2, {"a", "d"}, since=last_time(job))

    assert cli("down", "--etcd", default_etcd.endpoint, "--job", run_id).returncode == 0
    for node in (a, d):
        assert node.wait(60) == 0, node.log()
    assert not groups_overlap(job.records(), lambda r: (r["node"], r["restart"]))


def test_hot_mode_after_three_ttls_absorbs_a_join_a_kill_a_leave_and_deleted_records(
        nodes, default_etcd, run_id, tmp_path):
    from test_hot import HOT, check_replicas_and_samples
    from test_orchestrator import Job, cli

    job = Job(nodes, default_etcd, run_id, tmp_path, train=[HOT],
              extra=["--recovery", "hot", "--node-ttl", "3", "--rdzv-conf", f"ttl={TTL},secret=s3cret"])
    started = job.start("a", "b")
    first = min(r["time"] for r in job.records())
    wait_for(lambda: last_time(job) > first + 3 * TTL, 120, "three ttl periods of training")
    generation_key = job.registry.keys.generations().rdzv_round
    assert job.client.get(generation_key) is not None, "the generation record expired while the job ran"

    c = job.join("c")
    job.wait_world(3, {"a", "b", "c"}, since=first + 3 * TTL)
    killed_at = last_time(job)
    c.kill()
    job.wait_world(2, {"a", "b"}, since=killed_at)

    # The failure this guards against: the generation record deleted (no signature needed), then a joiner.
    for key in (generation_key, job.registry.keys.run_lease):
        job.client.delete(key)
        wait_for(lambda key=key: job.client.get(key) is not None, 30, f"{key} written back")
    d = job.join("d")
    grown = job.wait_world(3, {"a", "b", "d"}, since=last_time(job))
    assert min(r["step"] for r in grown if r["node"] == "d") > 0, "the joiner started from scratch"
    assert cli("leave", "--etcd", default_etcd.endpoint, "--job", run_id, "--node", "d").returncode == 0
    assert d.wait(60) == 0, d.log()
    job.wait_world(2, {"a", "b"}, since=last_time(job))

    assert cli("down", "--etcd", default_etcd.endpoint, "--job", run_id).returncode == 0
    for name in ("a", "b"):
        assert started[name].wait(60) == 0, started[name].log()
    steps = [r for r in job.records() if "event" not in r]
    assert not groups_overlap(steps, lambda r: r["generation"])
    assert min(r["generation"] for r in steps if r["node"] == "d") > 1
    check_replicas_and_samples(steps)
