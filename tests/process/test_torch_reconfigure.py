"""What elasticctl relies on in torch's in-place process-group reconfiguration (experimental in
torch 2.14), pinned with real processes on gloo: a change in torch fails here, loudly, before
it fails a job. The runtime uses it through elasticctl.train.groups.reconfigure only.

Relied on: a group made alone reconfigures into a generation over its members' handles, on a
store each generation replaces (generation 1's store leaves with its host, the next generation
meets on a survivor's); the members that stay reconfigure the same group object over
themselves; a brand-new process joins the same way; one DDP module built at the start, wrapped
without its start's collectives, averages its gradients over the live world after a shrink and
after a growth; after a peer's death the survivors reconfigure too. (torch refuses only the
uuid a group holds now, not every one it held: each generation's number is its uuid, never reused.)

Known, and what the runtime does about it (elasticctl.train.groups.reconfigure.group_strategy): on gloo
a peer's death reaches only the collectives that wait on it directly, and neither ``abort()`` nor
a reconfigure closes a survivor's connections, so a survivor waiting on another survivor waits
out the timeout; and ``abort()`` does not release a collective pending on a frozen peer. So the
survivor that sees a failure shuts the generation's connections down (``shutdown(2)``:
elasticctl.train.groups.connections), which releases every survivor waiting on it at once, and the
group is rebuilt; a freeze still costs the collective timeout (the node TTL). Both
are pinned: when torch changes either, a test here fails and the rule can change with it. A
survivor whose own collective timed out (gloo's "Timed out waiting ... for recv operation",
:func:`elasticctl.train.groups.reconfigure.is_collective_timeout`, pinned against both errors) keeps
its group: a group recovers from a timed-out collective by a reconfigure.

Layer tests/process: real processes. The pure choice of reconfigure or rebuild:
tests/unit/test_reconfigure.py.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys

import pytest
import torch.distributed as dist
from support.helpers import WORKERS

from elasticctl.train.groups.reconfigure import is_collective_timeout, torch_can_reconfigure

PROBE = str(WORKERS / "reconfigure_probe.py")
MESH_PROBE = str(WORKERS / "reconfigure_mesh_probe.py")
pytestmark = pytest.mark.skipif(not torch_can_reconfigure(), reason="this torch has no in-place reconfiguration")


class Probe:
    def __init__(self, scenario: str, waiters: str) -> None:
        self.coord = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=60))
        self.scenario, self.waiters = scenario, waiters
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self, name: str, **env: str) -> subprocess.Popen:
        self.processes[name] = subprocess.Popen(
            [sys.executable, PROBE, str(self.coord.port), name, self.scenario, self.waiters],
            env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return self.processes[name]

    def result(self, name: str, what: str):
        return json.loads(self.coord.get(f"result/{name}/{what}"))

    def output(self) -> str:
        return "\n".join(f"--- {name} (exit {p.poll()}):\n{p.stdout.read() if p.poll() is not None else ''}"
                         for name, p in self.processes.items())

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
            process.wait()


@pytest.fixture
def probe():
    made: list[Probe] = []
    yield lambda scenario, waiters: made.append(Probe(scenario, waiters)) or made[-1]
    for one in made:
        one.stop()


def _formed(probe: Probe, name: str, number: int, members: str) -> None:
    formed = probe.result(name, f"g{number}")
    assert (formed["rank"], formed["world"], formed["same_group"]) == (members.index(name), len(members), True), formed


def test_one_group_shrinks_and_grows_in_place_and_ddp_follows_the_live_world(probe):
    churn = probe("churn", "a,b,d")
    for name in "abcd":
        churn.start(name)
    try:
        for name in "abc":
            _formed(churn, name, 1, "abc")
            assert churn.result(name, "grad1") == 2.0  # (1 + 2 + 3) / 3
        assert churn.processes["c"].wait(60) == 0, churn.output()  # gone, and generation 1's store with it
        for name in "ab":
            _formed(churn, name, 2, "ab")
            assert churn.result(name, "grad2") == 1.5  # (1 + 2) / 2: the same DDP, the live world
        for name in "abd":
            _formed(churn, name, 3, "abd")
            assert churn.result(name, "grad3") == 2.0  # the newcomer's fresh DDP and the survivors' own
        for name in "abd":
            assert churn.processes[name].wait(60) == 0, churn.output()
    except Exception:
        print(churn.output())
        raise


def test_a_peer_death_reaches_only_the_collectives_that_wait_on_it(probe):
    # Why the runtime rebuilds the group after a failure, and reconfigures it only for a change
    # agreed at a boundary: the survivor whose collective waits on the dead peer raises at once,
    # but one that waits on that survivor waits out the timeout, since neither a revoke nor a
    # reconfigure closes the first survivor's connections (destroying its group does). If this
    # fails with both raising at once, torch now propagates the failure: reconfigure after one too.
    failure = probe("failure", "a,b")
    for name in "abc":
        failure.start(name, PROBE_PG_TIMEOUT="4")
    try:
        lost = sorted((failure.result(name, "lost_peer") for name in "ab"), key=lambda one: one["seconds"])
        assert all(one["raised"] for one in lost), lost
        assert lost[0]["seconds"] < 2.0, lost  # the dead peer's neighbour in the ring
        assert lost[1]["seconds"] > 3.0, lost  # the other: its 4 s timeout, not the neighbour's failure
        # What the runtime reads to keep a group after a failure (train/worker/lifecycle.py): a timeout, not a loss
        assert [is_collective_timeout(RuntimeError(one["error"])) for one in lost] == [False, True], lost
        for name in "ab":
            _formed(failure, name, 2, "ab")  # and the group recovers by a reconfigure all the same
            assert failure.result(name, "sum2") == 2.0
            assert failure.processes[name].wait(60) == 0, failure.output()
    except Exception:
        print(failure.output())
        raise


def test_a_survivor_that_shuts_its_connections_down_releases_every_peer_waiting_on_it(probe):
    # What elasticctl.train.groups.connections relies on: shutdown(2) of a survivor's ends of the failed
    # generation's connections reaches every peer whose collective waits on it as a closed
    # connection, at once; so each survivor that raises passes the failure on, across the whole
    # world (four members: one survivor never waits on the dead peer directly). The group whose
    # connections were shut down still comes down cleanly (each probe exits 0).
    severed = probe("severed", "a,b,c")
    for name in "abcd":
        severed.start(name, PROBE_PG_TIMEOUT="20")
    try:
        lost = [severed.result(name, "lost_peer") for name in "abc"]
        assert all(one["raised"] for one in lost), lost
        assert not any(is_collective_timeout(RuntimeError(one["error"])) for one in lost), lost  # not the 20 s
        # the first to raise shut its connections down; the last may find its peers' ends closed already
        assert max(one["severed"] for one in lost) > 0, lost
        for name in "abc":
            assert severed.processes[name].wait(60) == 0, severed.output()
    except Exception:
        print(severed.output())
        raise


def test_a_revoke_does_not_release_a_collective_pending_on_a_frozen_gloo_peer(probe):
    # If this fails because the collective was released at once, torch now revokes gloo
    # collectives: elasticctl.train.groups.lost_member_abort can abort on gloo too, and hot mode's collective
    # timeout need no longer equal the node TTL.
    freeze = probe("freeze", "a")
    a = freeze.start("a", PROBE_PG_TIMEOUT="4")
    b = freeze.start("b", PROBE_PG_TIMEOUT="4")
    try:
        freeze.coord.get("b/ready")
        os.kill(b.pid, signal.SIGSTOP)
        freeze.coord.set("b/stopped", "1")
        revoked = freeze.result("a", "revoked")
        assert revoked["raised"], revoked  # ended by the group's timeout, which still holds
        assert revoked["seconds"] > 2.0, revoked  # 4 s timeout, revoked 0.5 s in: not released by the revoke
        assert is_collective_timeout(RuntimeError(revoked["error"])), revoked  # a freeze reads as a timeout
        assert freeze.result("a", "g2")["world"] == 1  # and the group recovers by a reconfigure
        assert freeze.result("a", "alone") == 1.0
        assert a.wait(60) == 0, freeze.output()
    except Exception:
        print(freeze.output())
        raise
    finally:
        os.kill(b.pid, signal.SIGCONT)


def test_an_hsdp_mesh_of_reconfigured_groups_outlives_a_join_and_a_leave():
    # What a sharded model's mesh needs to outlive generations (run(..., sharded="hsdp")): a group made by new_group on a reconfigurable default group is reconfigurable
    # too; a mesh made from such groups (DeviceMesh.from_group) keeps serving the FSDP2 module
    # wrapped on it once while its groups are reconfigured in place; and FSDP2 averages over the
    # live groups' sizes, whatever size the mesh was made with. See reconfigure_mesh_probe.py.
    coord = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    processes = {name: subprocess.Popen([sys.executable, MESH_PROBE, str(coord.port), name],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for name in ("a0", "a1", "b0", "b1")}

    def result(name: str, what: str):
        return json.loads(coord.get(f"result/{name}/{what}"))

    try:
        for name in processes:
            assert result(name, "inherit") == [True, True]
        for name in ("a0", "a1"):
            assert result(name, "grad1") == [1.5]  # (1 + 2) / 2: node a alone
        for name in processes:
            assert result(name, "grad2") == [2.5]  # (1 + 2 + 3 + 4) / 4: b's workers on a's mesh groups
        assert len({result(name, "weights2") for name in processes}) == 1  # one state: b got a's shards
        # torch's bookkeeping of the groups' members, which a reconfigure leaves stale and MeshGroups
        # sets (get_rank(group), get_process_group_ranks, c10d's error reporting read it)
        assert [result(name, "bookkeeping2") for name in ("a0", "a1", "b0", "b1")] == [
            [0, 0, [0, 2], [0, 1]], [0, 1, [1, 3], [0, 1]], [1, 0, [0, 2], [2, 3]], [1, 1, [1, 3], [2, 3]]]
        for name in ("a0", "a1"):
            assert result(name, "grad3") == [1.5]  # b gone: the mesh made at 1 x 2 and used at 2 x 2, live size
            assert result(name, "kept") is True  # the same mesh and module objects all along
            assert result(name, "sizes") == [2, 1, 2]
        for name, process in processes.items():
            assert process.wait(60) == 0, f"{name}: {process.stdout.read()}"
    except Exception:
        for name, process in processes.items():
            if process.poll() is None:
                process.kill()
            print(f"--- {name} (exit {process.wait()}):\n{process.stdout.read()}")
        raise
