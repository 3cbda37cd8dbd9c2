"""The README's quick start to two nodes, run as written: two terminals on one host.

The commands are read from the README's "Two nodes on one host" section, not copied here: the
first `up` (embedded etcd on loopback, a checkpoint directory), then `join` in a second terminal,
`status` from a third, and `down`. The test changes only what a test must: a free etcd port
instead of 2379 (a suite may run beside an etcd there), the checkpoint directory in tmp_path, and
the trainer's length and pace (so that the job is still training when the second node joins),
with a record of its steps to check, and node ids to tell the two nodes of one host apart.
"""

from __future__ import annotations

import re
import shlex

from support.helpers import ELASTICCTL, REPO, cli, read_records, wait_for
from support.jobs import steps_at

from elasticctl.embedded_etcd import free_port

README = REPO / "README.md"


def section_commands(title: str) -> list[list[str]]:
    """The elasticctl commands of the README section ``title``'s code blocks, as argv."""
    text = README.read_text()
    section = text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["elasticctl"]:
                commands.append(words[1:])
    return commands


def replaced(argv: list[str], option: str, value: str) -> list[str]:
    index = argv.index(option)
    return [*argv[:index + 1], value, *argv[index + 2:]]


def test_the_readme_quick_start_reaches_two_nodes(nodes, tmp_path):
    commands = section_commands("Two nodes on one host")
    up = next(c for c in commands if c[0] == "up")
    join = next(c for c in commands if c[0] == "join")
    status = next(c for c in commands if c[0] == "status")
    down = next(c for c in commands if c[0] == "down")
    # what the README promises of them
    assert up[up.index("--etcd-listen") + 1] == "127.0.0.1" and "--checkpoint-dir" in up
    assert join == ["join", "--etcd", "127.0.0.1:2379"]

    port, peer = free_port(), free_port()
    endpoint = f"127.0.0.1:{port}"
    record = tmp_path / "record.jsonl"
    script = up.index("trainers/mlp.py")
    up = [*up[:1], "--etcd-port", str(port), "--etcd-peer-port", str(peer), *up[1:script],
          str(REPO / "trainers" / "mlp.py"), "--steps", "100000", "--step-sleep", "0.05", "--log-every", "0",
          "--record", str(record)]
    up = replaced(up, "--checkpoint-dir", str(tmp_path / "ckpt"))

    def etcd_of(argv: list[str]) -> list[str]:
        return replaced(argv, "--etcd", endpoint)

    first = nodes("node-a", [*ELASTICCTL, up[0], "--node-id", "node-a", *up[1:]])
    # mlp checkpoints every 50 steps: let it write one before the second node joins
    wait_for(lambda: any(r.get("step", 0) >= 60 for r in steps_at(read_records(record), 1)), 180,
             f"the first node training alone (log: {first.log()[-2000:]})")
    second = nodes("node-b", [*ELASTICCTL, *etcd_of(join), "--node-id", "node-b"])

    def at_two():
        steps = steps_at(read_records(record), 2)
        return steps if {r["node"] for r in steps} >= {"node-a", "node-b"} else None

    together = wait_for(at_two, 180, "both nodes training at world size 2")
    # restart mode resumed the world of two from the newest checkpoint, not from step 0
    assert min(r["step"] for r in together) >= 50, sorted(r["step"] for r in together)[:5]

    shown = cli(*etcd_of(status), timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "node-a" in shown.stdout and "node-b" in shown.stdout, shown.stdout

    stopped = cli(*etcd_of(down), timeout=90)
    assert stopped.returncode == 0, stopped.stderr
    assert second.wait(120) == 0, second.log()[-2000:]
    assert first.wait(120) == 0, first.log()[-2000:]
