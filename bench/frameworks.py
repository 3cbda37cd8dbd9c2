"""A framework's own script under elasticctl, beside the bundled trainer: the seconds from a node's
SIGKILL to the first step at the smaller world, in restart mode and (for a loop of one's own) in
hot mode, in the same run.

Each system runs a job of two nodes (``elasticctl up --nnodes 1:2`` and ``join``, one worker
each) on a fresh embedded etcd, trains at world 2, then node b is SIGKILLed with its whole process
tree; the time is taken from the kill to the first step node a trains at world 1 (from the
script's own record: the bundled trainer's ``--record``, the integration's sample ledger). Both
checkpoint every 10 steps. Systems (none pauses between steps but the bundled trainer):

* ``lightning``: docs/examples/lightning_trainer.py (Lightning's tutorial form on
  ``elasticctl.integrations.lightning.Trainer``), restart mode;
* ``huggingface``: docs/examples/huggingface_trainer.py (transformers' ``Trainer`` on
  ``elasticctl.integrations.huggingface``), restart mode;
* ``fabric-hot``: docs/examples/fabric_loop.py (a Fabric loop), ``--recovery hot``;
* ``accelerate-hot``: docs/examples/accelerate_loop.py (an accelerate loop), ``--recovery hot``;
* ``bundled``, ``bundled-hot``: trainers/mlp.py, 0.05 s a step (the event scenarios' trainer),
  in each mode.

Restart mode restarts every worker: most of these seconds are the new workers' start (Python,
torch, the framework's import) and the checkpoint's load; the framework's import is the
difference. Hot mode keeps the survivor's process: its seconds are the re-formation. ``python -m bench.frameworks [--repeats N]``; ``python -m bench.run --only
frameworks`` puts the rows in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import Node, stop_nodes, wait_for
from elasticctl.embedded_etcd import EmbeddedEtcd
from elasticctl.etcd.client import EtcdClient
from elasticctl.job.registry import Registry

REPO = Path(__file__).resolve().parents[1]
ELASTICCTL = [sys.executable, "-m", "elasticctl.cli"]
SYSTEMS = ("lightning", "huggingface", "fabric-hot", "accelerate-hot", "bundled", "bundled-hot")
NEEDS = {"lightning": ("lightning",), "fabric-hot": ("lightning",), "huggingface": ("transformers", "accelerate"),
         "accelerate-hot": ("transformers", "accelerate")}  # the packages each system imports
EXAMPLES = REPO / "docs" / "examples"
STEPS_AT_WORLD_2 = 20  # steps both nodes train before the kill (past the first checkpoints)
TIMEOUT = 240.0


def script_of(system: str, record: Path) -> tuple[list[str], dict[str, str]]:
    """``up``'s recovery flags, the script and its arguments, and the environment its nodes need."""
    ledger = {"ELASTICCTL_SAMPLE_LEDGER": str(record)}
    hot = ["--recovery", "hot"] if system.endswith("-hot") else []
    if system == "lightning":
        return [str(EXAMPLES / "lightning_trainer.py"), "--max-epochs", "100000"], ledger
    if system == "huggingface":
        return [str(EXAMPLES / "huggingface_trainer.py"), "--epochs", "100000"], ledger
    if system == "fabric-hot":
        return [*hot, str(EXAMPLES / "fabric_loop.py"), "--epochs", "100000"], ledger
    if system == "accelerate-hot":
        return [*hot, str(EXAMPLES / "accelerate_loop.py"), "--epochs", "100000"], ledger
    return ([*hot, str(REPO / "trainers" / "mlp.py"), "--steps", "10000000", "--step-sleep", "0.05",
             "--log-every", "0", "--checkpoint-every", "10", "--record", str(record)], {})


def steps(record: Path) -> list[dict]:
    """The step lines of a record or ledger (every rank's), complete lines only."""
    if not record.exists():
        return []
    text = record.read_text()
    lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
    found = []
    for line in lines:
        entry = json.loads(line)
        if "event" not in entry and "time" in entry:
            found.append(entry)
    return found


def measure(system: str, workdir: Path, etcd: EmbeddedEtcd) -> dict:
    """One job of ``system`` through a kill of node b: a row of seconds (None where it did not get there)."""
    record, checkpoints = workdir / "record.jsonl", workdir / "checkpoints"
    script, env = script_of(system, record)
    job = f"bench-{system}-{workdir.name}"
    row: dict = {"system": system, "kill_to_step_s": None, "cold_start_s": None, "error": None}
    began = time.time()
    up = [*ELASTICCTL, "up", "--etcd", etcd.endpoint, "--job", job, "--nnodes", "1:2", "--node-id", "a",
          "--checkpoint-dir", str(checkpoints), *script]
    nodes = [Node("a", up, workdir, env, cwd=workdir)]
    try:
        with EtcdClient(etcd.client_settings()) as client:
            if not wait_for(Registry(client, job).read_spec, 60):
                row["error"] = "no job spec within 60 s"
                return row
        nodes.append(Node("b", [*ELASTICCTL, "join", "--etcd", etcd.endpoint, "--job", job, "--node-id", "b"],
                          workdir, env, cwd=workdir))
        at_2 = wait_for(lambda: [s for s in steps(record) if s["world_size"] == 2], TIMEOUT)
        if not at_2:
            row["error"] = f"no step at world 2 within {TIMEOUT:g} s"
            return row
        row["cold_start_s"] = round(at_2[0]["time"] - began, 2)
        first = at_2[0]["step"]
        if not wait_for(lambda: any(s["world_size"] == 2 and s["step"] >= first + STEPS_AT_WORLD_2
                                    for s in steps(record)), TIMEOUT):
            row["error"] = f"not {STEPS_AT_WORLD_2} steps at world 2 within {TIMEOUT:g} s"
            return row
        killed = time.time()
        nodes[1].kill()
        alone = wait_for(lambda: [s for s in steps(record) if s["world_size"] == 1 and s["time"] > killed], TIMEOUT)
        if not alone:
            row["error"] = f"no step at world 1 within {TIMEOUT:g} s of the kill"
            return row
        row["kill_to_step_s"] = round(alone[0]["time"] - killed, 2)
        # the last step trained at world 2, by either rank (a step in flight at the kill may end after it)
        trained = max(s["step"] for s in steps(record) if s["world_size"] == 2 and s["time"] <= alone[0]["time"])
        row["steps_lost"] = trained + 1 - alone[0]["step"]  # trained before the kill, trained again after
        return row
    finally:
        stop_nodes(nodes)


def available() -> tuple[str, ...]:
    """The systems this machine can run: a framework's need its extra installed."""
    import importlib.util

    return tuple(system for system in SYSTEMS
                 if all(importlib.util.find_spec(package) for package in NEEDS.get(system, ())))


def run(repeats: int, root: Path, etcd: EmbeddedEtcd, report=print) -> list[dict]:
    """``repeats`` rows of each system this machine can run, interleaved, on ``etcd``."""
    rows = []
    for repeat in range(1, repeats + 1):
        for system in available():
            workdir = root / f"frameworks-{system}-{repeat}"
            workdir.mkdir(parents=True)
            row = {**measure(system, workdir, etcd), "repeat": repeat}
            rows.append(row)
            report(f"frameworks {system}, repeat {repeat}: {describe(row)}")
    return rows


def describe(row: dict) -> str:
    if row.get("error"):
        return f"failed: {row['error']}"
    return (f"SIGKILL -> first step at world 1 {row['kill_to_step_s']} s, steps trained again "
            f"{row['steps_lost']}, cold start to world 2 {row['cold_start_s']} s")


def summary_rows(rows: list[dict]) -> list[tuple[str, str, str, str, str]]:
    """Per system: (system, runs complete, median kill → step (min–max), median cold start,
    steps trained again (median))."""
    out = []
    for system in SYSTEMS:
        mine = [row for row in rows if row["system"] == system]
        good = [row for row in mine if row.get("kill_to_step_s") is not None]
        if not mine:
            continue
        seconds = [row["kill_to_step_s"] for row in good]
        cold = [row["cold_start_s"] for row in good if row.get("cold_start_s") is not None]
        lost = [row["steps_lost"] for row in good]
        out.append((system, f"{len(good)} of {len(mine)}",
                    f"{statistics.median(seconds):.2f} ({min(seconds):.2f}–{max(seconds):.2f})" if seconds else "—",
                    f"{statistics.median(cold):.2f}" if cold else "—",
                    f"{statistics.median(lost):g}" if lost else "—"))
    return out


def section(results: dict) -> list[str]:
    """BENCHMARKS.md's table of this bench; empty for results without it."""
    rows = results["scenarios"].get("frameworks")
    if not rows:
        return []
    return [
        "## A framework's own script through a node's SIGKILL",
        "",
        ("`bench/frameworks.py` (`python -m bench.run --only frameworks`): two nodes, one worker each "
         "(`elasticctl up --nnodes 1:2` and `join`), checkpoints every 10 steps, on one etcd; "
         f"after {STEPS_AT_WORLD_2} steps at world 2 node b is SIGKILLed with its process tree. Seconds from "
         "the kill to the first step node a trains at world 1 (the script's own record), and the steps "
         "trained before the kill that the resume trains again (since the newest checkpoint). Restart mode: "
         "`lightning` (docs/examples/lightning_trainer.py, Lightning's tutorial form on elasticctl's "
         "`Trainer`) and `huggingface` (docs/examples/huggingface_trainer.py, transformers' `Trainer`); hot "
         "mode (`--recovery hot`, the survivor keeps its process): `fabric-hot` (docs/examples/fabric_loop.py) "
         "and `accelerate-hot` (docs/examples/accelerate_loop.py); `bundled` and `bundled-hot`: "
         "trainers/mlp.py at 0.05 s a step, the others with no pause. The systems run interleaved. Cells: "
         "median (min–max) of the runs that got there."),
        "",
        "| script | runs complete | SIGKILL → first step at world 1 (s) | cold start to world 2 (s) "
        "| steps trained again |",
        "|---|---|---|---|---|",
        *[f"| {' | '.join(row)} |" for row in summary_rows(rows)],
        "",
    ]


def text_lines(results: dict) -> list[str]:
    return [f"frameworks, {system}: {complete} complete, SIGKILL -> first step at world 1 {seconds} s, "
            f"cold start {cold} s, steps trained again {lost}"
            for system, complete, seconds, cold, lost in summary_rows(results["scenarios"].get("frameworks") or [])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-frameworks-") as root, \
            EmbeddedEtcd(data_dir=str(Path(root) / "etcd"), client_port=0, peer_port=0) as etcd:
        rows = run(args.repeats, Path(root), etcd)
    for row in summary_rows(rows):
        print(" | ".join(row))


if __name__ == "__main__":
    main()
