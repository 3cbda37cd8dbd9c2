"""The dashboard in a real browser (headless Debian Chromium driven by selenium) during a real
3-node job: the page lists the nodes, marks a killed node's events on the world-size chart, and
drops the node from its table; /metrics parses and agrees. Waits poll the page or etcd with a
deadline, never sleep. A screenshot is saved to $ELASTICCTL_TEST_ARTIFACTS (else tmp_path), and
becomes the guide's (docs/dashboard.png) where that one shows another version of the page
(support.screenshot: tests/unit/test_docs.py fails until it is committed)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from support import screenshot
from support.dashboard import Dashboard
from support.helpers import wait_for
from support.jobs import TRAIN, Job
from prometheus_client.parser import text_string_to_metric_families

from elasticctl.job.events import EventLog
from elasticctl.job.records import Event, EventKind

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
        reason="needs Debian's chromium and chromium-driver (apt-get install them)",
    ),
]


@pytest.fixture
def browser():
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="needs selenium (pip install selenium)"
    )
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(
        CHROMIUM
    )  # with the driver's path given too, selenium-manager downloads nothing
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
        "--lang=en-GB",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()  # stops chromedriver and chromium


# Each read is one script: the page replaces its rows and markers every second, so an element
# found by one WebDriver call can be gone (stale) by the next.
def _rows(driver) -> list[list[str]]:
    return driver.execute_script(
        "return [...document.querySelectorAll('#nodes tbody tr')]"
        ".map((tr) => [...tr.cells].map((td) => td.textContent))"
    )


def _markers(driver, selector: str) -> list[str]:
    """The titles of the world-size chart's event markers that match ``selector``."""
    return driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map((m) => m.title)",
        f"#world-chart .marker{selector}",
    )


def _ticks(driver) -> list[list[str]]:
    """The checkpoint ticks' (data-step, title)."""
    return driver.execute_script(
        "return [...document.querySelectorAll('#world-chart .tick')]"
        ".map((t) => [t.dataset.step, t.title])"
    )


def test_the_page_follows_a_live_job_through_a_kill(nodes, default_etcd, run_id, tmp_path, browser):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    job = Job(
        nodes,
        default_etcd,
        run_id,
        tmp_path,
        # --spares 1 with no node beyond the three: the page warns that the spare is missing
        extra=["--checkpoint-dir", str(checkpoints), "--spares", "1"],
        train=[*TRAIN, "--checkpoint-every", "20"],
    )
    dashboard = None
    try:
        c = job.start("a", "b", "c")["c"]
        dashboard = Dashboard(default_etcd.endpoint, "--job", run_id)
        browser.get(dashboard.url)
        wait_for(
            lambda: sorted(r[0] for r in _rows(browser) if r[3] == "training") == ["a", "b", "c"],
            30,
            "the nodes table listing a, b and c training",
        )
        wait_for(
            lambda: _markers(browser, '[data-event-kind="round_formed"][data-world-size="3"]'),
            30,
            "the round of 3 marked on the world-size chart",
        )
        # checkpoint writes are small ticks with their step, never full-height event markers
        step, title = wait_for(lambda: _ticks(browser), 30, "a checkpoint tick on the chart")[0]
        assert int(step) > 0 and "checkpoint_written" in title, title
        assert not _markers(browser, '[data-event-kind="checkpoint_written"]')
        wait_for(
            lambda: browser.find_element("id", "checkpoint").text.startswith("step "),
            10,
            "the newest checkpoint in the summary",
        )
        # two progress samples: the steps/s curve has a point before the kill
        wait_for(
            lambda: len(json.loads(dashboard.get("api/job"))["samples"]["time"]) >= 2,
            30,
            "two progress samples",
        )

        killed_at = max(r["time"] for r in job.records())
        c.kill()
        job.wait_world(2, {"a", "b"}, since=killed_at)
        wait_for(
            lambda: _markers(browser, '[data-event-kind="member_lost"]'),
            30,
            "the lost member marked on the world-size chart",
        )
        title = wait_for(
            lambda: _markers(browser, '[data-event-kind="round_formed"][data-world-size="2"]'),
            30,
            "the round of 2 marked on the world-size chart",
        )[-1]
        assert "round_formed" in title and "world size 2" in title, title
        wait_for(
            lambda: sorted(r[0] for r in _rows(browser)) == ["a", "b"],
            30,
            "the nodes table down to a and b",
        )
        assert browser.find_element("id", "world-size").text == "2"
        assert browser.find_element("id", "spares").text == "0 of 1"
        assert browser.find_element("id", "spares-short").text == "1 SHORT"
        wait_for(
            lambda: int(browser.find_element("id", "recoveries").text or 0) >= 1,
            30,
            "the recovery counted",
        )
        # the page drew a progress sample at the smaller size: the screenshot shows training go on
        wait_for(
            lambda: browser.execute_script("return state.samples.world_size.at(-1)") == 2,
            30,
            "a progress sample at world size 2 on the page",
        )
        wait_for(
            lambda: (
                browser.execute_script(
                    "return document.querySelectorAll('#events tbody tr').length"
                )
                >= 5
            ),
            10,
            "the event list",
        )

        artifacts = Path(os.environ.get("ELASTICCTL_TEST_ARTIFACTS") or tmp_path)
        artifacts.mkdir(parents=True, exist_ok=True)
        shot = artifacts / "dashboard.png"
        assert browser.save_screenshot(str(shot))
        fingerprint = screenshot.page_fingerprint()
        shot.write_bytes(screenshot.stamp(shot.read_bytes(), fingerprint))
        if screenshot.stamp_of(screenshot.SCREENSHOT.read_bytes()) != fingerprint:
            screenshot.SCREENSHOT.write_bytes(shot.read_bytes())
            print(f"the guide's screenshot {screenshot.SCREENSHOT} was taken again: commit it")
        (artifacts / "dashboard.json").write_bytes(dashboard.get("api/job"))
        print(f"dashboard screenshot: {shot}")

        history = EventLog(job.client, job.registry.keys)

        def written() -> list[Event]:
            return [e for e in history.read() if e.kind is EventKind.CHECKPOINT_WRITTEN]

        # checkpoints go on during the scrape: its age is from one written before or during it
        before, scraped = written(), time.time()
        families = {
            f.name: f for f in text_string_to_metric_families(dashboard.get("metrics").decode())
        }
        after, done = written(), time.time()
        value = {name: f.samples[0].value for name, f in families.items() if f.samples}
        assert value["elasticctl_world_size"] == 2
        assert {s.labels["state"]: s.value for s in families["elasticctl_nodes"].samples} == {
            "training": 2
        }
        recoveries = {s.name: s.value for s in families["elasticctl_recovery_seconds"].samples}
        assert recoveries["elasticctl_recovery_seconds_count"] >= 1
        assert 0 < recoveries["elasticctl_recovery_seconds_sum"] < 120
        assert value["elasticctl_restarts_spent"] == 0, "a lost peer spends no restart"
        age = value["elasticctl_last_checkpoint_age_seconds"]
        assert scraped - after[-1].time - 0.01 <= age <= done - before[-1].time + 0.01, age
        assert value["elasticctl_checkpoint_write_seconds"] in {e.duration for e in after}
        assert value["elasticctl_last_checkpoint_step"] > 0
    finally:
        if dashboard is not None:
            assert dashboard.stop() == 0
        job.client.close()


def test_a_dashboard_of_several_jobs_lets_the_page_pick_one(default_etcd, run_id, browser):
    from support.dashboard import MEMBER, NODE

    from elasticctl.etcd.client import EtcdClient
    from elasticctl.job.keys import JobKeys

    prefix = f"/t-{run_id}"
    first, second = JobKeys(f"{run_id}-a", prefix), JobKeys(f"{run_id}-b", prefix)
    client = EtcdClient(default_etcd.client_settings())
    lease = client.grant_lease(30)
    dashboard = None
    try:
        for keys in (first, second):
            client.put(keys.node("a"), NODE, lease=lease)
            client.put(keys.member("a"), MEMBER)
            EventLog(client, keys).record(EventKind.NODE_JOINED, "a")
        dashboard = Dashboard(default_etcd.endpoint, "--key-prefix", prefix)
        browser.get(dashboard.url)
        # two jobs and none chosen: the page says so and offers both
        wait_for(lambda: "pick one" in browser.find_element("id", "error").text, 30, "the page asking for a job")
        options = browser.execute_script(
            "return [...document.querySelectorAll('#job-picker option')].map((o) => o.value)")
        assert options == ["", first.job, second.job]
        browser.execute_script(
            "const p = document.getElementById('job-picker'); p.value = arguments[0];"
            "p.dispatchEvent(new Event('change'));", second.job)
        wait_for(lambda: browser.find_element("id", "job").text == second.job, 30, "the page showing the job picked")
        assert browser.current_url.endswith(f"?job={second.job}")
        wait_for(lambda: [r[0] for r in _rows(browser)] == ["a"], 30, "the picked job's node")
        assert not browser.find_element("id", "error").is_displayed()
    finally:
        if dashboard is not None:
            assert dashboard.stop() == 0
        client.revoke_lease(lease)
        client.delete_prefix(prefix + "/")
        client.close()
