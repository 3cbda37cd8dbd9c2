"""Checkpointer in one process: round trip, keep-N, async snapshots, atomicity, fallback on corruption.

Layer tests/process: real processes (elasticctl, torchrun, workers, tools). The other tests of this
subject: tests/unit/test_checkpoint.py.
"""

from __future__ import annotations

import subprocess
import sys

import torch
from support.helpers import wait_for

from elasticctl.train.checkpoint import Checkpointer


SAVE_FOREVER = """
import sys, torch
from torch import nn
from elasticctl.train.checkpoint import Checkpointer
model = nn.Linear(1024, 4096)  # 16 MB: each save takes a while
ckpt = Checkpointer(sys.argv[1], keep=2)
step = 0
while True:
    step += 1
    with torch.no_grad():
        model.bias.fill_(step)
    ckpt.save(step, model=model)
"""


def test_sigkill_during_a_save_leaves_a_loadable_newest_checkpoint(tmp_path):
    def writing_after_a_commit():
        return list(tmp_path.glob(".tmp-*")) and list(tmp_path.glob("step-*.pt.sha256"))

    for attempt in range(3):
        writer = subprocess.Popen([sys.executable, "-c", SAVE_FOREVER, str(tmp_path)])
        try:
            wait_for(writing_after_a_commit, 120, "a save in progress after a committed one", interval=0.01)
            writer.kill()
        finally:
            writer.kill()
            writer.wait(30)
        payload = Checkpointer(tmp_path).load_latest()
        assert payload is not None, f"attempt {attempt}: nothing loadable"
        assert torch.all(payload["state"]["model"]["bias"] == payload["step"])
