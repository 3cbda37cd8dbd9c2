"""What the tests and the benchmarks share to run jobs of real processes and read what they did.

One host's launcher and its process tree (:class:`Node`: faults are signals to the tree, and a
test's or a bench's end freezes then kills every tree at once, :func:`stop_nodes`); the trainer's
JSON-lines record read as it grows (:class:`Record`); polling with a deadline (:func:`wait_for`);
and the one rule for "these nodes train together at this world size"
(:func:`trained_together`), which every wait for a world uses, in the tests
(``tests/support``) and in the benchmarks (``bench/cluster.py`` and the benches on it) alike.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil

from elasticctl import processes


def wait_for(predicate: Callable[[], object], timeout: float, interval: float = 0.05,
             give_up: Callable[[], bool] = lambda: False):
    """Poll ``predicate`` until it returns something truthy; None after ``timeout`` s or once ``give_up()``."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline or give_up():
            return None
        time.sleep(interval)


def step_lines(records: Iterable[dict], since: float = 0.0, world: int | None = None) -> list[dict]:
    """The step lines of a record (not its events) after ``since``, at ``world`` workers if given."""
    return [r for r in records if "event" not in r and r.get("time", 0) > since
            and (world is None or r.get("world_size") == world)]


def trained_together(records: Iterable[dict], world: int, nodes: set[str], *, since: float = 0.0,
                     after_generation: int = -1, workers_per_node: int = 1,
                     exactly: bool = False) -> list[dict] | None:
    """The step lines at ``world`` workers after ``since`` (of generations after ``after_generation``)
    once every node in ``nodes`` had ``workers_per_node`` workers (processes) train there; None
    before. ``exactly``: only generations whose lines come from exactly ``nodes``, each with
    ``workers_per_node`` workers, count (and only their lines are returned).

    ``after_generation`` keeps out a thawed node's lines of the generation it was frozen in: it may
    still write one at the old world after the SIGCONT, which is no sign of the new world."""
    recent = [r for r in step_lines(records, since, world) if r.get("generation", 0) > after_generation]
    if exactly:
        by_generation: dict[object, list[dict]] = collections.defaultdict(list)
        for r in recent:
            by_generation[r.get("generation")].append(r)
        recent = [r for lines in by_generation.values() if _workers(lines) == {n: workers_per_node for n in nodes}
                  for r in lines]
        return recent or None
    counts = _workers(r for r in recent if r["node"] in nodes)
    return recent if set(counts) == nodes and all(c >= workers_per_node for c in counts.values()) else None


def _workers(lines: Iterable[dict]) -> dict[str, int]:
    """How many workers (processes) of each node wrote these lines."""
    return dict(collections.Counter(node for node, _ in {(r["node"], r.get("pid")) for r in lines}))


class Record:
    """The trainer's JSON-lines record, read incrementally (it grows by thousands of lines)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: list[dict] = []
        self._offset = 0

    def read(self) -> list[dict]:
        if self.path.exists():
            with open(self.path, "rb") as file:
                file.seek(self._offset)
                chunk = file.read()
            end = chunk.rfind(b"\n") + 1  # a line being written now is read next time
            for line in chunk[:end].splitlines():
                try:
                    self.lines.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # interleaved writes of two ranks: rare, and one step more or less does not matter
            self._offset += end
        return self.lines

    def steps(self, since: float = 0.0, world: int | None = None) -> list[dict]:
        return step_lines(self.read(), since, world)


class Node:
    """One host's launcher process (torchrun or elasticctl) and its whole process tree."""

    def __init__(self, name: str, command: list[str], log_dir: Path, env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.name = name
        self.command = command
        self.log_path = log_dir / f"{name}.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "ELASTICCTL_NODE": name, **(env or {})}
        with open(self.log_path, "ab") as log:
            self.process = processes.spawn(command, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=cwd)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.process.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def signal_tree(self, sig: int) -> None:
        """Signal the launcher and every descendant (torchrun puts workers in sessions of their own)."""
        for proc in self.tree():
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                pass

    def kill(self) -> None:
        """SIGKILL the launcher and every worker: a machine that died."""
        self.signal_tree(signal.SIGKILL)
        self.process.wait(10)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)

    def stop(self) -> None:
        """End the node at a test's or a bench's end (:func:`stop_nodes`)."""
        stop_nodes([self])


def ended(proc: psutil.Process) -> bool:
    """Whether ``proc`` has exited. A zombie has: its memory, files and ports are released, and
    only its exit status waits for its parent to collect. An orphan's parent is init, and an init
    may collect its zombies seconds later (this project's 2-core test VM: about every 2 s)."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_ended(procs: Iterable[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until every one of ``procs`` has exited (:func:`ended`); those still running after
    ``timeout`` s. (``psutil.wait_procs`` waits until a zombie is collected.)"""
    procs = list(procs)
    wait_for(lambda: all(ended(p) for p in procs), timeout, interval=0.02)
    return [p for p in procs if not ended(p)]


def stop_nodes(nodes: Iterable[Node]) -> None:
    """End ``nodes`` at once: every tree frozen first (no process forks a new one or notices the
    others go), then every tree SIGKILLed. A graceful leave is what some tests assert; at the end
    it only cost seconds per node, one node after the other."""
    nodes = list(nodes)
    trees = []
    for node in nodes:
        node.signal_tree(signal.SIGSTOP)
        trees.extend(node.tree())
    for node in nodes:
        node.signal_tree(signal.SIGKILL)
    for proc in trees:  # workers orphaned by a killed launcher are no longer in its tree
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    wait_ended(trees, timeout=10)
    for node in nodes:
        try:
            node.process.wait(10)
        except subprocess.TimeoutExpired:
            pass
