"""Turn one run's raw results (the JSON in bench/results/) into the table of BENCHMARKS.md.

Every cell is median (min–max) over the repeats; the ratios are elasticctl hot
mode's median over plain torchrun's and over elasticctl restart mode's. A run
that never recovered within its cap counts as "none within N s", and a ratio
against it is an upper bound. Results from before hot mode have no elasticctl-hot
samples: their cells say "not measured".

The rendezvous scale table reads both results formats: entries with "etcd3" and
"c10d" lists only (before the etcd3-dynamic backend; its column then says "not run"),
and entries with a list per backend that ran at that size.
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
from pathlib import Path

from bench import reconfigure as reconfigure_bench
from bench import frameworks as frameworks_bench
from bench import shapes as shapes_bench
from bench import stragglers as straggler_bench
from bench import trust as trust_bench
from elasticctl.train.recovery.timeline import PHASE_NAMES

REPO = Path(__file__).resolve().parents[1]
RESTART, HOT, TORCHRUN = "elasticctl", "elasticctl-hot", "torchrun"
SYSTEMS = (RESTART, HOT, TORCHRUN)
# The rendezvous scale table: elasticctl's handler, the previous main's (torch's dynamic
# handler on elasticctl's EtcdRendezvousBackend), torch's c10d.
ETCD3, DYNAMIC, C10D = "etcd3", "etcd3-dynamic", "c10d"
# The rendezvous round's targets on the 2-core machine: (agents, seconds).
ROUND_TARGETS = ((256, 3.0), (1000, 10.0))
WRITES_TARGET = 3.0  # etcd writes per round per agent
# The simulated agents' targets (bench/rdzv_light.py) on the 2-core machine.
LIGHT_TARGET = (10000, 10.0, 2.2)  # agents, seconds for one round, etcd writes per agent
HOT_REFORM_TARGET = (1000, 1.0, 5.0)  # workers, seconds to the next generation, watch events per worker
REAL_HANDLER_TARGET = (1000, 12.0)  # real torchrun handlers, median seconds of one round (every round complete)
# Hot mode's targets, 3 nodes x 1 process (seconds unless said).
HOT_CRASH_TARGET = 0.3       # SIGKILL -> first step at world 2 (tightened from 1.5 s)
HOT_FREEZE_MARGIN = 0.5      # SIGSTOP -> first step at world 2, beyond the node TTL (tightened from 1.5 s)
HOT_PAUSE_TARGET = 1.0       # running workers' pause to admit a joiner
HOT_JOINER_TARGET = 1.0      # joiner: `initialized` -> its first step
HOT_REDONE_TARGET = 1        # steps re-done per failure
HOT_STEADY_TARGET = 0.98     # steady steps/s, fraction of restart mode's
HOT_SPARE_TARGET = 1.0       # hot spares: SIGKILL with one spare -> first step back at world 3
# The sharded models' targets, 2-core CPU, gloo.
HSDP_KILL_TARGET = 2.0        # HSDP 3 x 2: SIGKILL of a node -> first step at the smaller world
HSDP_FREEZE_MARGIN = 1.0      # HSDP 3 x 2: SIGSTOP of a node -> first step at the smaller world, beyond the node TTL
HSDP_JOIN_MARGIN = 0.3        # a joining node's pause of the others <= its shards' transfer + this
PEER_COPY_TARGET = (3.0, 10)  # FSDP2 with peer copies every 10 steps: seconds, steps re-done at most
TRANSFER_TARGET = 0.7         # state transfer >= this x the raw gloo broadcast of the same bytes
TRANSFER_TARGET_MB = (512, 2048)


def _stats(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def _cell(samples: list[float | None], cap: float | None, unit: str = "s", digits: int = 1) -> str:
    done = [v for v in samples if v is not None]
    missed = len(samples) - len(done)
    if not samples:
        return "not measured"
    if not done:
        return f"none within {cap:g} {unit} ({missed}/{missed})" if cap else f"failed ({missed}/{missed})"
    s = _stats(done)
    text = f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f}, n={s['n']})"
    if missed:
        text += f"; {missed} of {len(samples)} none within {cap:g} {unit}" if cap else f"; {missed} failed"
    return text


def _ratio(ours: list[float | None], theirs: list[float | None], cap: float | None) -> str:
    ours_done = [v for v in ours if v is not None]
    theirs_done = [v for v in theirs if v is not None]
    if not ours_done or not theirs:  # no samples at all: not measured, no bound either
        return "—"
    if not theirs_done:  # torchrun never got there: its time is at least the cap
        return f"< {_two_digits(statistics.median(ours_done) / cap)}" if cap else "—"
    theirs_median = statistics.median(theirs_done)
    if theirs_median == 0:  # e.g. no step re-done: no ratio to speak of
        return "—"
    return _two_digits(statistics.median(ours_done) / theirs_median)


def _two_digits(ratio: float) -> str:
    """0.28, 0.012, 0.0026: two significant digits below 1, so a small ratio never reads 0.00."""
    return f"{ratio:.2f}" if ratio >= 0.1 else f"{ratio:.2g}"


def _field(runs: list[dict], *path: str) -> list[float | None]:
    values = []
    for run in runs:
        value = run
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        values.append(value)
    return values


def _has(runs: list[dict], path: tuple[str, ...]) -> bool:
    """Some run has ``path`` (a None value included: a scenario that ran and did not get there)."""
    for run in runs:
        value = run
        for key in path:
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            return True
    return False


def _cap(runs: list[dict], *path: str) -> float | None:
    caps = [c for c in _field(runs, *path) if c is not None]
    return max(caps) if caps else None


def rows(results: dict) -> list[tuple[str, str, str, str, str, str]]:
    """(measurement, elasticctl restart, elasticctl hot, torchrun, ratio hot/torchrun, ratio hot/restart)
    for every scenario that ran."""
    out = []
    scenarios = results["scenarios"]

    def paired(label: str, scenario: str, path: tuple[str, ...], cap_path: tuple[str, ...] | None = None,
               digits: int = 1, unit: str = "s") -> None:
        runs = scenarios.get(scenario)
        if not runs:
            return
        samples = {system: runs.get(system, []) for system in SYSTEMS}
        cap = _cap([run for system in SYSTEMS for run in samples[system]], *cap_path) if cap_path else None
        # A field no sample has was not measured (results from before it existed): no "failed" cell.
        restart, hot, torchrun = (_field(samples[system], *path) if _has(samples[system], path) else []
                                  for system in SYSTEMS)
        out.append((label, *(_cell(values, cap, unit, digits) for values in (restart, hot, torchrun)),
                    _ratio(hot, torchrun, cap), _ratio(hot, restart, cap)))

    every = results["settings"]["checkpoint_every"]
    paired("Crash: SIGKILL node c → first step at world 2 (s)", "lifecycle", ("crash", "seconds"),
           ("crash", "cap_s"))
    paired(f"Crash: steps re-done after resume (checkpoint every {every})", "lifecycle",
           ("crash", "redone_steps"), digits=0, unit="steps")
    paired("Crash of node a (torchrun: c10d store host; elasticctl: ran `up`) → world 2 (s)", "crash_host",
           ("seconds",), ("cap_s",))
    paired("Spare: SIGKILL node c, node d waiting as a spare → first step back at world 3 (s)", "spare",
           ("seconds",), ("cap_s",), digits=2)
    paired("Freeze: SIGSTOP node b → first step at world 2 (s)", "lifecycle", ("freeze", "seconds"),
           ("freeze", "cap_s"))
    paired("Scale-up: start node d → first step at world 3 (s)", "lifecycle", ("scale_up", "seconds"),
           ("scale_up", "cap_s"))
    paired("Scale-up: running workers' pause, rank 0's last step at world 2 → its first at world 3 (s)",
           "lifecycle", ("scale_up", "pause_s"), ("scale_up", "cap_s"), digits=2)
    paired("Scale-up: joiner's first step after its worker's first generation formed (`initialized`, s)",
           "lifecycle", ("scale_up", "joiner_after_initialized_s"), digits=2)
    paired("Scale-up: joiner's first step after its worker process started (s)", "lifecycle",
           ("scale_up", "joiner_after_process_start_s"), ("scale_up", "cap_s"))
    paired("Freeze: steps re-done after resume", "lifecycle", ("freeze", "redone_steps"), digits=0,
           unit="steps")
    paired("Steady state, world 3, no events (steps/s)", "steady", ("steps_per_s",), digits=1)
    paired("Cold start: 3 nodes → all training at world 3 (s)", "lifecycle", ("cold_start_s",))

    return out


GOODPUT_LABELS = {"torchrun": "plain torchrun", "elasticctl": "elasticctl restart", "elasticctl-hot": "elasticctl hot",
                  "elasticctl-hot-spare": "elasticctl hot + 1 spare"}


OLD_GOODPUT_NODES = 3  # results from before the goodput bench ran more than one shape ran this one


def goodput_shapes(entry: dict | None) -> list[tuple[int, dict]]:
    """(training nodes, {"systems": {system: [samples]}}) per job shape of a goodput entry, fewest
    nodes first. Reads both layouts: ``"shapes"`` keyed by shape (bench/goodput.py's
    ``empty_entry``), and the older one, ``"systems"`` at the top, which ran 3 nodes only."""
    if not entry:
        return []
    if "shapes" in entry:
        return sorted(((shape.get("nodes", OLD_GOODPUT_NODES), shape) for shape in entry["shapes"].values()),
                      key=lambda pair: pair[0])
    if "systems" in entry:
        return [(entry.get("nodes", OLD_GOODPUT_NODES), entry)]
    return []


def goodput_shape_label(nodes: int) -> str:
    return f"{nodes} nodes × 1 worker"


def goodput_rows(results: dict) -> list[tuple[str, ...]]:
    """(shape, system, goodput, healthy samples/s, samples in the window, kills, kill → full world
    again, samples lost, load before → after) per shape of bench/goodput.py (fewest nodes first) and
    per system, in :data:`GOODPUT_LABELS`' order."""
    out = []
    for nodes, shape in goodput_shapes(results["scenarios"].get("goodput")):
        out += [(goodput_shape_label(nodes), *row) for row in _goodput_system_rows(shape.get("systems") or {})]
    return out


def _goodput_system_rows(systems: dict) -> list[tuple[str, ...]]:
    """The rows of one shape, without the shape."""
    out = []
    for system, label in GOODPUT_LABELS.items():
        runs = systems.get(system, [])
        measured = [run for run in runs if "error" not in run]
        errors = sorted({run["error"] for run in runs if "error" in run})
        if not measured:
            why = f"failed: {'; '.join(errors)}" if errors else "not measured"
            out.append((label, why, *("—",) * 6))
            continue
        failed = f"; {len(errors)} failed: {'; '.join(errors)}" if errors else ""
        backs = [kill.get("full_world_after_s") for run in measured for kill in run.get("kills", [])]
        missed = sum(back is None for back in backs)
        back = _cell(backs, None, digits=2) if any(b is not None for b in backs) else "none"
        if missed:
            back += f"; {missed} of {len(backs)} not back before the next kill"
        lost = [run for run in measured if run.get("samples_lost")]
        counts = sorted({run.get("kill_count") for run in measured})
        load = tuple(_median(_samples(measured, key)) for key in ("load_1min_before", "load_1min_after"))
        out.append((label, _cell(_samples(measured, "goodput"), None, digits=2) + failed,
                    _cell(_samples(measured, "healthy_samples_per_s"), None, digits=0),
                    _cell(_samples(measured, "samples_in_window"), None, digits=0),
                    ", ".join(str(c) for c in counts), back,
                    f"yes ({len(lost)} of {len(measured)}): {lost[0].get('sample_check')}" if lost else "no",
                    " → ".join("—" if v is None else f"{v:.2f}" for v in load)))
    return out


def goodput_section(results: dict) -> list[str]:
    """The goodput table and how it was measured; empty for results without it."""
    entry = results["scenarios"].get("goodput")
    if not entry:
        return []
    schedule = entry.get("schedule", {})
    window, every, back = (schedule.get(key) for key in ("window_s", "kill_every_s", "back_after_s"))
    shapes = " and ".join(goodput_shape_label(nodes) for nodes, _ in goodput_shapes(entry)) or "no shape"
    return [
        (f"**Goodput under repeated node loss** (`bench/goodput.py`): for {window:g} s a training node other "
         f"than the first is SIGKILLed every {every:g} s with its whole process tree (the launcher and its "
         f"workers), and {back:g} s later the same node is started again (`elasticctl join`; torchrun: its "
         "same line); the victim is the training node that has trained longest since its start (at 3 nodes "
         "b and c alternate; with the spare each kill takes the next of the others and the spare), node a "
         f"(`up`, torchrun's c10d store host) is never killed. Job shapes: {shapes} (the first column), "
         "N training nodes with `--nnodes 1:N`, the event scenarios' trainer and checkpoints (below); "
         f"torchrun with `--max-restarts={entry.get('torchrun_max_restarts', '?')}`; hot + 1 spare: "
         "`--spares 1` and the node after the training nodes started as the spare. Goodput = samples whose "
         "last execution (a step's newest record line: a step re-done after a restart counts once, where it "
         f"was trained last) falls in the window ÷ (that system's own healthy samples/s at that shape × "
         f"{window:g} s); healthy samples/s: the same job's {schedule.get('healthy_s', 0):g} s at its full "
         f"world right before the first kill, after a {schedule.get('warmup_s', 0):g} s warm-up. The jobs "
         f"ran one after another in this run{', one shape after the other' if len(goodput_shapes(entry)) > 1 else ''} "
         f"({entry.get('repeats', 1)} repeat(s) each, the systems' order rotated per repeat). \"kill → full world\": seconds from each kill to "
         "the first step at the shape's full world again (median over the kills; without a spare it "
         f"includes the {back:g} s the node is away). \"samples lost\": the last executions do not tile "
         "every epoch (`bench/accounting.py`). Load: the 1-minute load average before and after each "
         "system's job."),
        "",
        ("| shape | system | goodput | healthy samples/s | samples in the window | kills "
         "| kill → full world again (s) | samples lost | load before → after |"),
        "|---|---|---|---|---|---|---|---|---|",
        *("| " + " | ".join(row) + " |" for row in goodput_rows(results)),
        "",
        *goodput_floor(entry),
    ]


def goodput_floor(entry: dict) -> list[str]:
    """What bounds goodput without a spare, per shape: the returning node's cold start, and how much
    of it is torch's own start in a new process (bench/goodput.py measures both); empty when not
    measured."""
    floor = entry.get("torch_cold_start_s")
    schedule = entry.get("schedule", {})
    shapes = goodput_shapes(entry)
    if floor is None or not schedule or not shapes:
        return []
    from bench.goodput import goodput_bound_without_spare  # imports no report: no cycle

    every, back = schedule.get("kill_every_s", 0), schedule.get("back_after_s", 0)
    returns, bounds = [], []
    for nodes, shape in shapes:
        runs = [run for run in (shape.get("systems") or {}).get("elasticctl-hot", []) if "error" not in run]
        starts = [kill.get("start_to_full_world_s") for run in runs for kill in run.get("kills", [])]
        measured = _median([value for value in starts if value is not None])
        if measured is not None:
            returns.append(f"{measured:.1f} s" + ("" if returns else " (median) from its start to its first step at "
                                                  "the full world") + f" at {goodput_shape_label(nodes)}")
        bound = goodput_bound_without_spare(back, floor, every, nodes)
        bounds.append(f"1 − ({back:g} + {floor:.1f}) / ({nodes} × {every:g}) = "
                      + ("—" if bound is None else f"{bound:.2f}")
                      + f" at {goodput_shape_label(nodes)} (if a world of {nodes - 1} trains its "
                      f"{nodes - 1}/{nodes} of the samples)")
    hot = "In hot mode without a spare a returning node took " + ", ".join(returns) + ". " if returns else ""
    return [
        (f"What bounds goodput without a spare: each kill leaves one worker of the full world away for the "
         f"{back:g} s before its node returns, then for the returning node's cold start. {hot}A new worker "
         "process starts torch before anything else runs: `import torch` and its first optimizer (which "
         f"imports `torch._dynamo`) took {floor:.1f} s here (median of "
         f"{entry.get('torch_cold_start_repeats', 3)}, `bench.goodput.torch_cold_start_s`), under any "
         f"launcher. With that floor alone, a kill every {every:g} s allows a goodput of at most "
         + "; ".join(bounds) + "; a spare, whose worker is already started, is what removes it."),
        "",
    ]


def _median(values: list) -> float | None:
    done = [v for v in values if v is not None]
    return statistics.median(done) if done else None


def _ran_hot(results: dict) -> bool:
    return any(runs.get(HOT) for runs in results["scenarios"].values() if isinstance(runs, dict))


def hot_targets(results: dict) -> str:
    """Hot mode's targets next to what this run measured (medians; re-done steps: the most)."""
    scenarios = results["scenarios"]
    lifecycle = scenarios.get("lifecycle", {}).get(HOT, [])
    ttl = results["settings"].get("node_ttl_s", 5)

    def seconds(path: tuple[str, ...], target: float, label: str) -> str:
        value = _median(_field(lifecycle, *path))
        if not lifecycle:
            measured = "not measured in this run"
        elif value is None:  # the event never completed within its cap
            measured = "no value (missed)"
        else:
            measured = f"{value:.2f} s ({'met' if value <= target else 'missed'})"
        return f"{label} ≤ {target:g} s: {measured}"

    parts = [seconds(("crash", "seconds"), HOT_CRASH_TARGET, "SIGKILL → world 2"),
             seconds(("freeze", "seconds"), ttl + HOT_FREEZE_MARGIN, f"SIGSTOP → world 2 (node TTL {ttl:g} s + "
                     f"{HOT_FREEZE_MARGIN:g})"),
             seconds(("scale_up", "pause_s"), HOT_PAUSE_TARGET, "running workers' pause for a joiner"),
             seconds(("scale_up", "joiner_after_initialized_s"), HOT_JOINER_TARGET,
                     "joiner's first step after `initialized`")]
    spare_runs = scenarios.get("spare", {}).get(HOT, [])
    spare_value = _median(_field(spare_runs, "seconds"))
    parts.append(f"with one spare, SIGKILL → world 3 ≤ {HOT_SPARE_TARGET:g} s: " + (
        "not measured in this run" if not spare_runs else "no value (missed)" if spare_value is None
        else f"{spare_value:.2f} s ({'met' if spare_value <= HOT_SPARE_TARGET else 'missed'})"))
    redone = [v for v in _field(lifecycle, "crash", "redone_steps") + _field(lifecycle, "freeze", "redone_steps")
              + _field(scenarios.get("crash_host", {}).get(HOT, []), "redone_steps") if v is not None]
    parts.append(f"steps re-done per failure ≤ {HOT_REDONE_TARGET}: "
                 + (f"at most {max(redone)} over {len(redone)} failures "
                    f"({'met' if max(redone) <= HOT_REDONE_TARGET else 'missed'})" if redone
                    else "not measured in this run"))
    steady = scenarios.get("steady", {})
    hot_rate, restart_rate = (_median(_field(steady.get(system, []), "steps_per_s")) for system in (HOT, RESTART))
    if hot_rate is None or restart_rate is None:
        measured = "not measured in this run"
    else:
        ratio = hot_rate / restart_rate
        measured = (f"{ratio:.3f} × ({hot_rate:.1f} vs {restart_rate:.1f} steps/s) "
                    f"({'met' if ratio >= HOT_STEADY_TARGET else 'missed'})")
    parts.append(f"steady steps/s ≥ {HOT_STEADY_TARGET:g} × restart mode: {measured}")
    return "Targets, elasticctl hot mode: " + "; ".join(parts) + "."


def _rounds(entry: dict, backend: str) -> list[dict]:
    return [r for r in entry.get("rounds", []) if r.get("backend") == backend]


def _rdzv_cell(entry: dict, backend: str) -> str:
    """Seconds of one round at this size, "not run", or "none within 120 s (1/1; 37/128 joined)"."""
    if backend not in entry:
        return "not run"
    text = _cell(entry[backend], entry.get("timeout"), digits=2)  # older results have no timeout
    failed = [r for r in _rounds(entry, backend) if not (r.get("completed") and r.get("correct"))]
    if failed and not any(v is not None for v in entry[backend]):
        most = max(failed, key=lambda r: r.get("agents_done", 0))
        if "setup_s" not in most:
            text += "; setup failed"
        elif most.get("completed"):
            text += "; wrong round"
        else:
            text += f"; {most.get('agents_done', 0)}/{entry['agents']} returned"
    return text


def _per_agent(entry: dict, backend: str = ETCD3, key: str = "writes_per_agent") -> float | None:
    """Median over the completed rounds of ``backend`` at this size (writes or proposals)."""
    values = [r[key] for r in _rounds(entry, backend) if r.get("completed") and r.get(key) is not None]
    return statistics.median(values) if values else None


def _writes_per_agent(entry: dict) -> float | None:
    return _per_agent(entry, ETCD3, "writes_per_agent")


def rendezvous_rows(results: dict) -> list[tuple[str, ...]]:
    """(agents, etcd3 s, writes/agent, proposals/agent etcd3 | previous, previous main s, c10d s,
    etcd3/previous, etcd3/c10d)."""
    out = []
    for entry in results["scenarios"].get("rendezvous", []):
        cap, ours = entry.get("timeout"), entry.get(ETCD3, [])
        writes = _writes_per_agent(entry)
        ratios = [_ratio(ours, entry[b], cap) if b in entry else "—" for b in (DYNAMIC, C10D)]
        proposals = [_per_agent(entry, b, "proposals_per_agent") for b in (ETCD3, DYNAMIC)]
        out.append((f"{entry['agents']:,}", _rdzv_cell(entry, ETCD3),
                    "—" if writes is None else f"{writes:.1f}",
                    " / ".join("—" if p is None else f"{p:.1f}" for p in proposals),
                    _rdzv_cell(entry, DYNAMIC), _rdzv_cell(entry, C10D), *ratios))
    return out


def rendezvous_targets(results: dict) -> str:
    """The rendezvous round's targets next to what this run measured."""
    entries = {entry["agents"]: entry for entry in results["scenarios"].get("rendezvous", [])}
    parts = []
    for agents, target in ROUND_TARGETS:
        done = [v for v in entries.get(agents, {}).get(ETCD3, []) if v is not None]
        if agents not in entries:
            measured = "not measured in this run"
        elif not done:
            measured = "no round (missed)"
        else:
            median = statistics.median(done)
            measured = f"{median:.2f} s ({'met' if median <= target else 'missed'})"
        parts.append(f"{agents:,} agents in ≤ {target:g} s: {measured}")
    writes = {agents: w for agents, w in ((a, _writes_per_agent(e)) for a, e in sorted(entries.items()))
              if w is not None}
    if not writes:
        measured = "not measured in this run"
    else:
        largest = max(writes)
        measured = (f"{writes[largest]:.1f} × N at {largest:,} agents "
                    f"({'met' if writes[largest] <= WRITES_TARGET else 'missed'})")
        over = [f"{w:.1f} × N at {a:,} agents" for a, w in writes.items() if w > WRITES_TARGET]
        if over:
            measured += ("; above it only where a round's few fixed writes weigh most: "
                         + ", ".join(over))
    parts.append(f"etcd writes per round ≤ {WRITES_TARGET:g} × N: {measured}")
    return "Targets, elasticctl's etcd3: " + "; ".join(parts) + "."


def rendezvous_table(results: dict) -> list[str]:
    lines = [("| agents | elasticctl etcd3 (s) | etcd writes per agent | raft proposals per agent: "
              "etcd3 / previous main | previous main: torch's dynamic handler on etcd (s) | "
              "torch c10d (s) | ratio etcd3/previous main | ratio etcd3/c10d |"),
             "|---|---|---|---|---|---|---|---|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rendezvous_rows(results)]


def _rendezvous_plan(results: dict) -> str:
    settings = results["settings"]
    repeats = settings["rendezvous_repeats"]
    per_size = f"{repeats} repeat{'s' if repeats != 1 else ''} per size"
    if "rendezvous_max_agents" not in settings:  # results from before the scale series
        return per_size
    limits = settings["rendezvous_max_agents"]
    runs = "; ".join(f"{name} up to {limits[key]:,} agents" for key, name in
                     ((DYNAMIC, "the previous main"), (C10D, "c10d")) if key in limits)
    why = ("`--full` runs each up to the largest size it completed in earlier runs on this "
           "machine (the previous main made no round of 128 agents within 120 s, c10d none of 256)"
           if results.get("mode") == "full" else "`--quick` stops early to stay short")
    return f"{per_size} below 256 agents, 1 from 256 on" + (f"; {runs}: {why}" if runs else "")


def _number(value, digits: int = 2) -> str:
    return "—" if value is None else f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"


def scale_rows(results: dict) -> list[tuple[str, ...]]:
    """(what, size, seconds, writes/agent, watch events (per agent), etcd CPU s, watches) of
    the simulated agents' light rounds and hot re-formations."""
    scale = results["scenarios"].get("rendezvous_scale") or {}
    out = []
    for row in scale.get("light", []):
        outcome = f"{row['seconds']:.2f}" if row.get("completed") and row.get("correct") else "no round"
        out.append((f"one round, watch per {row.get('watchers', 'agent')}", f"{row['agents']:,}", outcome,
                    _number(row.get("writes_per_agent")),
                    f"{_number(row.get('events'), 0)} ({_number(row.get('events_per_agent'))})",
                    _number(row.get("cpu_etcd_s"))))
    for row in scale.get("hot", []):
        outcome = (f"{row['seconds']:.2f} (sealed {row['sealed_s']:.2f})"
                   if row.get("completed") and row.get("correct") else "no generation")
        events = row.get("events_received")
        per = None if events is None else events / row["workers"]
        out.append((f"hot re-formation, {row['policy']}", f"{row['workers']:,}", outcome,
                    _number(row.get("writes_per_agent")), f"{_number(events, 0)} ({_number(per)})",
                    _number(row.get("cpu_etcd_s"))))
    return out


def scale_targets(results: dict) -> str:
    scale = results["scenarios"].get("rendezvous_scale") or {}
    agents, seconds, writes = LIGHT_TARGET
    light = [r for r in scale.get("light", []) if r["agents"] == agents]
    if not light:
        parts = [f"{agents:,} agents in ≤ {seconds:g} s, ≤ {writes:g} writes each: not measured in this run"]
    else:
        row = light[0]
        ok = row.get("completed") and row.get("correct")
        parts = [f"{agents:,} agents in ≤ {seconds:g} s: "
                 + (f"{row['seconds']:.2f} s ({'met' if row['seconds'] <= seconds else 'missed'})" if ok
                    else "no round (missed)"),
                 f"≤ {writes:g} etcd writes per agent: " + (
                     f"{row['writes_per_agent']:.2f} ({'met' if row['writes_per_agent'] <= writes else 'missed'})"
                     if row.get("writes_per_agent") is not None else "not measured")
                 + (f", etcd's CPU {row['cpu_etcd_s']:.2f} s" if row.get("cpu_etcd_s") is not None else "")]
    workers, seconds, per_worker = HOT_REFORM_TARGET
    hot = [r for r in scale.get("hot", []) if r["workers"] == workers and r["policy"] == "followers"]
    if not hot:
        parts.append(f"a hot re-formation of {workers:,} in ≤ {seconds:g} s with ≤ {per_worker:g} × N watch "
                     "events: not measured in this run")
    elif not (hot[0].get("completed") and hot[0].get("correct")):
        parts.append(f"a hot re-formation of {workers:,}: no generation (missed)")
    else:
        row = hot[0]
        events = row["events_received"] / workers
        before = [r for r in scale.get("hot", []) if r["workers"] == workers and r["policy"] == "every-member"]
        parts.append(f"a hot re-formation of {workers:,} in ≤ {seconds:g} s: {row['seconds']:.2f} s "
                     f"({'met' if row['seconds'] <= seconds else 'missed'}), ≤ {per_worker:g} × N watch events: "
                     f"{events:.1f} × N ({'met' if events <= per_worker else 'missed'})"
                     + (f"; every member following every declaration: {before[0]['events_received'] / workers:.1f} × N"
                        if before and before[0].get("events_received") else ""))
    return "Targets, simulated agents: " + "; ".join(parts) + "."


def _total(values: list) -> str:
    """The sum of the values measured ("—" when no round measured any)."""
    known = [value for value in values if value is not None]
    return str(int(sum(known))) if known else "—"


def real_handler_rows(results: dict) -> list[tuple[str, ...]]:
    """Per size of the real handlers' rounds: (agents, processes, rounds complete, median seconds
    (min-max), proposals per agent (median), writes per agent (median), compare-and-swap requests
    per agent (median), leases that expired (all rounds), agents failed, load)."""
    rows = results["scenarios"].get("rendezvous_real") or []
    out = []
    for agents in sorted({row["agents"] for row in rows}):
        mine = [row for row in rows if row["agents"] == agents]
        good = [row for row in mine if row.get("completed") and row.get("correct")]
        seconds = [row["seconds"] for row in good]
        loads = [row["load_1min"] for row in mine if row.get("load_1min") is not None]
        out.append((f"{agents:,}", str(mine[0].get("processes", "—")), f"{len(good)} of {len(mine)}",
                    f"{statistics.median(seconds):.2f} ({min(seconds):.2f}–{max(seconds):.2f})" if seconds else "no round",
                    _number(_median([row.get("proposals_per_agent") for row in mine])),
                    _number(_median([row.get("writes_per_agent") for row in mine])),
                    _number(_median([row.get("txn_requests_per_agent") for row in mine])),
                    _total([row.get("lease_expiries") for row in mine]),
                    str(sum(row.get("agents_failed") or 0 for row in mine)),
                    f"{min(loads):.1f}–{max(loads):.1f}" if loads else "—"))
    return out


def real_handler_targets(results: dict) -> str:
    agents, seconds = REAL_HANDLER_TARGET
    mine = [row for row in results["scenarios"].get("rendezvous_real") or [] if row["agents"] == agents]
    if not mine:
        return f"Target: one round of {agents:,} real handlers in ≤ {seconds:g} s, every round complete: not measured in this run."
    good = [row["seconds"] for row in mine if row.get("completed") and row.get("correct")]
    median = statistics.median(good) if good else None
    met = len(good) == len(mine) and median is not None and median <= seconds
    return (f"Target: one round of {agents:,} real handlers in ≤ {seconds:g} s (median), every round complete: "
            + (f"{median:.2f} s" if median is not None else "no round")
            + f", {len(good)} of {len(mine)} complete ({'met' if met else 'missed'}).")


def real_handler_section(results: dict) -> list[str]:
    return [
        "## Rendezvous of real torchrun handlers",
        "",
        ("`bench/rendezvous.py --backends etcd3 --processes 8` (`python -m bench.run --only rendezvous_real`): "
         "elasticctl's etcd3 rendezvous handler, built as torchrun builds it, one per agent, as threads of 8 "
         "processes on one etcd (a fresh one per round); min = max = N, `last_call_timeout=1`. A round is "
         "timed from the moment every handler is built and told to go until the last `next_rendezvous()` "
         "returns; every handler must get world size N and the ranks 0..N−1. Proposals and writes per agent "
         "are etcd's own counters (its /metrics before and after); CAS/agent counts the Txn requests etcd "
         "received (claims, seals, compare-and-swaps: a failed compare is still a raft proposal); leases "
         "expired counts node leases whose renewals came too late, over all rounds of the size. The sizes "
         "run interleaved, one round each per repeat. Cells: median (min–max) of the complete rounds."),
        "",
        ("| agents | processes | rounds complete | seconds | proposals/agent | writes/agent | CAS/agent "
         "| leases expired | agents failed | load (1 min) |"),
        "|---|---|---|---|---|---|---|---|---|---|",
        *[f"| {' | '.join(row)} |" for row in real_handler_rows(results)],
        "",
        real_handler_targets(results),
        "",
    ]


def scale_section(results: dict) -> list[str]:
    return [
        "## Rendezvous at scale: simulated agents and hot re-formation",
        "",
        ("`bench/rendezvous.py --backends etcd3-light` and `--hot N` (`bench/rdzv_light.py`): simulated agents "
         "that make the etcd3 protocol's own etcd requests with its real records and decisions (a lease "
         "each, the declaration bound to it, the claim's compare-and-swap, the sealing transaction, "
         "watches of `ctl/`), with asyncio and one etcd connection per process instead of a torchrun "
         "agent each. A round: min = max = N from nothing, timed from the start to the last agent learning "
         "it. A hot re-formation: N workers in a sealed generation, one worker's lease revoked, timed "
         "until the last survivor learns generation 2 (world N−1; \"sealed\": the sealer's transaction "
         "returned); watch events are those the workers' watches received (one watch of `ctl/` per "
         "worker; `nodes/` followed by the declaration followers and the sealer, or by every member in "
         "the earlier protocol). At 10,000 agents one watch per process: the sealed round (~25 bytes per "
         "member) sent to 10,000 watches would be 2.5 GB."),
        "",
        "| scenario | N | seconds | etcd writes per agent | watch events (per agent) | etcd CPU s |",
        "|---|---|---|---|---|---|",
        *("| " + " | ".join(row) + " |" for row in scale_rows(results)),
        "",
        scale_targets(results),
        "",
    ]


def checkpoint_rows(results: dict) -> list[str]:
    lines = []
    for entry in results["scenarios"].get("checkpoint", []):
        none_ms = entry["none"]["step_ms"][1]
        for mode in ("none", "sync", "async"):
            m = entry[mode]
            lost = entry["every"] * m["step_ms"][1]
            lines.append(f"| {entry['trainer']} | {mode} | {m['step_ms'][1]:.2f} ({m['step_ms'][0]:.2f}–"
                         f"{m['step_ms'][2]:.2f}, n={len(m.get('samples_ms', []))}) | "
                         f"{m['overhead_pct_of_median']:+.1f} % | "
                         + (f"{entry['every']} steps ≈ {lost / 1000:.2f} s |" if mode != "none"
                            else f"everything since start (no checkpoint); {none_ms:.2f} ms/step |"))
    return lines


def _met(ok: bool) -> str:
    return "met" if ok else "missed"


def state_transfer_targets(results: dict) -> str:
    """State transfer: ``new`` at >= 0.7 x raw at 512 MB and 2 GB; the sender's RSS peak over before
    within one bucket (its memory within state size + one bucket)."""
    entries = {entry["state_mb"]: entry for entry in results["scenarios"].get("state_transfer") or []}
    parts = []
    for size in TRANSFER_TARGET_MB:
        entry = entries.get(size)
        label = f"{size} MB" if size < 1024 else f"{size // 1024} GB"
        if entry is None or "new" not in entry or not entry.get("raw", {}).get("bytes_per_s"):
            parts.append(f"at {label}: not measured in this run")
            continue
        ratio = entry["new"]["bytes_per_s"] / entry["raw"]["bytes_per_s"]
        parts.append(f"at {label}: {ratio:.2f} × ({entry['new']['bytes_per_s'] / 1e6:.0f} vs "
                     f"{entry['raw']['bytes_per_s'] / 1e6:.0f} MB/s) ({_met(ratio >= TRANSFER_TARGET)})")
    senders = [(entry["state_mb"], entry["new"]["sender_rss_delta_max"], entry["bucket_bytes"])
               for entry in entries.values() if "new" in entry]
    if senders:
        size, worst, bucket = max(senders, key=lambda s: s[1] / s[2])
        memory = (f"at most {worst / 2**20:.1f} MiB over before (at {size} MB; bucket {bucket / 2**20:.0f} MiB) "
                  f"({_met(all(delta <= b for _, delta, b in senders))})")
    else:
        memory = "not measured in this run"
    return (f"Targets, state transfer ≥ {TRANSFER_TARGET:g} × the raw gloo broadcast: " + "; ".join(parts)
            + f"; sender's memory within state size + one bucket: {memory}.")


def state_transfer_section(results: dict) -> list[str]:
    from bench.state_transfer import table

    entries = results["scenarios"].get("state_transfer") or []
    if not entries:
        return []
    return [("Hot recovery's state transfer (`bench/state_transfer.py`, 3 processes on loopback gloo: 2 holders "
             "of a Linear + Adam state, 1 joiner with an empty optimizer; `new`: buckets of 64 MiB from both "
             "holders into the joiner's tensors, `warm`: the same into a receiver that holds every tensor "
             "already (no fresh memory to map), `old`: one whole-state `torch.save` blob broadcast, `raw`: "
             "one `dist.broadcast` of the same bytes from one holder to both others, its buffers mapped "
             "beforehand; medians of interleaved repeats, one from 2 GB; `old` up to 1 GB, its ~3 copies per "
             "process would not fit 3 processes at 2 GB; RSS: the peak during the transfer over the RSS "
             "just before):"), "",
            table(entries), "", state_transfer_targets(results), ""]


def _samples(runs: list[dict], key: str) -> list[float | None]:
    return [run.get(key) for run in runs]


def _identical(runs: list[dict]) -> str:
    verdicts = [run.get("replicas_identical") for run in runs if "replicas_identical" in run]
    if not verdicts:
        return "not measured"
    wrong = [v for v in verdicts if v is not True]
    return f"yes ({len(verdicts)} of {len(verdicts)})" if not wrong else f"no: {wrong[0]}"


def _failures(runs: list[dict]) -> str:
    """The distinct outcomes of the runs that did not get there ("failed: ...", "none within ...")."""
    reasons = sorted({run.get("outcome", "?") for run in runs if run.get("seconds") is None})
    return "; ".join(reasons)


def freeze_target_s(node_ttl: float) -> float:
    """An HSDP freeze's target: the survivors' first step at the smaller world within the node TTL
    (when the frozen node's lease ends) and a margin for the re-formation."""
    return node_ttl + HSDP_FREEZE_MARGIN


def seconds_verdict(value: float | None, target: float) -> str:
    """"1.50 s (met)", "4.20 s (missed)", or "no value (missed)" for an event that never completed."""
    return "no value (missed)" if value is None else f"{value:.2f} s ({_met(value <= target)})"


def _freeze_ttl(runs: list[dict]) -> float | None:
    ttls = [run["node_ttl_s"] for run in runs if run.get("node_ttl_s") is not None]
    return max(ttls) if ttls else None


def _freeze_target_label(runs: list[dict]) -> str:
    ttl = _freeze_ttl(runs)
    return f"≤ node TTL + {HSDP_FREEZE_MARGIN:g} s" + (f" ({freeze_target_s(ttl):g} s)" if ttl is not None else "")


def survivors_kept(runs: list[dict]) -> str:
    """Whether the survivors of each HSDP freeze kept their worker processes (the same pids) through
    the freeze and the thaw: "yes (n of n)", "no: ..." or "not measured"."""
    measured = [run for run in runs if (run.get("freeze") or {}).get("survivors_restarted") is not None]
    if not measured:
        return "not measured"
    at_freeze = sum(run["freeze"]["survivors_restarted"] for run in measured)
    at_thaw = sum((run.get("thaw") or {}).get("running_restarted") or 0 for run in measured)
    if not at_freeze and not at_thaw:
        return f"yes ({len(measured)} of {len(measured)})"
    return f"no: {at_freeze} restarted at the freeze, {at_thaw} at the thaw"


def samples_verdict(runs: list[dict]) -> str:
    """The freezes' sample checks (the whole record's lineage): "none (...)", "yes: reason" or "not measured"."""
    checks = [run["samples"] for run in runs if run.get("samples")]
    if not checks:
        return "not measured"
    wrong = [check for check in checks if not check.get("samples_ok")]
    if wrong:
        return f"yes ({len(wrong)} of {len(checks)}): {wrong[0].get('samples_check')}"
    return (f"none ({len(checks)} of {len(checks)}; {sum(c.get('steps_counted') or 0 for c in checks)} steps, "
            f"{sum(c.get('steps_redone') or 0 for c in checks)} re-done in all)")


def hsdp_freeze_rows(runs: list[dict]) -> list[tuple[str, str, str]]:
    """(measurement, this run, target) of the HSDP freezes: SIGSTOP → world 4 against the node TTL
    + 1 s, the survivors' processes, the steps re-done, the samples, and the thaw back to world 6."""
    freezes = [run["freeze"] for run in runs if "freeze" in run]
    errors = "; ".join(sorted({f"failed: {run['error']}" for run in runs if "error" in run}))
    cell = _cell(_samples(freezes, "seconds"), _cap(freezes, "cap_s"), digits=2) if freezes else ""
    failures = "; ".join(part for part in (_failures(freezes), errors) if part)
    cell = (f"{cell} ({failures})" if cell and failures else cell or failures) or "not measured"
    redone = [v for v in _samples(freezes, "redone_steps") if v is not None]
    out = [("HSDP 3 × 2: SIGSTOP a node's whole tree → first step at world 4 (s)", cell,
            _freeze_target_label(runs)),
           ("HSDP freeze: survivors' worker processes kept (same pids)", survivors_kept(runs), "yes"),
           ("HSDP freeze: steps re-done after the SIGSTOP", f"at most {max(redone)}" if redone else "not measured",
            "≤ 1 (the step in flight)")]
    out.append(("HSDP freeze: samples lost or trained twice (the job's lineage)", samples_verdict(runs), "none"))
    thaws = [run["thaw"] for run in runs if "thaw" in run]
    out.append(("HSDP freeze: shards' digests identical across replicas before every step",
                _identical(freezes + thaws), "identical"))
    if thaws:
        back = [thaw for thaw in thaws if thaw.get("seconds") is not None]
        cell = _cell(_samples(thaws, "seconds"), None, digits=2)  # "failed (n/n)" when none came back
        restarted = [v for v in _samples(back, "thawed_restarted") if v is not None]
        if restarted:
            cell += (f"; the thawed node's workers: {sum(restarted)} new process(es)" if any(restarted)
                     else "; the thawed node's workers kept their processes")
        if _failures(thaws):
            cell += f" ({_failures(thaws)})"
        out.append(("HSDP freeze: SIGCONT → the node back, every worker at world 6 (s)", cell,
                    "back at world 6, as a newcomer"))
    return out


def hsdp_freeze_targets(runs: list[dict] | None) -> list[str]:
    """The parts of the sharded targets' line for the HSDP freezes (``runs`` None: not run)."""
    label = f"HSDP SIGSTOP → first step {_freeze_target_label(runs or [])}"
    if runs is None:
        return [f"{label}: not measured in this run"]
    freezes = [run["freeze"] for run in runs if "freeze" in run]
    ttl = _freeze_ttl(runs)
    value = _median(_samples(freezes, "seconds"))
    parts = [f"{label}: " + ("no value (missed)" if ttl is None else seconds_verdict(value, freeze_target_s(ttl)))]
    for what, verdict, good in (("survivors kept their processes", survivors_kept(runs), "yes"),
                                ("no sample lost or trained twice", samples_verdict(runs), "none")):
        judged = "" if verdict == "not measured" else f" ({_met(verdict.startswith(good))})"
        parts.append(f"{what}: {verdict}{judged}")
    if freezes:
        back = sum(1 for run in runs if (run.get("thaw") or {}).get("seconds") is not None)
        parts.append(f"the frozen node back at world 6 after SIGCONT: {back} of {len(freezes)} "
                     f"({_met(back == len(freezes))})")
    return parts


def sharded_rows(results: dict) -> list[tuple[str, str, str]]:
    """(measurement, this run, target) of the sharded scenarios that ran."""
    scenarios = results["scenarios"]
    out: list[tuple[str, str, str]] = []
    rounds = scenarios.get("hsdp")
    if rounds is not None:
        kills = [r["kill"] for r in rounds if "kill" in r]
        joins = [r["join"] for r in rounds if "join" in r]
        errors = [r["error"] for r in rounds if "error" in r]
        cap = _cap(kills + joins, "cap_s")
        cell = _cell(_samples(kills, "seconds"), cap, digits=2) if kills else f"failed: {'; '.join(errors)}"
        if _failures(kills):
            cell += f" ({_failures(kills)})"
        out.append(("HSDP 3 × 2: SIGKILL a node → first step at world 4 (s)", cell, f"≤ {HSDP_KILL_TARGET:g} s"))
        redone = [v for v in _samples(kills, "redone_steps") if v is not None]
        out.append(("HSDP: steps re-done after the SIGKILL", f"at most {max(redone)}" if redone else "not measured",
                    "0"))
        restarted = [v for v in _samples(kills, "survivors_restarted") if v is not None]
        out.append(("HSDP: survivors' worker processes restarted", f"{sum(restarted)}" if restarted else "not measured",
                    "0"))
        out.append(("HSDP: shards' digests identical across replicas before every step", _identical(kills + joins),
                    "identical"))
        if joins:
            joined = [j for j in joins if j.get("seconds") is not None]
            failed = _failures(joins)
            pause = _cell(_samples(joined, "pause_s"), None, digits=2) if joined else ""
            out.append(("HSDP: a node joins: the running workers' pause (s)",
                        "; ".join(part for part in (pause, f"{len(joins) - len(joined)} of {len(joins)} {failed}"
                                                    if failed else "") if part),
                        f"≤ its shards' transfer + {HSDP_JOIN_MARGIN:g} s"))
            if joined:
                out.append(("HSDP: the joiner's shards' transfer (s; bytes, sources)",
                            _cell(_samples(joined, "transfer_s"), None, digits=3)
                            + f"; {joined[0].get('transfer_bytes', 0) / 2**20:.2f} MiB from "
                            + ", ".join(f"shard {shard}: {source}" for shard, source in joined[0].get("sources", [])),
                            "from replicas"))
                out.append(("HSDP: a node joins → every worker at world 6 (s)",
                            _cell(_samples(joined, "seconds"), None, digits=2), "—"))
        rebuilt = [r["join"] for r in scenarios.get("hsdp_rebuilt") or [] if "join" in r]
        rebuilt_joined = [j for j in rebuilt if j.get("seconds") is not None]
        if rebuilt_joined:
            out.append(("HSDP: a node joins, every group rebuilt (`ELASTICCTL_REBUILD_GROUPS=1`): the pause (s)",
                        _cell(_samples(rebuilt_joined, "pause_s"), None, digits=2),
                        "the comparison: the kept mesh above"))
        for label, joined_ in (("kept", joins), ("rebuilt", rebuilt_joined)):
            survivors = [j.get("phases") or {} for j in joined_ if j.get("seconds") is not None]
            if survivors:
                out.append((f"HSDP join, rank 0's phases, groups {label} (s after the join was seen)",
                            ", ".join(f"{phase} {_median([p[phase] - p['fault_seen'] for p in survivors if phase in p]):.2f}"
                                      for phase in ("group_reconfigured", "group_built", "rewrapped", "module_kept",
                                                    "state_synced", "first_step")
                                      if any(phase in p for p in survivors) and all("fault_seen" in p for p in survivors)),
                            "—"))
    freezes = scenarios.get("hsdp_freeze")
    if freezes is not None:
        out += hsdp_freeze_rows(freezes)
    fsdp = scenarios.get("fsdp")
    if fsdp:
        for system, label in ((HOT, "hot: survivors in process, checkpoint resharded"),
                              (RESTART, "restart mode: workers restarted from it")):
            runs = fsdp.get(system, [])
            if not runs:
                continue
            cell = _cell(_samples(runs, "seconds"), _cap(runs, "cap_s"), digits=2)
            redone = [v for v in _samples(runs, "redone_steps") if v is not None]
            restarted = [v for v in _samples(runs, "survivors_restarted") if v is not None]
            sources = sorted({s for run in runs for s in run.get("restored_sources", [])})
            detail = (f"; re-done at most {max(redone) if redone else '—'}, survivors' processes restarted "
                      f"{sum(restarted) if restarted else '—'}" + (f", restored from {', '.join(sources)}" if sources else ""))
            out.append((f"FSDP2 without copies, {label}: SIGKILL node c → first step at world 2 (s)", cell + detail,
                        "no process restarted" if system == HOT else "(comparison)"))
    peer = scenarios.get("fsdp_peer_copies")
    if peer is not None:
        runs = peer.get("samples") or []
        seconds, most = PEER_COPY_TARGET
        target = f"≤ {seconds:g} s, ≤ {most} steps re-done, no restart, no disk read"
        if not runs:
            out.append(("FSDP2 with peer copies: SIGKILL a node → first step (s)", peer.get("outcome", "not run"), target))
        else:
            redone = [v for v in _samples(runs, "redone_steps") if v is not None]
            sources = sorted({s for run in runs for s in run.get("restored_sources", [])})
            out.append(("FSDP2 with peer copies: SIGKILL a node → first step (s)",
                        _cell(_samples(runs, "seconds"), _cap(runs, "cap_s"), digits=2)
                        + f"; re-done at most {max(redone) if redone else '—'}"
                        + (f", restored from {', '.join(sources)}" if sources else ""), target))
    chaos = scenarios.get("chaos_hsdp")
    if chaos:
        events = chaos.get("events") or []
        kinds = collections.Counter(e["kind"] for e in events)
        mix = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
        if chaos.get("outcome") == "passed":
            cell = (f"passed: {len(events)} events ({mix}), {chaos['steps']} steps, {chaos['redone']} re-done, "
                    f"{chaos['worker_restarts']} worker restarts")
        else:
            cell = f"{chaos.get('outcome')} after {len(events)} of {chaos.get('events_planned')} events" + (
                f" ({mix})" if mix else "")
        restarts = [f"{e['kind']} {e.get('node', '')}".strip() + f" ({e['others_restarted']})" for e in events
                    if e.get("others_restarted")]
        if restarts:
            cell += "; other nodes' workers restarted by: " + ", ".join(restarts)
        first = chaos.get("with_joins")
        if first:
            done = first.get("events") or []
            restarted_by = ", ".join(f"{e['kind']} {e['node']} ({e['others_restarted']})" for e in done
                                     if e.get("others_restarted"))
            cell += (f"; first with every kind ({', '.join(first.get('kinds', []))}): {first.get('outcome')} "
                     f"after {len(done)} events"
                     + (f"; other nodes' workers restarted by: {restarted_by}" if restarted_by else "")
                     + ": the kinds that need a join were then left out")
        out.append((f"Chaos soak, HSDP 3 × 2 ({', '.join(chaos.get('kinds', []))}): "
                    f"{chaos.get('events_planned')} events", cell,
                    "no sample lost or repeated, replicas identical, nothing left running"))
    return out


def sharded_targets(results: dict) -> str:
    scenarios = results["scenarios"]
    parts = []
    rounds = scenarios.get("hsdp")
    kills = [r["kill"] for r in rounds or [] if "kill" in r]
    joins = [r["join"] for r in rounds or [] if "join" in r]
    value = _median(_samples(kills, "seconds"))
    redone = [v for v in _samples(kills, "redone_steps") if v is not None]
    parts.append(f"HSDP SIGKILL → first step ≤ {HSDP_KILL_TARGET:g} s: " + (
        "not measured in this run" if rounds is None else seconds_verdict(value, HSDP_KILL_TARGET)))
    if redone:
        parts.append(f"nothing re-done: at most {max(redone)} ({_met(max(redone) == 0)})")
    identical = _identical(kills + joins)
    if rounds is not None:
        parts.append(f"shards identical across replicas: {identical} ({_met(identical.startswith('yes'))})")
    joined = [j for j in joins if j.get("seconds") is not None and j.get("pause_s") is not None]
    if joined:
        over = [j["pause_s"] - (j.get("transfer_s") or 0.0) for j in joined]
        worst = max(over)
        parts.append(f"a joining node's pause ≤ its shards' transfer + {HSDP_JOIN_MARGIN:g} s: pause − transfer "
                     f"at most {worst:.2f} s ({_met(worst <= HSDP_JOIN_MARGIN)})")
    elif joins:
        parts.append(f"a joining node's pause ≤ its shards' transfer + {HSDP_JOIN_MARGIN:g} s: "
                     f"no join completed ({_failures(joins)}) (missed)")
    elif rounds is not None:
        parts.append("a joining node's pause: not measured (no node was killed first)")
    parts += hsdp_freeze_targets(scenarios.get("hsdp_freeze"))
    peer = scenarios.get("fsdp_peer_copies")
    seconds, most = PEER_COPY_TARGET
    label = f"FSDP2 with peer copies ≤ {seconds:g} s and ≤ {most} steps re-done"
    if peer is None:
        parts.append(f"{label}: not measured in this run")
    elif not peer.get("samples"):
        parts.append(f"{label}: {peer.get('outcome', 'not run')}")
    else:
        runs = peer["samples"]
        value = _median(_samples(runs, "seconds"))
        redone = [v for v in _samples(runs, "redone_steps") if v is not None]
        disk = any("checkpoint" in s for run in runs for s in run.get("restored_sources", [])) or any(
            run.get("resumed_from_checkpoint") for run in runs)
        restarted = sum(run.get("survivors_restarted") or 0 for run in runs)
        ok = (value is not None and value <= seconds and redone and max(redone) <= most and not disk
              and not restarted)
        parts.append(f"{label}: " + ("no value" if value is None else f"{value:.2f} s")
                     + (f", at most {max(redone)} re-done" if redone else "")
                     + (", from disk" if disk else "") + (f", {restarted} restarted" if restarted else "")
                     + f" ({_met(bool(ok))})")
    fsdp = scenarios.get("fsdp") or {}
    hot, restart = fsdp.get(HOT, []), fsdp.get(RESTART, [])
    if hot:
        hot_s, restart_s = _median(_samples(hot, "seconds")), _median(_samples(restart, "seconds"))
        restarted = sum(run.get("survivors_restarted") or 0 for run in hot)
        parts.append("FSDP2 without copies, survivors in process from the resharded checkpoint: "
                     + ("no value" if hot_s is None else f"{hot_s:.2f} s")
                     + (f" vs restart mode {restart_s:.2f} s" if restart_s is not None else "")
                     + f", {restarted} survivor process(es) restarted ({_met(hot_s is not None and not restarted)})")
    else:
        parts.append("FSDP2 without copies: not measured in this run")
    chaos = scenarios.get("chaos_hsdp")
    if chaos:
        without = " without the events that need a join (with them: failed)" if chaos.get("with_joins") else ""
        parts.append(f"chaos soak of the HSDP trainer, {chaos.get('events_planned')} events: {chaos.get('outcome')}"
                     f"{without} ({_met(chaos.get('outcome') == 'passed' and not without)})")
    else:
        parts.append("chaos soak of the HSDP trainer: not measured in this run")
    return "Targets, sharded models: " + "; ".join(parts) + "."


def sharded_section(results: dict) -> list[str]:
    if not any(results["scenarios"].get(name) is not None
               for name in ("hsdp", "hsdp_freeze", "fsdp", "fsdp_peer_copies", "chaos_hsdp")):
        return []
    chaos = results["scenarios"].get("chaos_hsdp") or {}
    return [
        "## Sharded models under hot recovery",
        "",
        ("`bench/hsdp_recovery.py`, trainers/lm.py on loopback gloo, node TTL 3 s. HSDP: 3 nodes × 2 workers "
         "(`--nproc-per-node 2`, `--shard hsdp --record-params`: replicated across nodes, sharded within), "
         "each round SIGKILLs a node's whole tree, then starts a new node; the pause is rank 0's last step "
         "at world 4 to its first at world 6, the transfer the joiner's workers' `state_restored` seconds "
         "(the larger). HSDP freeze: the same job, a fresh one per repeat, node b's whole tree (its "
         "`elasticctl`, torchrun and workers) SIGSTOPped until the survivors train at world 4, then "
         "SIGCONTed: the job dropped it, so it comes back as a newcomer, timed to every worker at world 6; "
         "then the whole record's lineage is checked: no sample lost or trained twice "
         "(`bench/accounting.py`; a step in flight may be re-done once). "
         "FSDP2 without copies: 3 nodes × 1 worker, `--shard fsdp`, checkpoints every 10 "
         "steps, the nodes started one at a time once the job checkpointed at the world before, node c "
         "SIGKILLed 5 steps after a checkpoint at world 3, hot mode and restart mode in the same run. "
         "A join is `failed` when it did not reach world 6 or made a running worker restart. "
         "Chaos: `bench/chaos.py --trainer lm-hsdp`, seed 1"
         + (f", {chaos['events_planned']} events"
            + (" (a shorter soak than the target's 20 events)" if chaos["events_planned"] < 20 else "")
            if chaos.get("events_planned") else "") + "."),
        "",
        "| measurement | this run | target |",
        "|---|---|---|",
        *("| " + " | ".join(row) + " |" for row in sharded_rows(results)),
        "",
        sharded_targets(results),
        "",
        *hsdp_phase_section(results),
    ]


def hsdp_phase_section(results: dict) -> list[str]:
    """Where the HSDP kill's, join's, freeze's and thaw's seconds go (rank 0's timelines, medians over rounds)."""
    rounds = results["scenarios"].get("hsdp") or []
    freezes = results["scenarios"].get("hsdp_freeze") or []
    return phase_table("Where the HSDP rounds' seconds go (rank 0's timeline; medians over rounds; each cell is "
                       "the end of a phase, seconds after the SIGKILL or SIGSTOP, or after the joining node was "
                       "started or the frozen one SIGCONTed; a join's \"fault seen\" is the boundary at which the "
                       "running workers agreed to admit it):",
                       [("SIGKILL a node", [(r.get("kill") or {}).get("phases") for r in rounds]),
                        ("a node joins", [(r.get("join") or {}).get("phases") for r in rounds]),
                        ("SIGSTOP a node", [(r.get("freeze") or {}).get("phases") for r in freezes]),
                        ("the frozen node SIGCONTed", [(r.get("thaw") or {}).get("phases") for r in freezes])])


def machine_line(results: dict) -> str:
    m = results["machine"]
    return (f"{m['cpu_model']}, {m['cpu_count']} logical CPUs, {m['ram_gb']} GB RAM, {m['os']}, "
            f"Python {m['python']}, torch {m['torch']}, etcd {m['etcd']}")


def markdown(results: dict, png: str | None) -> str:
    load = results["load"]
    table = [("| measurement | elasticctl restart | elasticctl hot | plain torchrun | ratio hot/torchrun "
              "| ratio hot/restart |"), "|---|---|---|---|---|---|"]
    table += ["| " + " | ".join(row) + " |" for row in rows(results)]
    lifecycle = results["scenarios"].get("lifecycle", {})
    # Hot mode does not go back to a checkpoint: its re-done steps are in the targets line.
    observed = [v for v in _field(lifecycle.get(RESTART, []) + lifecycle.get(TORCHRUN, []),
                                  "crash", "redone_steps") if v is not None]
    every = results["settings"]["checkpoint_every"]
    parts = [
        "# Benchmarks: elasticctl (restart mode, hot recovery) next to plain torchrun",
        "",
        "<!-- generated by `python -m bench.run`; edit bench/report.py, not this file -->",
        "",
        f"Latest run: `{results['command']}` on {results['date']}, {results['duration_s'] / 60:.1f} min, "
        "repeats per scenario and system (interleaved): "
        + ", ".join(f"{k} {v}" for k, v in results["repeats"].items())
        + f", checkpoint {results['settings']['checkpoint_repeats']}, rendezvous "
        f"{results['settings']['rendezvous_repeats']}"
        + (" (1 from 256 agents)" if "rendezvous_max_agents" in results["settings"] else "")
        + (" (`--quick`: fewer than 3 where needed to stay short)." if results["mode"] == "quick"
           else "."),
        f"Machine: {machine_line(results)}.",
        (f"Load average (1 min) before the run: {load['before'][0]:.2f}, after: {load['after'][0]:.2f} "
        "(the machine is shared; other jobs may have run at the same time)."),
        f"Raw samples: [`{results['json']}`]({results['json']}).",
        "",
        *goodput_section(results),
        ("3 nodes × 1 worker, each node a process tree on 127.0.0.1, CPU, gloo, `trainers/mlp.py` "
        f"(`{' '.join(results['settings']['event_training'])}`, checkpoint every {every} steps in the "
        "event scenarios; the trainer's own `--pg-timeout` default: 60 s in restart mode and under "
        f"torchrun, the node TTL ({results['settings'].get('node_ttl_s', 5):g} s) in hot mode). "
        "Cells: median (min–max, n). Recovery times run from the signal (or node start) to the first "
        "completed step at the new world size, from the trainer's record."),
        "",
        *table,
        "",
        *([hot_targets(results), ""] if _ran_hot(results) else []),
        *recovery_phase_section(results),
        *reconfigure_bench.section(results, _cell, _ratio),
        *shapes_bench.section(results, _cell),
        *frameworks_bench.section(results),
        *straggler_bench.section(results),
        *trust_bench.section(results),
        ("Checkpoint cost (`bench/checkpoint.py`, `torchrun --standalone`, world 2, mean step time of a run; "
        "worst-case lost work per failure = the steps since the last checkpoint):"),
        "",
        "| trainer | checkpoint | step ms | overhead vs none | worst-case lost work per failure |",
        "|---|---|---|---|---|",
        *checkpoint_rows(results),
        "",
        (f"Steps re-done after a crash in restart mode and under torchrun, observed: {sorted(observed)} "
         f"(bound: {every}, the checkpoint interval).")
        if observed else "",
        "",
        *state_transfer_section(results),
        *sharded_section(results),
        *([f"Errors during the run: {'; '.join(results['errors'])}", ""] if results.get("errors") else []),
        *(rendezvous_section(results) if results["scenarios"].get("rendezvous") else []),
        *(scale_section(results) if results["scenarios"].get("rendezvous_scale") else []),
        *(real_handler_section(results) if results["scenarios"].get("rendezvous_real") else []),
        "## How each system is run",
        "",
        ("- **elasticctl**: one etcd (embedded, own loopback ports, separate from the nodes), "
        "`elasticctl up --etcd … --nnodes 1:3` on node a, `elasticctl join` on b, c (and d); "
        "every other setting at its default (node TTL 5 s)."),
        ("- **elasticctl hot**: the same, with `elasticctl up --recovery hot`: `trainers/mlp.py` is "
         "written on `elasticctl.train`, so survivors re-form the process group in process, a joiner "
         "gets the state from a running worker, and nothing restarts; the node TTL stays 5 s, and is "
         "the process group's timeout. The three systems run every job scenario in the same run, "
         "the order rotated per repeat so no system always runs first."),
        ("- **plain torchrun**: `torchrun --nnodes=1:3 --nproc-per-node=1 --rdzv-backend=c10d "
        "--rdzv-endpoint=127.0.0.1:PORT --rdzv-conf=last_call_timeout=1 --max-restarts=3 "
        "--local-addr=127.0.0.1` on each node, node a first (it binds PORT, so it hosts the c10d store), "
        "torch's other defaults, with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`: with torch's default "
        "shared agent store a node that joins a running job with rank ≥ 1 deadlocks in the rendezvous "
        "(node a starts alone at world 1, so b and c are such joiners), and the 3-node job never forms "
        "(seen while building this bench: no world of 3 within 120 s)."),
        ("- One job serves three events in turn (`lifecycle`): SIGKILL of node c's whole process tree, "
        "then start node d, then SIGSTOP of node b's tree; each starts from a world of 3 (2 for the "
        "scale-up). The kill of node a runs as a job of its own. Steady state: another job, no "
        "`--step-sleep`, no checkpoints, rank 0's steps/s over a window at world 3."),
        ("- Rendezvous scale (`bench/rendezvous.py`): see its section above."),
        "",
        "## Reading the numbers",
        "",
        ("- A frozen peer is only noticed by plain torchrun when a collective times out: the trainer's "
        "`--pg-timeout` (60 s here; gloo's default is 30 min). elasticctl notices the expired lease; "
        "in hot mode the survivors' collective times out after the node TTL."),
        ("- Scale-up pause: the gap in rank 0's step times around the change; in restart mode and under "
         "torchrun it is the whole restart. The joiner's `initialized` is when its first generation "
         "formed (in hot mode: after it was admitted and got the state), so that row excludes its "
         "process start-up and `import torch`; the next row includes them."),
        ("- The runs share 2 cores with three trainers, three agents and etcd; seconds here are "
        "dominated by process start-up and `import torch` of the restarted workers (restart mode, torchrun). A wide min–max "
        "usually means another job ran on the machine during that sample."),
        ("- Steps re-done: all systems meet each event at the same step of the checkpoint interval "
         "(a pseudo-random offset per repeat), so for restart mode and torchrun the row checks the bound "
         "rather than comparing systems; hot mode does not go back to a checkpoint, at most the step in "
         "flight is re-done."),
        "",
        "## Not measured here",
        "",
        ("- Plain torchrun with torch's default shared agent store: the 3-node job does not form "
         "(see above), so none of its rows could be measured."),
        ("- A network partition: nodes share one loopback interface, so SIGSTOP stands in for a "
         "frozen or cut-off peer; cutting links needs network namespaces."),
        "- GPUs / NCCL: this machine has none; `python -m bench.run` runs unchanged on a GPU host.",
    ]
    if png:
        parts += ["", "## World size and steps/s around a crash, a scale-up and a freeze", "",
                  f"![world size and steps/s over time]({png})", "",
                  "From the first repeat's records (rank 0's steps, 1 s bins); dashed lines mark the events."]
    return "\n".join(parts) + "\n"


def rendezvous_section(results: dict) -> list[str]:
    return [
        "## Rendezvous at scale: one round of N agents",
        "",
        ("`bench/rendezvous.py`: N real rendezvous handlers, built as torchrun builds them "
         "(min = max = N, `last_call_timeout=1`), in threads of ceil(N/64) processes (at most 16, "
         "so one interpreter's lock is not what is measured), connected first, then started at "
         "once; a cell is the seconds from the start to the last agent's `next_rendezvous()` return, "
         "every agent with world size N and the ranks exactly 0..N-1. Each etcd round has a fresh "
         "etcd; writes are etcd's puts + deletes during the round (its /metrics), per agent. "
         "Three backends in the same run:"),
        "",
        ("- **elasticctl etcd3**: elasticctl's etcd-native handler — one put per agent bound to its "
         "lease, the round sealed by one transaction, learned by watch."),
        ("- **previous main**: torch's `DynamicRendezvousHandler` (public API, `from_backend`) on "
         "elasticctl's `EtcdRendezvousBackend` and etcd store — the etcd3 of the main before "
         "elasticctl's own handler, without its liveness layer: the whole round in one pickled "
         "value that every agent compare-and-swaps; under contention most attempts fail and are "
         "retried, so its cost shows in raft proposals (failed transactions included), not in writes."),
        ("- **torch c10d**: torch's dynamic handler on a TCPStore hosted by agent 0 (no etcd), "
         "what plain torchrun uses."),
        "",
        (f"Plan: {_rendezvous_plan(results)}. \"not run\": the backend was not run at that size; "
         "\"none within 120 s\": it ran and no correct round formed (with how many agents got a "
         "round), and a ratio against it is an upper bound (\"< x\")."),
        "",
        *rendezvous_table(results),
        "",
        rendezvous_targets(results),
        "",
    ]


PHASE_LABELS = {"fault_seen": "fault seen", **PHASE_NAMES}


def recovery_phase_section(results: dict) -> list[str]:
    """Hot mode: when each phase of a recovery ended, seconds after the signal (medians of rank 0's
    ``recovery_timeline``); empty when no run recorded one (results from before it existed)."""
    runs = results["scenarios"].get("lifecycle", {}).get(HOT, [])
    columns = [(label, [(run.get(name) or {}).get("phases") for run in runs])
               for name, label in (("crash", "SIGKILL node c (s after the signal)"),
                                       ("freeze", "SIGSTOP node b (s after the signal)"))]
    return phase_table("Where a hot recovery's seconds go (rank 0's timeline; medians over repeats; each cell "
                       "is the end of a phase, seconds after the signal):", columns)


def phase_table(intro: str, columns: list[tuple[str, list[dict | None]]]) -> list[str]:
    """A table of phase ends (rows: :data:`PHASE_LABELS`), one column per event with its runs'
    ``phases`` (medians); a column no run measured and a phase no column has are left out."""
    columns = [(label, [phases for phases in runs if phases]) for label, runs in columns]
    columns = [(label, runs) for label, runs in columns if runs]
    if not columns:
        return []
    lines = [intro, "", "| phase ended | " + " | ".join(label for label, _ in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for phase, label in PHASE_LABELS.items():
        values = [_median([phases.get(phase) for phases in runs]) for _, runs in columns]
        if all(value is None for value in values):
            continue
        lines.append(f"| {label} | " + " | ".join("–" if v is None else f"{v:.3f}" for v in values) + " |")
    return [*lines, ""]


def text_table(results: dict) -> str:
    goodput_names = ("goodput", "healthy samples/s", "samples in the window", "kills", "kill → full world again (s)",
                     "samples lost", "load before → after")
    lines = [f"Goodput, {row[1]}, {row[0]}: " + ", ".join(f"{name} {value}" for name, value in zip(goodput_names, row[2:]))
             for row in goodput_rows(results)]
    names = ("elasticctl restart", "elasticctl hot", "torchrun", "ratio hot/torchrun", "ratio hot/restart")
    lines += [row[0] + "".join(f"\n    {name + ':':20s}{value}" for name, value in zip(names, row[1:]))
              for row in rows(results)]
    if _ran_hot(results):
        lines.append(hot_targets(results))
    lines += straggler_bench.text_lines(results)
    lines += frameworks_bench.text_lines(results)
    lines += ["checkpoint: " + row for row in checkpoint_rows(results)]
    if results["scenarios"].get("state_transfer"):
        lines.append(state_transfer_targets(results))
    lines += [f"{label}: {value} (target {target})" for label, value, target in sharded_rows(results)]
    if sharded_section(results):
        lines.append(sharded_targets(results))
    names = ("etcd3", "writes/agent", "proposals/agent etcd3 / previous", "previous main", "c10d",
             "etcd3/previous", "etcd3/c10d")
    lines += [f"rendezvous, {row[0]} agents: " + ", ".join(f"{n} {v}" for n, v in zip(names, row[1:]))
              for row in rendezvous_rows(results)]
    if results["scenarios"].get("rendezvous"):
        lines.append(rendezvous_targets(results))
    if results["scenarios"].get("rendezvous_scale"):
        lines += [f"rendezvous scale, {row[0]}, N={row[1]}: {row[2]} s, writes/agent {row[3]}, events {row[4]}, "
                  f"etcd CPU {row[5]} s" for row in scale_rows(results)]
        lines.append(scale_targets(results))
    if results["scenarios"].get("rendezvous_real"):
        lines += [f"rendezvous real handlers, N={agents} over {processes} processes: {complete} complete, {seconds} s, "
                  f"proposals/agent {proposals}, writes/agent {writes}, CAS/agent {cas}, leases expired {expired}, "
                  f"agents failed {failed}"
                  for agents, processes, complete, seconds, proposals, writes, cas, expired, failed, _load
                  in real_handler_rows(results)]
        lines.append(real_handler_targets(results))
    return "\n".join(lines)


def main() -> None:
    """Regenerate BENCHMARKS.md from a results file: python -m bench.report bench/results/X.json"""
    path = Path(sys.argv[1])
    results = json.loads(path.read_text())
    png = results.get("png")
    (REPO / "BENCHMARKS.md").write_text(markdown(results, png))
    print(text_table(results))


if __name__ == "__main__":
    main()
