"""Records as the dashboard reads them from etcd, and `elasticctl dashboard` as a real process on a
free loopback port."""

from __future__ import annotations

import re
import signal
import subprocess
import urllib.request
from collections.abc import Mapping, Sequence

from support.helpers import ELASTICCTL

from elasticctl.job.records import ProgressSample

NOW = 1_700_000_100.0


def sample(t: float, step: int, loss: float | None = None, world: int | None = None) -> bytes:
    return ProgressSample(time=NOW - t, step=step, loss=loss, world_size=world).to_json().encode()


NODE = (
    b'{"id": "a", "host": "h1", "addr": "10.0.0.1", "gpus": 2, "state": "running", "joined_at": 1}'
)
MEMBER = b'{"node": "a", "state": "training", "round": 3, "rank": 0, "restarts": 1}'


class Dashboard:
    """`elasticctl dashboard` as a process on a free loopback port; stopped by ``stop``."""

    def __init__(self, endpoint: str, *args: str, program: Sequence[str] = ELASTICCTL,
                 env: Mapping[str, str] | None = None) -> None:
        """``program``: the elasticctl to run (another installation's, with its ``env``)."""
        self.process = subprocess.Popen(
            [*program, "dashboard", "--etcd", endpoint, "--listen", "127.0.0.1:0", *args],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        line = self.process.stderr.readline()  # the first line says where it listens
        found = re.search(r"http://127\.0\.0\.1:\d+/", line)
        if not found:
            self.stop()
            raise AssertionError(f"the dashboard did not start: {line}{self.process.stderr.read()}")
        self.url = found.group(0)

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return response.read()

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(15)
