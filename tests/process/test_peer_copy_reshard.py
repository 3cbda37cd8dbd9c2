"""Peer copies resharded in memory restore the exact state (elasticctl.train.sharding.buddy_copies): 3 real
processes on gloo shard a small transformer over a 1-D mesh with uneven shards, copy rounds every
3 steps; one leaves and the other two, as a world of 2, go back to the newest round from their own
snapshots and the leaver's copy. The full parameters and optimizer state they hold then are bit
for bit those the world of 3 had at that step. A node joining a world of 2 (a newcomer with a fresh
model) gets its shards from the others' snapshots of the step they trained to, and the rest of the
state from the lead: nothing re-done, the same state everywhere. (Through `elasticctl up`:
test_peer_copies.py.)"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from support.helpers import REPO

SCRIPT = REPO / "tests" / "support" / "workers" / "peer_copy_reshard.py"


def free_port_pair(count: int = 2) -> int:
    """A free port followed by ``count - 1`` free ones (the script's stores)."""
    while True:
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                for offset in range(1, count):
                    with socket.socket() as other:
                        other.bind(("127.0.0.1", port + offset))
            except OSError:
                continue
        return port


def test_peer_copies_resharded_from_3_to_2_restore_the_state_bit_for_bit():
    done = subprocess.run([sys.executable, str(SCRIPT), str(free_port_pair(2))], capture_output=True, text=True,
                          timeout=180)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and len(lines) == 2, done.stdout[-2000:] + done.stderr[-3000:]
    for line in lines:
        # rounds at steps 1 (the first boundary), 3 and 6; trained to 8: back to 6
        assert (line["trained"], line["step"], line["then"]) == (8, 6, 7), line
        assert line["digest"] == line["expected"], line
        [event] = line["events"]
        assert event["source"] == "peer_copy" and event["copies_of"] == [2] and event["redone"] == 2, event
    assert {line["events"][0]["shard"] for line in lines} == {0, 1}


def test_a_newcomer_joining_gets_its_shards_resharded_from_memory_at_the_step_trained_to():
    done = subprocess.run([sys.executable, str(SCRIPT), str(free_port_pair(3)), "join"], capture_output=True,
                          text=True, timeout=180)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and len(lines) == 3, done.stdout[-2000:] + done.stderr[-3000:]
    for line in lines:
        assert (line["step"], line["then"]) == (5, 6), line
        assert line["digest"] == line["expected"], line
        [event] = line["events"]
        assert event["source"] == "peer_copy" and event["redone"] == 0 and event["copies_of"] == [], event
    assert sorted(line["trained"] for line in lines) == [-1, 5, 5]
