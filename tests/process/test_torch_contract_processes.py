"""torch's rendezvous and agent contract, as torch's own elastic tests exercise it.

Each scenario is rebuilt with this project's code and a real etcd, not copied from
torch's test files: nodes whose workers finish far apart (the exit barrier must not
fail the job), options torch's launchers pass, threads after ``shutdown()`` and a
fork afterwards, ``is_closed()`` after ``shutdown()``, no process-wide side effect
of creating a handler, and quarantine under plain torchrun.

Layer tests/process: real processes (elasticctl, torchrun, workers, tools). The other tests of this
subject: tests/contract/test_torch_contract.py.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.helpers import WORKERS, read_records, wait_for


DRIFT_AGENT = str(WORKERS / "drift_agent.py")
DRIFT_WORKER = str(WORKERS / "drift_worker.py")


# -- the bug: workers that drift apart --------------------------------------------------

def _release(fifo: Path) -> None:
    """Let the held worker finish; fails if nobody reads the pipe any more (it was killed)."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        assert exc.errno != errno.ENXIO, "the held worker is gone: nobody reads its pipe"
        raise
    os.write(fd, b"go")
    os.close(fd)


@pytest.mark.slow
def test_workers_that_finish_far_apart_both_succeed(default_etcd, run_id, nodes, tmp_path):
    # Node a's worker finishes at once; its exit barrier (2 s) times out and its agent shuts
    # down (done, run closed, declaration withdrawn). Node b's worker is held until then and
    # beyond: a finished node is not a lost member, so b's worker keeps running to its end.
    record, fifo = tmp_path / "record.jsonl", tmp_path / "hold"
    os.mkfifo(fifo)
    agent = [sys.executable, DRIFT_AGENT, default_etcd.endpoint, run_id, "2", "2", DRIFT_WORKER,
             "--record", str(record)]
    a = nodes("a", agent)
    b = nodes("b", [*agent, "--hold", str(fifo)])
    assert a.wait(180) == 0, a.log()
    assert "agent result: SUCCEEDED" in a.log()
    # b has seen a go (its log says why it does not restart), or it failed: then the asserts below say so.
    wait_for(lambda: b.process.poll() is not None or "finished; not a lost member" in b.log(), 60,
             "node b to see node a finish")
    assert b.process.poll() is None, b.log()
    _release(fifo)
    assert b.wait(120) == 0, b.log()
    assert "agent result: SUCCEEDED" in b.log()
    records = read_records(record)
    starts = [r for r in records if r["event"] == "start"]
    done = {r["node"]: r for r in records if r["event"] == "done"}
    assert sorted(r["node"] for r in starts) == ["a", "b"], records  # each worker started once
    assert {r["world_size"] for r in records} == {2}
    assert set(done) == {"a", "b"}, records
    assert done["b"]["pid"] == next(r["pid"] for r in starts if r["node"] == "b")


SHUTDOWN_THEN_FORK = textwrap.dedent(
    """
    import os, sys, threading
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

    endpoint, run_id = sys.argv[1:]
    before = {t.ident for t in threading.enumerate()}
    params = RendezvousParameters("etcd3", endpoint, run_id, 1, 1, local_addr="127.0.0.1")
    handler = rendezvous_handler_registry.create_handler(params)
    info = handler.next_rendezvous()          # rank 0 records the round on the history's writer
    info.store.set("k", "v")
    assert info.store.get("k") == b"v"
    assert handler.num_nodes_waiting() == 0   # a member follows the declarations from its first look
    handler.shutdown()
    left = sorted(t.name for t in threading.enumerate() if t.ident not in before)
    print("threads left:", left, flush=True)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print("child exit:", os.waitstatus_to_exitcode(status), flush=True)
    """
)


def test_shutdown_stops_every_thread_and_a_fork_afterwards_works(default_etcd, run_id):
    result = subprocess.run([sys.executable, "-c", SHUTDOWN_THEN_FORK, default_etcd.endpoint, run_id],
                            capture_output=True, text=True, timeout=120, check=False)
    assert "threads left: []" in result.stdout, result.stdout + result.stderr
    assert "child exit: 0" in result.stdout, result.stdout + result.stderr
    assert result.returncode == 0, result.stderr
    assert "skipping fork() handlers" not in result.stderr


@pytest.mark.slow
def test_plain_torchrun_on_one_node_spends_its_restarts_without_a_quarantine_pause(default_etcd, run_id, nodes,
                                                                                   tmp_path):
    # Quarantine puts a failing node aside so that the others continue; a job of one node has no
    # others: under plain torchrun its failures spend --max-restarts and nothing else.
    script = tmp_path / "fails.py"
    script.write_text("raise SystemExit(3)\n")
    node = nodes("lonely", [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1",
        "--rdzv-backend=etcd3", f"--rdzv-endpoint={default_etcd.endpoint}", f"--rdzv-id={run_id}",
        "--max-restarts=2", "--monitor-interval=0.1", "--local-addr=127.0.0.1", str(script)])
    assert node.wait(120) != 0
    log = node.log()
    assert "workers failed on their own" in log, log
    assert "quarantined" not in log, log
