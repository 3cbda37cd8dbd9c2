"""Debian's Prometheus and promtool for the tests of deploy/prometheus: the binaries, a real
Prometheus server on a free loopback port with its own storage, and PromQL over its HTTP API."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml
from support.helpers import REPO, wait_for

from elasticctl.embedded_etcd import free_port

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
RULES = REPO / "deploy" / "prometheus" / "alerts.yml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "alerts_test.yml"
CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = REPO / "deploy" / "grafana" / "elasticctl.json"

# A metric name in PromQL that is not part of a recording rule's name (level:metric:operations).
METRIC_NAME = re.compile(r"(?<![\w:])elasticctl_\w+(?![\w:])")
RECORDED_NAME = re.compile(r"[a-zA-Z_]\w*:[\w:]+")


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, check=False)


def rule_groups(path: Path = RULES) -> list[dict]:
    return yaml.safe_load(path.read_text())["groups"]


def grafana_panels(path: Path = GRAFANA) -> list[dict]:
    """Every panel of the dashboard, those inside rows included."""
    panels = []
    for panel in json.loads(path.read_text())["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def panel_queries(job: str, scrape_interval: str = "1s") -> dict[str, str]:
    """Each panel target's expr as Grafana would send it for ``job`` (its variables filled in),
    by "panel title / refId"."""
    rate_interval = f"{4 * int(scrape_interval.rstrip('s'))}s"  # Grafana: at least 4 scrapes
    return {
        f"{panel['title']} / {target['refId']}": (
            target["expr"]
            .replace("$elastic_job", job)
            .replace("$__rate_interval", rate_interval)
            .replace("$__interval", scrape_interval)
        )
        for panel in grafana_panels()
        for target in panel.get("targets", [])
    }


def with_short_for(rules: Path, out: Path, duration: str) -> Path:
    """A copy of ``rules`` whose every alert waits ``duration`` (``for:``) instead: a test cannot
    wait the minutes the shipped rules do."""
    groups = rule_groups(rules)
    for group in groups:
        for rule in group["rules"]:
            if "alert" in rule:
                rule["for"] = duration
    out.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return out


class QueryError(AssertionError):
    pass


class Prometheus:
    """A real Prometheus scraping ``targets`` every second and evaluating ``rules`` every second,
    on a free loopback port; started as a test node (``nodes``), so it is stopped at teardown."""

    def __init__(self, nodes, directory: Path, targets: list[str], rules: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [
                {"job_name": "elasticctl", "static_configs": [{"targets": targets}]}
            ],
        }
        config_file = directory / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}/"
        self.node = nodes("prometheus", [
            PROMETHEUS, f"--config.file={config_file}", f"--storage.tsdb.path={directory / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
        ])
        wait_for(self._ready, 60, f"Prometheus ready at {self.url}")

    def _ready(self) -> bool:
        if self.node.process.poll() is not None:
            raise AssertionError(f"Prometheus exited {self.node.process.returncode}:\n{self.node.log()}")
        try:
            with urllib.request.urlopen(self.url + "-/ready", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError):
            return False

    def api(self, path: str, **params) -> object:
        """The ``data`` of a successful API answer; a query Prometheus refuses raises QueryError."""
        url = f"{self.url}api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        if body.get("status") != "success":
            raise QueryError(f"{params.get('query', path)}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, promql: str) -> list[dict]:
        """An instant query's vector (a list of {metric, value: [time, text]})."""
        return self.api("query", query=promql)["result"]

    def value(self, promql: str) -> float | None:
        """The one value of an instant query that returns one sample, else None."""
        result = self.query(promql)
        return float(result[0]["value"][1]) if len(result) == 1 else None

    def query_range(self, promql: str, start: float, end: float, step: str = "1s") -> list[dict]:
        return self.api("query_range", query=promql, start=start, end=end, step=step)["result"]

    def wait(self, promql: str, timeout: float, what: str) -> list[dict]:
        """Wait until an instant query returns a non-empty vector (a comparison that holds)."""
        return wait_for(lambda: self.query(promql), timeout, f"{what} ({promql})", interval=0.5)

    def alerts(self, name: str) -> list[dict]:
        """The active alerts called ``name``: each with its labels, state (pending, firing), value."""
        return [a for a in self.api("alerts")["alerts"] if a["labels"].get("alertname") == name]


def steps_of(series: list[list]) -> list[float]:
    """A range query's values with repeats dropped: [3, 3, 2, 2, 3] -> [3, 2, 3]."""
    values = [float(v) for _, v in series]
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


def contains_in_order(values: list[float], wanted: list[float]) -> bool:
    found = iter(values)
    return all(any(v == w for v in found) for w in wanted)


def finite(text: str) -> bool:
    return math.isfinite(float(text))
