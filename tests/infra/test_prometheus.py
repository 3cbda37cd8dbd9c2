"""Prometheus for real: deploy/prometheus's alert rules pass `promtool check rules` and
their unit tests (`promtool test rules`), the example config passes `promtool check config`, every
alert links a runbook section of docs/operations.md, every metric the rules and the Grafana
dashboard (deploy/grafana) name is one `elasticctl dashboard` exports, a live scrape passes
`promtool check metrics` and survives a restart of the dashboard with every counter still
monotonic, and a real Prometheus scraping a real dashboard every second during a 3-node job (a
worker's own failure, a node SIGKILLed, a node joining) answers in PromQL: world size over time,
the recovery histogram, the restarts spent, every Grafana panel, and the node-lost alert.

Layer tests/infra: the deploy recipes against the real tools (Debian's `prometheus` package, which
brings promtool), skipped with a reason when they are not installed. Waits poll Prometheus, the
job's records or etcd with a deadline; none sleeps.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from support.dashboard import MEMBER, NODE, NOW, Dashboard, sample
from support.helpers import wait_for
from support.jobs import TRAIN
from support.prometheus import (
    CONFIG,
    METRIC_NAME,
    PROMETHEUS,
    PROMTOOL,
    RECORDED_NAME,
    RULE_TESTS,
    RULES,
    Prometheus,
    contains_in_order,
    finite,
    grafana_panels,
    panel_queries,
    promtool,
    rule_groups,
    steps_of,
    with_short_for,
)
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from elasticctl.dashboard import server
from elasticctl.dashboard.server import Dashboard as DashboardApp
from elasticctl.etcd.client import EtcdClient
from elasticctl.job.counters import JobCounters
from elasticctl.job.events import EventLog
from elasticctl.job.keys import JobKeys
from elasticctl.job.records import Event, EventKind, record_json
from elasticctl.job.snapshot import JobSnapshot
from elasticctl.job.spec import JobSpec

needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="needs promtool (apt-get install prometheus)"
)
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="needs prometheus (apt-get install prometheus)"
)


# -- the rules and the config, by promtool -----------------------------------------------------


@needs_promtool
def test_promtool_checks_the_rules_and_runs_their_unit_tests():
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = promtool("test", "rules", str(RULE_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr


@needs_promtool
def test_promtool_checks_the_example_config_with_its_rules():
    checked = promtool("check", "config", str(CONFIG))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "alerts.yml" in checked.stdout, "the config must load the rule file"


def test_every_alert_is_unit_tested_firing_and_quiet():
    alerts = {rule["alert"] for group in rule_groups() for rule in group["rules"] if "alert" in rule}
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    firing, quiet = set(), set()
    for test in tests:
        for case in test["alert_rule_test"]:
            (firing if case["exp_alerts"] else quiet).add(case["alertname"])
    assert alerts - firing == set(), "alerts never shown firing"
    assert alerts - quiet == set(), "alerts never shown quiet"


def test_every_alert_has_a_for_a_severity_and_a_summary_with_labels():
    for group in rule_groups():
        for rule in group["rules"]:
            if "alert" not in rule:
                continue
            assert "for" in rule, rule["alert"]
            assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
            assert "{{ $labels." in rule["annotations"]["summary"], rule["alert"]


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a document's headings: lower case, punctuation dropped, spaces to '-'."""
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.+)$", markdown, flags=re.MULTILINE)}


def test_every_alert_links_a_runbook_section_of_the_docs():
    docs = RULES.parents[2] / "docs" / "operations.md"
    anchors = github_anchors(docs.read_text())
    assert "elasticctlnodelost" in anchors  # the anchor rule finds the headings: not vacuous
    for group in rule_groups():
        for rule in group["rules"]:
            if "alert" in rule:
                page, _, anchor = rule["annotations"]["runbook_url"].partition("#")
                assert page == "docs/operations.md" and anchor in anchors, (rule["alert"], anchor)


# -- the metric names, against what the dashboard exports -----------------------------------------


class PlantedRegistry:
    """What the dashboard's Registry answers, planted: a job with every record a metric comes from."""

    job = "j"
    spec = JobSpec("j", "train.py", min_nodes=1, max_nodes=3, max_restarts=3)

    def snapshot(self, _parts, timed) -> JobSnapshot:
        def event(t: float, kind: EventKind, **fields) -> Event:
            return Event(time=NOW - t, kind=kind, node="a", **fields)

        events = [
            event(60, EventKind.NODE_JOINED),
            event(50, EventKind.RECOVERY_FINISHED, duration=3.0),
            event(40, EventKind.FAILURE_JUDGED, charged=True),
            event(30, EventKind.CHECKPOINT_WRITTEN, step=40, duration=0.5),
            event(20, EventKind.STRAGGLER, ratio=2.5, step=45),
        ]
        counters = JobCounters()
        for e in events:  # what recording them added to the job's counters
            counters = counters.add(e)
        timed("lease", lambda: None)  # one request of each kind: the latency histogram has both
        return timed("range", lambda: JobSnapshot(
            job="j",
            nodes={"a": NODE},
            node_leases={"a": 1},
            members={"a": MEMBER},
            progress=b'{"step": 50, "loss": 0.5, "samples_per_s": 90.0, "last_checkpoint_step": 40, '
            b'"time": 1700000099, "checkpoint_failures": 1, "checkpoint_error": "the disk is full"}',
            events=[e.to_json().encode() for e in events],
            samples=[sample(4, 10), sample(2, 30)],
            counters=[counters.to_json().encode()],
        ))

    def read_spec(self) -> JobSpec:
        return self.spec


def planted_metrics() -> list:
    """The metric families of /metrics for a planted job on which every metric has a value."""
    dashboard = DashboardApp(client=None, keys=JobKeys("j"))  # narrowed to j: no etcd to list jobs
    dashboard.reader.registry = lambda _job: PlantedRegistry()
    generate_latest(dashboard.registry)  # the latency histogram shows the requests of the scrape before
    return list(text_string_to_metric_families(generate_latest(dashboard.registry).decode()))


def exported_sample_names() -> set[str]:
    """The sample names of /metrics, ``_total``, ``_bucket``, ``_count`` ... included."""
    return {s.name for family in planted_metrics() for s in family.samples}


def used_names(expr: str) -> set[str]:
    return set(METRIC_NAME.findall(expr))


def test_the_planted_job_has_a_value_for_every_metric_the_dashboard_declares():
    # else a metric left out for the planted job would pass for one the dashboard does not export
    declared = set(re.findall(r'"(elasticctl_\w+)"', Path(server.__file__).read_text()))
    families = planted_metrics()
    # prometheus_client adds a *_created series (the time a metric was created) to its own metrics
    assert {f.name for f in families if f.samples and not f.name.endswith("_created")} == declared


def test_the_docs_name_every_metric_the_dashboard_declares_and_no_other():
    docs = (RULES.parents[2] / "docs" / "operations.md").read_text()
    documented = {name.removesuffix("_total") for name in re.findall(r"`(elasticctl_\w+)", docs)}
    declared = set(re.findall(r'"(elasticctl_\w+)"', Path(server.__file__).read_text()))
    assert documented == declared, (documented - declared, declared - documented)


def test_every_metric_in_the_rules_and_the_grafana_panels_is_exported():
    exported = exported_sample_names()
    recorded = {rule["record"] for group in rule_groups() for rule in group["rules"] if "record" in rule}
    exprs = {
        f"rule {rule.get('alert') or rule.get('record')}": rule["expr"]
        for group in rule_groups() for rule in group["rules"]
    }
    exprs.update({f"panel {where}": expr for where, expr in panel_queries("j").items()})
    for where, expr in exprs.items():
        names = used_names(expr)
        recorded_here = set(RECORDED_NAME.findall(expr))
        prometheus_own = expr.startswith("up{")  # the scrape's own health, from Prometheus
        assert names or recorded_here or prometheus_own, f"{where}: no metric found in {expr!r}"
        assert names <= exported, f"{where} names metrics the dashboard does not export: {names - exported}"
        assert recorded_here <= recorded, f"{where} uses recording rules not defined: {recorded_here - recorded}"
    # the check would catch a typo: it is not vacuous
    assert used_names('elasticctl_wrold_size{elastic_job="j"} > 1') - exported == {"elasticctl_wrold_size"}


def test_the_grafana_dashboard_is_well_formed():
    board = json.loads(RULES.parents[1].joinpath("grafana", "elasticctl.json").read_text())
    variables = {v["name"] for v in board["templating"]["list"]}
    assert variables == {"datasource", "elastic_job"}
    panels = grafana_panels()
    assert len({p["id"] for p in panels}) == len(panels), "panel ids must be unique"
    taken: set[tuple[int, int]] = set()
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        cells = {(panel["gridPos"]["x"] + dx, panel["gridPos"]["y"] + dy)
                 for dx in range(panel["gridPos"]["w"]) for dy in range(panel["gridPos"]["h"])}
        assert not cells & taken, f"panel {panel['title']!r} overlaps another"
        assert all(0 <= x < 24 for x, _ in cells), f"panel {panel['title']!r} is wider than the grid"
        taken |= cells
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(set(refs)) == len(refs), panel["title"]
        for target in panel["targets"]:
            assert '{elastic_job="$elastic_job"}' in target["expr"], (
                f"panel {panel['title']!r} is not scoped to the chosen job: {target['expr']}")
    covered = " ".join(t["expr"] for p in panels for t in p["targets"])
    for what in ("elasticctl_world_size", "elasticctl_steps_per_second", "elasticctl_samples_per_second",
                 "elasticctl_training_loss", "elasticctl_restarts_spent_total", "elasticctl_nodes{",
                 "histogram_quantile(0.9, sum by (le) (elasticctl_recovery_seconds_bucket",
                 "elasticctl_last_checkpoint_age_seconds", "elasticctl_spares{", "elasticctl_spares_expected{",
                 "elasticctl_stragglers{", "elasticctl_straggler_events_total{", "elasticctl_events_total{"):
        assert what in covered, f"no panel shows {what}"


# -- a live scrape: by the book, and monotonic across a restart ------------------------------------


@pytest.fixture
def recorded_job(default_etcd, run_id):
    """A job whose events were recorded for real (each adding to its counters in etcd), under a key
    prefix of its own, with a history bounded to 5 events: it has forgotten most of them.
    Yields (client, keys, the --key-prefix option)."""
    prefix = f"/t-{run_id}"
    keys = JobKeys(run_id, prefix)
    client = EtcdClient(default_etcd.client_settings())
    lease = client.grant_lease(60)
    client.put(keys.spec, record_json(JobSpec(run_id, "train.py", min_nodes=1, max_nodes=3).to_dict()))
    client.put(keys.node("a"), NODE, lease=lease)
    client.put(keys.member("a"), MEMBER)
    client.put(keys.progress, json.dumps({
        "step": 50, "time": time.time(), "checkpoint_failures": 2,
        "checkpoint_error": f"Writing the checkpoint of step 40 to '{run_id}' failed: Permission denied."}))
    log = EventLog(client, keys, max_events=5)
    for i in range(4):
        record_round_of_faults(log, i)
    yield client, keys, ["--key-prefix", prefix]
    client.revoke_lease(lease)
    client.delete_prefix(prefix + "/")
    client.close()


def record_round_of_faults(log: EventLog, i: int) -> None:
    log.record(EventKind.MEMBER_LOST, "c", round=i)
    log.record(EventKind.FAILURE_JUDGED, "a", round=i, charged=True)
    log.record(EventKind.STRAGGLER, "b", ratio=2.0, step=i)
    log.record(EventKind.RECOVERY_FINISHED, "a", round=i + 1, duration=0.5 + 40 * i)


def counter_samples(text: str) -> dict[tuple, float]:
    """Every sample of a counter or a histogram in a scrape, by name and labels. The dashboard's own
    request latency is left out: it measures the dashboard process, which starts it from 0 like
    any process's own counters (process_cpu_seconds_total ...); the job's totals are what must
    survive the process."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            if family.type in ("counter", "histogram")
            and family.name != "elasticctl_dashboard_etcd_request_duration_seconds"
            for s in family.samples if not s.name.endswith("_created")}


@needs_promtool
def test_a_live_scrape_passes_promtool_check_metrics(default_etcd, recorded_job):
    _, _, prefix = recorded_job
    dashboard = Dashboard(default_etcd.endpoint, *prefix)
    try:
        scrape = dashboard.get("metrics").decode()
    finally:
        assert dashboard.stop() == 0
    assert 'error="permission"' in scrape and "elasticctl_build_info{" in scrape  # the scrape is a full one
    checked = subprocess.run([PROMTOOL, "check", "metrics"], input=scrape, capture_output=True, text=True,
                             timeout=60, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # the check would catch a counter without _total: it is not vacuous
    bad = subprocess.run([PROMTOOL, "check", "metrics"], capture_output=True, text=True, timeout=60, check=False,
                         input="# HELP elasticctl_x A counter.\n# TYPE elasticctl_x counter\nelasticctl_x 1\n")
    assert bad.returncode != 0 and "_total" in bad.stdout + bad.stderr


def test_a_dashboard_restart_leaves_every_counter_monotonic(default_etcd, recorded_job):
    client, keys, prefix = recorded_job
    dashboard = Dashboard(default_etcd.endpoint, *prefix)
    try:
        before = counter_samples(dashboard.get("metrics").decode())
    finally:
        assert dashboard.stop() == 0
    # More faults while no dashboard runs: the bounded history forgets the older ones meanwhile.
    record_round_of_faults(EventLog(client, keys, max_events=5), 4)
    dashboard = Dashboard(default_etcd.endpoint, *prefix)
    try:
        after = counter_samples(dashboard.get("metrics").decode())
    finally:
        assert dashboard.stop() == 0
    job = (("elastic_job", keys.job),)
    assert len(EventLog(client, keys).read()) == 5, "the history forgot all but the newest 5 events"
    assert after[("elasticctl_events_total", (*job, ("kind", "member_lost")))] == 5, "the counters did not"
    assert after[("elasticctl_restarts_spent_total", job)] == 5
    assert after[("elasticctl_recovery_seconds_count", job)] == 5
    assert set(before) <= set(after), "no series went away"
    went_down = {key: (before[key], after[key]) for key in before if after[key] < before[key]}
    assert not went_down, went_down
    rose = {key for key in before if after[key] > before[key]}
    assert ("elasticctl_straggler_events_total", job) in rose and ("elasticctl_recovery_seconds_sum", job) in rose


# -- a real Prometheus, a real dashboard, a real job ---------------------------------------------


def _latest_step_time(job) -> float:
    return max(r["time"] for r in job.records())


def _worker_pids(job) -> dict[str, int]:
    """Each node's worker's pid, from its newest step record."""
    return {r["node"]: r["pid"] for r in job.records() if "event" not in r and "pid" in r}


def _wait_new_workers(job, world: int, old: dict[str, int], timeout: float = 120) -> None:
    """Wait until a new worker of every node in ``old`` (another pid) trained at ``world``: the
    records of the workers that ran before the failure cannot satisfy it."""
    def restarted() -> bool:
        steps = [r for r in job.records() if "event" not in r and r.get("world_size") == world]
        return {r["node"] for r in steps if r.get("pid") not in (None, old.get(r["node"]))} >= set(old)

    wait_for(restarted, timeout, f"new workers of {sorted(old)} training at world size {world}")


@needs_prometheus
@pytest.mark.slow
def test_prometheus_answers_in_promql_during_a_failure_a_kill_and_a_join(
        job, nodes, default_etcd, run_id, tmp_path):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    # 100,000 steps at 50 ms each: the job cannot finish before the test's events are over.
    j = job(extra=["--checkpoint-dir", str(checkpoints)], train=[*TRAIN, "--checkpoint-every", "20"])
    started = j.start("a", "b", "c")
    dashboard = Dashboard(default_etcd.endpoint, "--job", run_id)
    target = dashboard.url.removeprefix("http://").rstrip("/")
    try:
        # The shipped rules wait minutes before an alert fires; a copy waits 2 s.
        rules = with_short_for(RULES, tmp_path / "alerts-short-for.yml", "2s")
        prometheus = Prometheus(nodes, tmp_path / "prometheus", [target], rules)
        began = time.time()
        job_label = f'elastic_job="{run_id}"'

        prometheus.wait(f"elasticctl_world_size{{{job_label}}} == 3", 60, "world size 3 scraped")
        prometheus.wait(f"elasticctl_restarts_spent_total{{{job_label}}} == 0", 30, "no restart spent yet")
        # the rounds of the start (c and b joining a) may have counted recoveries already
        recoveries_before = prometheus.value(f"elasticctl_recovery_seconds_count{{{job_label}}}")

        # 1. A worker of b dies on its own: a restart is charged (to the node whose failure came
        #    first), the three train again.
        workers = _worker_pids(j)
        os.kill(workers["b"], signal.SIGKILL)
        _wait_new_workers(j, 3, workers)
        prometheus.wait(f"elasticctl_restarts_spent_total{{{job_label}}} >= 1", 60, "a restart spent")
        prometheus.wait(f"sum(elasticctl_node_restarts_spent{{{job_label}}}) >= 1", 60,
                        "the restart in the spender's member record")

        # 2. Node c SIGKILLed: the two others go on; the node-lost alert fires with world size 2.
        since = _latest_step_time(j)
        started["c"].kill()
        j.wait_world(2, {"a", "b"}, since=since)
        prometheus.wait(f"elasticctl_world_size{{{job_label}}} == 2", 60, "world size 2 scraped")
        lost = wait_for(
            lambda: [a for a in prometheus.alerts("ElasticctlNodeLost")
                     if a["state"] == "firing" and float(a["value"]) == 2],
            60, "the node-lost alert firing at world size 2")[0]
        assert lost["labels"]["elastic_job"] == run_id and lost["labels"]["severity"] == "warning"
        assert "trained on 2 nodes" in lost["annotations"]["summary"], lost

        # 3. Node d joins: three again, and the alert resolves.
        since = _latest_step_time(j)
        j.join("d")
        j.wait_world(3, {"a", "b", "d"}, since=since)
        prometheus.wait(f"elasticctl_world_size{{{job_label}}} == 3", 60, "world size 3 scraped again")
        wait_for(lambda: not prometheus.alerts("ElasticctlNodeLost"), 60, "the node-lost alert resolved")
        # Three more recoveries (the failure, the kill, the join), each once its first step is recorded.
        prometheus.wait(f"elasticctl_recovery_seconds_count{{{job_label}}} >= {recoveries_before + 3:g}",
                        60, "three recoveries more")
        ended = time.time()
        seconds = f"{max(1, round(ended - began))}s"

        # World size over time: 3, then 2 after the kill, then 3 again.
        (world,) = prometheus.query_range(f"elasticctl_world_size{{{job_label}}}", began, ended)
        sizes = steps_of(world["values"])
        assert contains_in_order(sizes, [3, 2, 3]), sizes
        # The recovery histogram: counted, and its quantiles finite.
        count = prometheus.value(f"elasticctl_recovery_seconds_count{{{job_label}}}")
        p50, p90 = (prometheus.query(
            f"histogram_quantile({q}, sum by (le) (elasticctl_recovery_seconds_bucket{{{job_label}}}))")
            for q in (0.5, 0.9))
        assert count >= recoveries_before + 3, count
        assert finite(p50[0]["value"][1]) and finite(p90[0]["value"][1]), (p50, p90)
        # Restarts spent rose from 0 over the run.
        (spent,) = prometheus.query_range(f"elasticctl_restarts_spent_total{{{job_label}}}", began, ended)
        spent_steps = steps_of(spent["values"])
        assert spent_steps[0] == 0 and spent_steps[-1] >= 1, spent_steps
        # Every Grafana panel's query returns data from this Prometheus.
        answers = {where: prometheus.query(expr) for where, expr in panel_queries(run_id).items()}
        empty = sorted(where for where, result in answers.items() if not result)
        assert not empty, f"panels without data: {empty}"
        # What the scrapes cost, for the record (-s): the dashboard reads etcd at each one.
        scrapes = prometheus.value(f'count_over_time(up{{job="elasticctl"}}[{seconds}])')
        scraped = prometheus.value(f'sum_over_time(up{{job="elasticctl"}}[{seconds}])')
        slowest = prometheus.value(f'max_over_time(scrape_duration_seconds{{job="elasticctl"}}[{seconds}])')
        print(f"\nworld size over time: {sizes}; restarts spent: {spent_steps}; recoveries: {count:g}, "
              f"p50 {float(p50[0]['value'][1]):.2f} s, p90 {float(p90[0]['value'][1]):.2f} s; "
              f"node-lost alert: {lost['annotations']['summary']!r}; {scraped:g} of {scrapes:g} scrapes "
              f"in {seconds} answered, the slowest in {slowest:.3f} s")
    finally:
        assert dashboard.stop() == 0
