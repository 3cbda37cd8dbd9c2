"""A crash at several job shapes: SIGKILL one node's whole process tree, time the survivors' first
step at the smaller world, for N nodes x W workers (3 x 1 up to 8 x 1 and 4 x 2).

A cost that depends on the shape hid behind the 3 x 1 of every other kill row: on gloo only the
dead peer's neighbours in a collective see its death at once, so beyond three workers a survivor
waited on another until the collective's timeout (the node TTL). One job per shape and system
serves every repeat: a node (never the first, which hosts the job's spec) is killed, the survivors
are timed to the smaller world, and a fresh node takes the killed one's place before the next
repeat; each repeat also says whether any survivor's generation ended by a collective's timeout
(from the nodes' logs), the cause a shape-dependent cost would have.

    python -m bench.shapes [--repeats 5] [--shapes 3x1 5x1 3x2] [--systems elasticctl-hot elasticctl]

Hot mode runs at every shape; restart mode and plain torchrun, for comparison, at the shapes
given by ``COMPARED`` (each of their recoveries restarts every worker: tens of seconds here).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import tempfile
import time
from pathlib import Path

from bench.cluster import Cluster
from bench.scenarios import EVENT_TRAINING
from elasticctl.etcd.client import EtcdClient

SHAPES = ((3, 1), (4, 1), (5, 1), (8, 1), (3, 2), (4, 2))
COMPARED = ((3, 1), (5, 1))  # shapes at which restart mode and plain torchrun run too
TARGET_S = 0.5  # hot mode: SIGKILL -> first step at the smaller world, every run, at every shape
FREEZE_MARGIN_S = 0.3  # hot mode: SIGSTOP -> first step at the smaller world within the node TTL + this
# "[d.0] generation 4 ends at step 30: RuntimeError: ... Timed out waiting 2000ms for recv operation ..."
_TIMED_OUT = re.compile(r"generation \d+ ends at step \d+: .*Timed out waiting \d+ ?ms")


def shape_name(nodes: int, per_node: int) -> str:
    return f"{nodes}x{per_node}"


def parse_shape(text: str) -> tuple[int, int]:
    """``"5x1"`` -> (5, 1); ValueError naming the text otherwise."""
    match = re.fullmatch(r"([1-9][0-9]?)x([1-8])", text)
    if not match or int(match[1]) < 3:
        raise ValueError(f"The shape '{text}' is not NODESxWORKERS with 3 to 99 nodes and 1 to 8 workers a node.")
    return int(match[1]), int(match[2])


def timed_out_lines(logs: dict[str, str], since_line: dict[str, int]) -> list[str]:
    """The lines, after each node's ``since_line``, saying a generation ended by a collective's timeout."""
    return [f"{name}: {line.strip()[:160]}" for name, text in logs.items()
            for line in text.splitlines()[since_line.get(name, 0):] if _TIMED_OUT.search(line)]


def summarize(seconds: list[float | None]) -> dict:
    """Median, min and max of the measured repeats; how many did not recover within the cap."""
    measured = [s for s in seconds if s is not None]
    return {"median_s": round(statistics.median(measured), 3) if measured else None,
            "min_s": round(min(measured), 3) if measured else None,
            "max_s": round(max(measured), 3) if measured else None,
            "n": len(seconds), "missed": len(seconds) - len(measured)}


def kill_rounds(system: str, nodes: int, per_node: int, repeats: int, workdir: Path, etcd: EtcdClient,
                cap: float, freezes: int = 0) -> dict:
    """One job of ``system`` at ``nodes`` x ``per_node``; ``repeats`` kills, each of another node
    replaced by a fresh one before the next. {"runs": [{"seconds", "timed_out"}...], **summarize};
    then ``freezes`` SIGSTOPs of a node (``"freezes"``: seconds to the smaller world each, the
    frozen node SIGCONTed and back at the full world before the next)."""
    names = [chr(ord("a") + i) for i in range(nodes)]
    up_args = ("--nproc-per-node", str(per_node)) if per_node > 1 and system != "torchrun" else ()
    cluster = Cluster(system, workdir, list(EVENT_TRAINING), etcd, nnodes=f"1:{nodes}", up_args=up_args,
                      max_restarts=repeats + 3)
    if system == "torchrun" and per_node > 1:
        raise ValueError("plain torchrun runs here at 1 worker a node")
    runs: list[dict] = []
    try:
        started = cluster.clock()
        for name in names:
            cluster.start(name)
        if cluster.wait_world(nodes * per_node, set(names), started, cap * 2) is None:
            return {"error": f"the job did not reach world {nodes * per_node} within {cap * 2:g} s", "runs": []}
        members = list(names)
        for repeat in range(repeats):
            time.sleep(1.0)  # a few steps at the full world before the kill: the event is a steady job's
            victim = members[1 + repeat % (len(members) - 1)]  # never the first node
            survivors = set(members) - {victim}
            lines_before = {n: len(cluster.nodes[n].log_path.read_text(errors="replace").splitlines())
                            for n in survivors if cluster.nodes[n].log_path.exists()}
            killed = cluster.clock()
            cluster.nodes[victim].signal_tree(signal.SIGKILL)
            cluster.nodes.pop(victim).stop()
            reached = cluster.wait_world((nodes - 1) * per_node, survivors, killed, cap)
            logs = {n: cluster.nodes[n].log_path.read_text(errors="replace") for n in survivors
                    if cluster.nodes[n].log_path.exists()}
            runs.append({"seconds": None if reached is None else round(reached - killed, 3),
                         "victim": victim, "timed_out": timed_out_lines(logs, lines_before)})
            if reached is None or (repeat == repeats - 1 and not freezes):
                break
            replacement = f"{victim}{repeat + 1}"
            members = [replacement if n == victim else n for n in members]
            back = cluster.clock()
            cluster.start(replacement)
            if cluster.wait_world(nodes * per_node, set(members), back, cap * 2) is None:
                runs[-1]["after"] = f"the replacement did not bring back world {nodes * per_node} within {cap * 2:g} s"
                break
        frozen = freeze_rounds(cluster, members, nodes, per_node, freezes, cap) if freezes and len(runs) == repeats \
            and runs[-1]["seconds"] is not None and "after" not in runs[-1] else []
    finally:
        cluster.close()
    return {"runs": runs, **summarize([r["seconds"] for r in runs] + [None] * (repeats - len(runs))),
            **({"freezes": frozen} if freezes else {})}


def freeze_rounds(cluster: Cluster, members: list[str], nodes: int, per_node: int, freezes: int,
                  cap: float) -> list[float | None]:
    """SIGSTOP a node other than the first ``freezes`` times: seconds to the survivors' first step at
    the smaller world each (None: not within ``cap``); SIGCONT, and the full world back, between."""
    seconds: list[float | None] = []
    for repeat in range(freezes):
        time.sleep(1.0)
        victim = members[1 + repeat % (len(members) - 1)]
        survivors = set(members) - {victim}
        frozen = cluster.clock()
        cluster.nodes[victim].signal_tree(signal.SIGSTOP)
        reached = cluster.wait_world((nodes - 1) * per_node, survivors, frozen, cap)
        seconds.append(None if reached is None else round(reached - frozen, 3))
        thawed = cluster.clock()
        cluster.nodes[victim].signal_tree(signal.SIGCONT)
        if reached is None or cluster.wait_world(nodes * per_node, set(members), thawed, cap * 2) is None:
            break
    return seconds


def run(repeats: int, root: Path, etcd: EtcdClient, cap: float, shapes=SHAPES, compared=COMPARED,
        systems=("elasticctl-hot", "elasticctl", "torchrun"), report=lambda line: None, freezes: int = 1) -> dict:
    """{shape name: {system: kill_rounds' result}}: hot mode at every shape (and ``freezes`` SIGSTOPs
    after its kills), the others at ``compared``."""
    out: dict = {}
    for nodes, per_node in shapes:
        name = shape_name(nodes, per_node)
        for system in systems:
            if system != "elasticctl-hot" and ((nodes, per_node) not in compared or
                                               (system == "torchrun" and per_node > 1)):
                continue
            result = kill_rounds(system, nodes, per_node, repeats, root / f"shape-{name}-{system}", etcd, cap,
                                 freezes=freezes if system == "elasticctl-hot" else 0)
            out.setdefault(name, {})[system] = result
            report(f"kill at {name}, {system}: {json.dumps({k: v for k, v in result.items() if k != 'runs'})}; "
                   f"runs {[r['seconds'] for r in result['runs']]}"
                   + (f"; timed out: {sum(bool(r['timed_out']) for r in result['runs'])}" if result["runs"] else ""))
    return out


SYSTEM_COLUMNS = (("elasticctl-hot", "elasticctl hot (s)"), ("elasticctl", "elasticctl restart (s)"),
                  ("torchrun", "plain torchrun (s)"))


def verdict(entry: dict) -> str:
    """Hot mode's target at every shape it ran: every run at most TARGET_S, none by a timeout."""
    hot = {shape: systems["elasticctl-hot"] for shape, systems in entry.items() if "elasticctl-hot" in systems}
    if not hot:
        return f"hot mode SIGKILL → first step ≤ {TARGET_S:g} s at every shape, every run: not measured"
    slow = [f"{shape} ({runs['max_s']:.2f} s)" if runs.get("max_s") is not None else f"{shape} (no value)"
            for shape, runs in hot.items() if runs.get("error") or runs.get("missed") or runs.get("max_s") is None
            or runs["max_s"] > TARGET_S]
    timed_out = [shape for shape, runs in hot.items() if any(r.get("timed_out") for r in runs.get("runs", []))]
    met = not slow and not timed_out
    return (f"hot mode SIGKILL → first step ≤ {TARGET_S:g} s at every shape, every run: "
            + ("met" if met else "missed") + f" ({len(hot)} shapes"
            + (f"; over the target: {', '.join(slow)}" if slow else "")
            + (f"; a generation ended by a collective's timeout at {', '.join(timed_out)}" if timed_out else "")
            + ")")


def freeze_verdict(entry: dict, node_ttl: float) -> str:
    """Hot mode's freeze target at every shape it froze a node: the node TTL + FREEZE_MARGIN_S."""
    target = node_ttl + FREEZE_MARGIN_S
    frozen = {shape: systems["elasticctl-hot"]["freezes"] for shape, systems in entry.items()
              if systems.get("elasticctl-hot", {}).get("freezes")}
    if not frozen:
        return f"a freeze → first step ≤ node TTL + {FREEZE_MARGIN_S:g} s: not measured"
    over = [f"{shape} ({max(v for v in values if v is not None):.2f} s)" if any(v is not None for v in values)
            else f"{shape} (no value)" for shape, values in frozen.items()
            if None in values or max(values) > target]
    return (f"a freeze → first step ≤ node TTL + {FREEZE_MARGIN_S:g} s ({target:g} s) at every shape: "
            + ("met" if not over else "missed") + f" ({len(frozen)} shapes"
            + (f"; over: {', '.join(over)}" if over else "") + ")")


def section(results: dict, cell) -> list[str]:
    """BENCHMARKS.md's table of this bench (``cell``: bench/report.py's formatting); empty for
    results without it."""
    entry = results["scenarios"].get("kill_shapes")
    if not entry:
        return []
    rows = []
    for shape, systems in entry.items():
        cells = []
        for system, _ in SYSTEM_COLUMNS:
            runs = systems.get(system)
            if runs is None:
                cells.append("—")
            elif runs.get("error"):
                cells.append(f"failed: {runs['error']}")
            else:
                seconds = [r["seconds"] for r in runs["runs"]] + [None] * (runs["n"] - len(runs["runs"]))
                cells.append(cell(seconds, None, digits=3))
        hot = systems.get("elasticctl-hot") or {}
        timed_out = sum(bool(r.get("timed_out")) for r in hot.get("runs", []))
        maximum = hot.get("max_s")
        frozen = cell(hot["freezes"], None, digits=3) if hot.get("freezes") else "—"
        rows.append(f"| {shape.replace('x', ' × ')} | {' | '.join(cells)} | "
                    f"{'—' if maximum is None else f'{maximum:.3f}'} | {timed_out} of {len(hot.get('runs', []))} "
                    f"| {frozen} |")
    return [
        "### A crash at every shape: SIGKILL of one node → first step at the smaller world",
        "",
        ("`bench/shapes.py`: nodes × workers a node on 127.0.0.1, `trainers/mlp.py` "
         f"(`{' '.join(EVENT_TRAINING)}`), node TTL {results['settings'].get('node_ttl_s', 2):g} s. One job per "
         "shape and system: a node other than the first is SIGKILLed (its whole process tree), the "
         "survivors are timed from the signal to the latest of their first steps at the smaller world, "
         "and a fresh node takes the killed one's place before the next repeat. Restart mode and plain "
         "torchrun run at 3 × 1 and 5 × 1 for comparison. Cells: median (min–max, n). \"Ended by a "
         "timeout\" counts the hot repeats in which some survivor's generation ended by its collective's "
         "timeout (the node TTL) rather than by a peer's closed connection. After its kills, each hot job "
         "SIGSTOPs a node (noticed by its lease, at the node TTL) and SIGCONTs it."),
        "",
        "| nodes × workers | " + " | ".join(label for _, label in SYSTEM_COLUMNS)
        + " | hot: max (s) | hot: ended by a timeout | hot: SIGSTOP → smaller world (s) |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Targets: {verdict(entry)}; {freeze_verdict(entry, results['settings'].get('node_ttl_s', 2))}.",
        "",
    ]


def main() -> None:
    from elasticctl.embedded_etcd import EmbeddedEtcd

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cap", type=float, default=60.0)
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=list(SHAPES))
    parser.add_argument("--systems", nargs="+", default=["elasticctl-hot", "elasticctl", "torchrun"])
    parser.add_argument("--output", type=Path, default=None, help="write the results JSON here")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ecshapes-"))
    with EmbeddedEtcd(data_dir=str(root / "etcd"), client_port=0, peer_port=0) as etcd, \
            EtcdClient(etcd.client_settings()) as client:
        results = run(args.repeats, root, client, args.cap, shapes=args.shapes, systems=args.systems,
                      report=lambda line: print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True))
    if args.output:
        args.output.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
