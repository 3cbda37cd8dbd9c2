"""`elasticctl status` as text: the job, its nodes, and what the trainer last reported."""

from __future__ import annotations

import datetime
import time

from elasticctl.job.options import RecoveryMode
from elasticctl.job.records import MemberState, NodeState
from elasticctl.job.registry import JobView


def _age(timestamp: float | None) -> str:
    if not timestamp:
        return "-"
    seconds = max(0, int(time.time() - timestamp))
    if seconds < 120:
        return f"{seconds}s ago"
    if seconds < 7200:
        return f"{seconds // 60}m ago"
    try:
        return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M")
    except (OverflowError, OSError, ValueError):  # a time no clock of ours wrote
        return "-"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def render(view: JobView) -> str:
    data = view.to_dict()
    spec = view.spec
    lines = [f"job {view.name}" + (" (down requested)" if view.down_requested else "")]
    if spec is not None:
        lines.append(f"  script    {spec.script} {' '.join(spec.script_args)}".rstrip())
        lines.append(f"  nnodes    {spec.nnodes}   nproc/node {spec.nproc_per_node}   max restarts {spec.max_restarts}"
                     f"   checkpoints {spec.checkpoint_dir or '-'}")
    nodes = data["world_size"]
    hot = view.recovery is RecoveryMode.HOT
    label = "generation" if hot else "round    "
    lines.append(f"  {label} {data['round'] if data['round'] is not None else '-'}   "
                 f"world size {nodes} node{'s' if nodes != 1 else ''}"
                 + ("   (hot recovery: survivors re-form in process)" if hot else ""))
    if data["spares"] or data["spares_expected"]:
        short = data["spares_expected"] - len(data["spares"])
        lines.append(f"  spares    {len(data['spares'])} waiting warm" + (f" of {data['spares_expected']} expected"
                     if data["spares_expected"] else "") + (f"   ({short} SHORT)" if short > 0 else ""))
    rows = [["NODE", "HOST", "ADDRESS", "STATE", "RANK", "GPUS", "NPROC", "RESTARTS", "JOINED"]]
    for node in data["nodes"]:
        state = node.get("state", "?")
        if state == NodeState.RUNNING:
            state = node.get("rendezvous", MemberState.JOINING.value)
        rows.append([
            node["id"], str(node.get("host", "-")), str(node.get("addr", "-")), state,
            str(node.get("rank", "-")), str(node.get("gpus", 0)), str(node.get("nproc", "-")),
            str(node.get("restarts", 0)), _age(node.get("joined_at")),
        ])
    lines.append("")
    lines.extend(_table(rows) if len(rows) > 1 else ["no live nodes"])
    progress = view.progress
    if progress:
        fields = [f"step {progress.get('step', '-')}"]
        for key, label in (("epoch", "epoch"), ("loss", "loss"), ("samples_per_s", "samples/s"),
                           ("world_size", "workers"), ("last_checkpoint_step", "last checkpoint at step")):
            if progress.get(key) is not None:
                value = progress[key]
                fields.append(f"{label} {value:.4g}" if isinstance(value, float) else f"{label} {value}")
        lines.append("")
        lines.append("trainer   " + ", ".join(fields) + f"   ({_age(progress.get('time'))})")
        if progress.get("checkpoint_error"):
            lines.append(f"CHECKPOINTS FAILING ({progress.get('checkpoint_failures', 1)} in a row, "
                         f"training goes on): {progress['checkpoint_error']}")
    return "\n".join(lines)
