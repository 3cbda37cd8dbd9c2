"""Step-time cost of checkpointing every N steps: none vs synchronous vs asynchronous saves.

Runs each trainer under ``torchrun --standalone`` (world size 2, CPU/gloo by
default) three ways in the same session, interleaved, and reports the mean
step time of each run and its overhead over the run without checkpoints
(min/median/max over the repeats), and how long each save held up the
training thread (``save_blocked_ms``, min/median/max over all saves): the
low-noise figure on a shared machine. The step time comes from the trainers'
own records: mlp writes one timestamped line per step, cifar10 a start and a
done line.

Run: python -m bench.checkpoint --every 10 --repeat 3 [--trainers mlp cifar10] [--mlp-hidden 64 65536]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = {"none": [], "sync": ["--checkpoint-every", "{every}"],
         "async": ["--checkpoint-every", "{every}", "--async-checkpoint"]}


def run(script: str, args: list[str], nproc: int, workdir: Path) -> list[dict]:
    record = workdir / "record.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(REPO / "trainers" / script), *args, "--record", str(record)]
    subprocess.run(command, check=True, capture_output=True, timeout=900, cwd=workdir)
    return [json.loads(line) for line in record.read_text().splitlines()]


def mlp_step_time(records: list[dict]) -> float:
    times = [r["time"] for r in records if "event" not in r and r["rank"] == 0]
    return (times[-1] - times[0]) / (len(times) - 1)


def cifar10_step_time(records: list[dict]) -> float:
    start = next(r for r in records if r.get("event") == "start")
    done = next(r for r in records if r.get("event") == "done")
    return (done["time"] - start["time"]) / (done["step"] - start["step"])


def blocked_ms(records: list[dict]) -> list[float]:
    """How long each periodic save held up rank 0's training thread."""
    return [r["blocked_ms"] for r in records if r.get("event") == "checkpoint"]


def bench(name: str, script: str, base_args: list[str], step_time, every: int, repeat: int, nproc: int) -> dict:
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    blocked: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(repeat):
        for mode, extra in MODES.items():  # interleaved, so load drift hits every mode alike
            with tempfile.TemporaryDirectory() as tmp:
                args = [*base_args, *(a.format(every=every) for a in extra)]
                if mode == "none":
                    args += ["--checkpoint-every", "0"]  # no directory either: nothing is written
                else:
                    args += ["--checkpoint-dir", str(Path(tmp) / "ckpt"), "--keep", "2"]
                records = run(script, args, nproc, Path(tmp))
                times[mode].append(step_time(records))
                blocked[mode] += blocked_ms(records)
    base = statistics.median(times["none"])
    result = {"trainer": name, "every": every, "world_size": nproc}
    for mode, values in times.items():
        ms = sorted(v * 1000 for v in values)
        result[mode] = {"step_ms": [round(ms[0], 2), round(statistics.median(ms), 2), round(ms[-1], 2)],
                        "samples_ms": [round(v, 3) for v in ms],
                        "overhead_pct_of_median": round((statistics.median(values) / base - 1) * 100, 1)}
        if blocked[mode]:
            b = sorted(blocked[mode])
            result[mode]["save_blocked_ms"] = [b[0], round(statistics.median(b), 2), b[-1]]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2, help="workers (world size)")
    parser.add_argument("--steps", type=int, default=200, help="mlp steps per run")
    parser.add_argument("--mlp-hidden", type=int, nargs="+", default=[64, 65536],
                        help="mlp hidden sizes (64: ~5 KB checkpoints; 65536: ~4.5 MB)")
    parser.add_argument("--cifar10-steps", type=int, default=100, help="cifar10 steps per run")
    parser.add_argument("--trainers", nargs="+", default=["mlp", "cifar10"], choices=["mlp", "cifar10"])
    args = parser.parse_args()
    results = []
    if "mlp" in args.trainers:
        for hidden in args.mlp_hidden:
            results.append(bench(f"mlp --hidden {hidden}", "mlp.py",
                                 ["--steps", str(args.steps), "--hidden", str(hidden), "--log-every", "0"],
                                 mlp_step_time, args.every, args.repeat, args.nproc))
            print(json.dumps(results[-1]), flush=True)
    if "cifar10" in args.trainers:
        results.append(bench("cifar10", "cifar10.py",
                             ["--fake-data", "--fake-size", "50000", "--epochs", "1", "--workers", "1",
                              "--max-steps", str(args.cifar10_steps)],
                             cifar10_step_time, args.every, args.repeat, args.nproc))
        print(json.dumps(results[-1]), flush=True)


if __name__ == "__main__":
    main()
