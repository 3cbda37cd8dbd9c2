"""`elasticctl doctor`: each check's verdicts from a table of facts, then the pass and fail
paths against a real etcd on loopback, and `up`/`join` refusing a host that fails one.

Layer tests/contract: a real etcd, no training processes. The other tests of this subject:
tests/process/test_doctor_cli.py, tests/unit/test_doctor.py.
"""

from __future__ import annotations

import json
import re
import time

import pytest
from click.testing import CliRunner

from elasticctl.cli import cli
from elasticctl.doctor import gather


@pytest.mark.parametrize(("skew", "status"), [(0.0, "pass"), (-5.0, "warn"), (45.0, "fail")])
def test_clock_offset_against_a_real_etcd(default_etcd, monkeypatch, skew, status):
    # This host's clock, faked: `skew` seconds ahead of etcd's (the real one).
    monkeypatch.setattr(gather, "wall_clock", lambda: time.time() + skew)
    result = CliRunner().invoke(cli, ["doctor", "--json", "--etcd", default_etcd.endpoint,
                                      "--local-addr", "127.0.0.1"])
    clock = {c["name"]: c for c in json.loads(result.output)}["clock"]
    assert clock["status"] == status, clock
    assert result.exit_code == (1 if status == "fail" else 0)
    if skew:
        direction = "ahead of" if skew > 0 else "behind"
        seconds, error = (float(v) for v in re.findall(r"([0-9.]+) s", clock["detail"])[:2])
        assert abs(seconds - abs(skew)) <= error + 0.05 and f"{direction} etcd's" in clock["detail"], clock
