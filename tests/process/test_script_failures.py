"""A script that fails the same way before its first step ends its node after the second failure,
in one sentence, instead of being restarted through the budget (and a quarantine) as if a peer had
died: real `elasticctl up` nodes, real workers, a script that raises at import time. And torch's
DistributedSampler built at module level ends the first start with the fix, not torch's error."""

from __future__ import annotations

import subprocess

import psutil
import pytest
from support.helpers import ELASTICCTL

pytestmark = pytest.mark.slow

SCRIPT = "import os\nBROKEN = 1 / 0\n"


def up(default_etcd, run_id, recovery: str, script) -> subprocess.CompletedProcess:
    """One `elasticctl up` node of ``script``, to its end; its log is the result's stderr."""
    command = [*ELASTICCTL, "up", "--etcd", default_etcd.endpoint, "--job", run_id, "--nnodes", "1",
               "--node-id", "a", "--recovery", recovery, str(script)]
    try:
        # The wait's bound, not a timed assert: before, such a node ended about 80 s later.
        return subprocess.run(command, capture_output=True, text=True, timeout=15, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the node was still running after 15 s: {exc.stderr!r}")
    finally:
        left = [p for p in psutil.process_iter(["cmdline"]) if run_id in " ".join(p.info["cmdline"] or ())]
        assert left == [], f"processes left behind: {left}"


@pytest.mark.parametrize("recovery", ["restart", "hot"])
def test_an_import_time_error_ends_the_node_after_the_second_start(default_etcd, run_id, tmp_path, recovery):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    result = up(default_etcd, run_id, recovery, script)
    log = result.stderr
    assert result.returncode != 0, log
    sentence = (f"its script failed the same way twice before its first step, ZeroDivisionError at line 2 "
                f"of {script} (division by zero), which every restart would repeat.")
    last = log.strip().splitlines()[-1]
    assert last == f"elasticctl: node a stopped: {sentence}", log
    assert [line for line in log.splitlines() if line.startswith("elasticctl: node a stopped")] == [last], log
    # The script's own traceback, once per start: two starts, not four.
    assert log.count("Traceback (most recent call last)") == 2, log
    assert log.count("ZeroDivisionError: division by zero") == 2, log
    assert "quarantine" not in log, log


def test_a_torch_distributed_sampler_at_module_level_is_the_fix_in_one_sentence(default_etcd, run_id, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("from torch.utils.data import DistributedSampler\n"
                      "sampler = DistributedSampler(list(range(10)))\n")
    result = up(default_etcd, run_id, "hot", script)
    log = result.stderr
    assert result.returncode != 0, log
    assert "Traceback" not in log and "Default process group has not been initialized" not in log, log
    fix = ("This script builds torch's DistributedSampler before any process group exists (at module level, "
           "or before elastic.run): use elastic.ResumableSampler(dataset)")
    assert [line for line in log.splitlines() if line.startswith(f"elasticctl: error: {fix}")], log
    assert log.count(fix[1:]) == 3, log  # the worker's line, the agent's and the node's: one start
    assert log.strip().splitlines()[-1].startswith(f"elasticctl: node a stopped: t{fix[1:]}"), log
