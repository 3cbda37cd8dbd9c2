"""Non-finite values in real jobs: two `elasticctl up` nodes, a NaN made on one rank by the trainer's
``--nan-at STEP:RANK[:WHAT]`` knob, before the all-reduce spreads it. Its node is named in a
``non_finite`` event (what it produced, the step); with ``--skip-non-finite 1`` the step is skipped
on both ranks, so the parameters after it are those before it, and training goes on finite;
without it the step is applied, the NaN stays in the model, and the run of non-finite steps that
follows is one event, not one per step.

Every wait is on the job's records or the nodes' exits; nothing is asserted on seconds. --nnodes
2:2: every generation has both nodes, so the NaN is always made at world 2.
"""

from __future__ import annotations

import math

import pytest
from support.helpers import MLP, wait_for
from support.jobs import Job

from elasticctl.job.events import EventLog, render_line
from elasticctl.job.records import EventKind

NAN_STEP = 10
STEPS = 30


def non_finite_job(nodes, etcd, run_id, tmp_path, *, nan_at: str, skip: bool, recovery: str = "hot") -> Job:
    train = [MLP, "--steps", str(STEPS), "--step-sleep", "0.05", "--log-every", "0", "--record-params",
             "--nan-at", nan_at]
    extra = ["--recovery", recovery, "--checkpoint-dir", str(tmp_path / "checkpoints"),
             "--skip-non-finite", "1" if skip else "0"]
    return Job(nodes, etcd, run_id, tmp_path, nnodes="2:2", extra=extra, train=train)


def events_of(job: Job) -> list:
    return [e for e in EventLog(job.client, job.registry.keys).read() if e.kind is EventKind.NON_FINITE]


def history(job: Job) -> str:
    return "\n".join(render_line(e) for e in EventLog(job.client, job.registry.keys).read())


def run_to_the_end(job: Job) -> tuple[dict, list[dict]]:
    """Start both nodes, wait for both to finish every step; the NaN's record and the step lines."""
    started = job.start("a", "b")
    for name, node in started.items():
        assert node.wait(180) == 0, node.log()
    records = job.records()
    made = [r for r in records if r.get("event") == "nan_made"]
    assert len(made) == 1 and made[0]["step"] == NAN_STEP and made[0]["world_size"] == 2, made
    return made[0], [r for r in records if "event" not in r]


def params_before(steps: list[dict], step: int) -> set[str]:
    """The parameters' digests every rank recorded before ``step`` (its last execution per rank)."""
    return {r["params"] for r in steps if r["step"] == step}


@pytest.mark.parametrize("recovery", ["hot", "restart"])
def test_skip_non_finite_names_the_rank_whose_gradients_were_nan_and_skips_the_step_everywhere(
        nodes, default_etcd, run_id, tmp_path, recovery):
    job = non_finite_job(nodes, default_etcd, run_id, tmp_path, nan_at=f"{NAN_STEP}:1:gradients", skip=True,
                         recovery=recovery)
    made, steps = run_to_the_end(job)
    found = wait_for(lambda: events_of(job) or None, 30, "the non_finite event")
    assert [(e.node, e.step) for e in found] == [(made["node"], NAN_STEP)], history(job)
    assert "rank 1's gradients were not finite before the all-reduce" in found[0].reason, found[0].reason
    assert "skipped" in found[0].reason
    # Skipped on both ranks: the parameters after step NAN_STEP are those before it, the same on
    # both, and the next step changes them again
    before, after = params_before(steps, NAN_STEP), params_before(steps, NAN_STEP + 1)
    assert len(before) == 1 and before == after, (before, after)
    assert params_before(steps, NAN_STEP + 2) != after
    # Its loss was finite (the NaN was in its gradients alone), and so is every loss after it
    assert all(math.isfinite(r["loss"]) for r in steps), [r for r in steps if not math.isfinite(r["loss"])]
    assert max(r["step"] for r in steps) == STEPS - 1


def test_without_skip_a_nan_loss_is_named_once_and_stays_in_the_model(nodes, default_etcd, run_id, tmp_path):
    job = non_finite_job(nodes, default_etcd, run_id, tmp_path, nan_at=f"{NAN_STEP}:0", skip=False)
    made, steps = run_to_the_end(job)
    found = wait_for(lambda: events_of(job) or None, 30, "the non_finite event")
    assert [(e.node, e.step) for e in found] == [(made["node"], NAN_STEP)], history(job)
    assert "rank 0's loss and gradients were not finite before the all-reduce" in found[0].reason, found[0].reason
    assert "applied" in found[0].reason
    # Applied: every later step is NaN on both ranks, one run of non-finite steps and one event
    assert all(math.isnan(r["loss"]) for r in steps if r["step"] > NAN_STEP)
    assert all(math.isfinite(r["loss"]) for r in steps if r["step"] < NAN_STEP)
