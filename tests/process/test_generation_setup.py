"""A generation whose process-group set-up failed on one worker only must not keep
every later generation from forming (torch's group counter, raised by the failed
init_process_group, used to be part of the store keys: the workers waited under different
prefixes). Two real processes, real TCPStore and gloo on loopback."""

from __future__ import annotations

import json
import subprocess
import sys

from support.helpers import WORKERS
from torch.distributed.elastic.utils.distributed import get_free_port

SETUP = str(WORKERS / "pg_setup.py")


def test_a_set_up_that_failed_on_one_worker_does_not_spoil_the_next_generation():
    port = get_free_port()
    # Rank 1 first fails a generation of its own (its set-up times out after 2 s), then joins
    # rank 0, which waits in the next generation's set-up (up to 60 s) for it.
    survivor = subprocess.Popen([sys.executable, SETUP, "--rank", "0", "--port", str(port)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    failed_once = subprocess.Popen([sys.executable, SETUP, "--rank", "1", "--port", str(port),
                                    "--failed-port", str(get_free_port())],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out0, err0 = survivor.communicate(timeout=120)
        out1, err1 = failed_once.communicate(timeout=120)
    finally:
        for process in (survivor, failed_once):
            process.kill()
            process.wait()
    assert survivor.returncode == 0 and failed_once.returncode == 0, (err0[-2000:], err1[-2000:])
    lines = [json.loads(line) for line in out1.splitlines()]
    assert lines[0]["failed"] == 3, lines
    assert lines[-1] == {"generation": 4, "rank": 1, "sum": 3}
    assert json.loads(out0.splitlines()[-1]) == {"generation": 4, "rank": 0, "sum": 3}
