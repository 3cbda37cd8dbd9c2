"""The page "Run on two hosts" (docs/two-hosts.md), run as it says on two hosts made of
network namespaces, each with a hostname of its own: what each command prints is what the page
shows.

host1 runs the page's `up` for a job without shared storage (hot mode, no checkpoint directory);
host2 runs the `join` line that `up` printed; host2's node is crashed (its whole process tree,
SIGKILL) and host1's goes on alone; then `status` and `events`. The page's blocks marked
``<!-- captured: NAME -->`` are compared with this run's output, numbers, times and column widths
aside (they differ from run to run): every line the page shows must be printed, in that order.

``ELASTICCTL_REFRESH_CAPTURES=1`` (``scripts/refresh-captures``) writes this run's output into the
page instead.

Each host resolves names against a nameserver on its own loopback, where nothing listens: a
lookup fails at once, as on a host whose resolver answers, instead of waiting for a DNS server
that the namespaces cannot reach.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.helpers import REPO, wait_for
from support.netns import Topology, sweep_stale

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="network namespaces need root"),
    pytest.mark.skipif(shutil.which("ip") is None, reason="the 'ip' binary (iproute2) is not installed"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="the 'unshare' binary (util-linux) is not installed"),
]

PAGE = REPO / "docs" / "two-hosts.md"
ELASTICCTL = [sys.executable, "-m", "elasticctl.cli"]
HOSTS = ("host1", "host2")
# The page's command for a job without shared storage, as written.
UP = ["up", "--nnodes", "1:2", "--recovery", "hot", "trainers/mlp.py", "--steps", "6000", "--step-sleep", "0.05"]
CAPTURED = re.compile(r"(<!-- captured: (\w+) -->\n```text\n)(.*?)(```)", re.DOTALL)


def as_host(host: str, command: list[str]) -> list[str]:
    """``command`` in a UTS namespace of its own whose hostname is ``host`` (the node's name)."""
    return ["unshare", "--uts", "--", "sh", "-c", f'hostname {host} && exec "$@"', "sh", *command]


def shape(line: str) -> str:
    """A line with what differs between runs made alike: numbers, column widths, the interpreter."""
    line = line.replace(sys.executable, "python")
    line = re.sub(r"\d+(\.\d+)?", "#", line)
    return " ".join(line.split())


def shown_in_order(page: str, printed: str) -> list[str]:
    """The page's lines that this run did not print in the page's order (empty: all were)."""
    printed_shapes = [shape(line) for line in printed.splitlines()]
    missing, position = [], 0
    for line in page.splitlines():
        try:
            position = printed_shapes.index(shape(line), position) + 1
        except ValueError:
            missing.append(line)
    return missing


@pytest.fixture
def hosts():
    sweep_stale()
    topology = Topology(list(HOSTS), subnet="10.213.59")
    resolvers = [Path("/etc/netns") / topology.ns(host) for host in HOSTS]
    for directory in resolvers:  # `ip netns exec` mounts it over /etc/resolv.conf
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "resolv.conf").write_text("nameserver 127.0.0.1\n")
    try:
        topology.create()
        for host, other in (HOSTS, HOSTS[::-1]):  # a default route, as a real host has
            subprocess.run(["ip", "-n", topology.ns(host), "route", "add", "default", "via", topology.addr(other),
                            "dev", "eth0"], check=True)
        yield topology
    finally:
        topology.destroy()
        for directory in resolvers:
            shutil.rmtree(directory, ignore_errors=True)


def test_the_two_hosts_section_prints_what_the_page_shows(hosts, tmp_path):
    host1 = hosts.addr("host1")
    up = hosts.spawn("host1", "up", as_host("host1", [*ELASTICCTL, *UP]), tmp_path)
    wait_for(lambda: re.search(r"^step \d+/6000 .* world 1 ", up.log(), re.MULTILINE), 180, "host1 training alone")
    join_line = re.search(r"^  (elasticctl join .*)$", up.log(), re.MULTILINE)
    assert join_line, up.log()
    assert join_line.group(1) == f"elasticctl join --etcd {host1}:2379 --job elastic-job", up.log()
    join = hosts.spawn("host2", "join", as_host("host2", [*ELASTICCTL, *join_line.group(1).split()[1:]]), tmp_path)
    wait_for(lambda: re.search(r"^step \d+/6000 .* world 2 ", up.log(), re.MULTILINE), 120, "both hosts training")
    status = hosts.run("host1", [*ELASTICCTL, "status", "--etcd", f"{host1}:2379"])
    assert status.returncode == 0, status.stderr

    join_printed = "\n".join(line for line in join.log().splitlines() if not line.startswith("[W"))
    before_crash = len(up.log())
    join.signal_tree(signal.SIGKILL)  # the page's `pkill -9 -f elasticctl` on host2: its node and workers
    wait_for(lambda: re.search(r"^step \d+/6000 .* world 1 ", up.log()[before_crash:], re.MULTILINE), 60,
             "host1 training alone again")
    events = hosts.run("host1", [*ELASTICCTL, "events", "--etcd", f"{host1}:2379"])
    assert events.returncode == 0, events.stderr

    up_lines = [line for line in up.log().splitlines() if not line.startswith("[W")]  # torch's own warnings
    first_steps = next(i for i, line in enumerate(up_lines) if line.startswith("step 50/")) + 1
    printed = {
        "up": "\n".join(up_lines[:first_steps]),  # what it says before training, and its first steps
        "join": join_printed,  # until its node was killed
        "status": status.stdout.rstrip(),
        "events": events.stdout.rstrip(),
    }
    page = PAGE.read_text(encoding="utf-8")
    shown = {name: text for _, name, text, _ in CAPTURED.findall(page)}
    assert set(shown) == set(printed), f"the page's captured blocks are {sorted(shown)}, not {sorted(printed)}"

    if os.environ.get("ELASTICCTL_REFRESH_CAPTURES") == "1":
        PAGE.write_text(CAPTURED.sub(lambda m: m.group(1) + printed[m.group(2)].replace(sys.executable, "python")
                                     + "\n" + m.group(4), page), encoding="utf-8")
        return
    for name, text in shown.items():
        assert shown_in_order(text, printed[name]) == [], \
            f"the page's `{name}` output is not what it prints now (refresh with scripts/refresh-captures):\n" \
            f"{printed[name]}"
