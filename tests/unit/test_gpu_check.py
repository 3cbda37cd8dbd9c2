"""scripts/gpu-check, the prepared check for a session lent a GPU: on a machine without one it
runs, says why it skipped, and exits 0 (so that it is known to start before device time is spent)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run scripts/gpu-check itself")
def test_without_a_gpu_it_says_why_and_exits_0(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout[result.stdout.index("{\n"):])
    assert summary["skipped"].startswith("no GPU") and summary["machine"]["cuda_available"] is False
