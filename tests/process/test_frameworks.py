"""The training frameworks' own scripts under elasticctl: PyTorch Lightning's and Hugging Face's
``Trainer`` through a node's SIGKILL, another node's join and its leave, every sample of an epoch
trained once.

docs/examples/lightning_trainer.py and docs/examples/huggingface_trainer.py are each framework's
tutorial form with elasticctl's ``Trainer`` imported; they run here as their pages
(docs/lightning.md, docs/huggingface.md) say. Each integration appends,
per rank and step, the sample indices trained to a ledger (ELASTICCTL_SAMPLE_LEDGER); each start
of the workers writes a "start" line with the step it resumed at, so the steps a restart rolled
back (trained after the checkpoint it resumed from) are told from those that count.

Layer tests/process: real elasticctl/torchrun/worker processes, a real etcd, loopback. Skipped,
saying so, where the framework is not installed (`pip install 'elasticctl[lightning]'`,
`'elasticctl[huggingface]'`). The other tests of this subject: tests/unit/test_lightning_contract.py
and tests/unit/test_huggingface_contract.py (what each integration relies on in its framework).
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import pytest
from support.helpers import ELASTICCTL, REPO, cli, wait_for

from elasticctl.etcd.client import EtcdClient
from elasticctl.job.registry import Registry

pytestmark = pytest.mark.slow

LIGHTNING_EXAMPLE = str(REPO / "docs" / "examples" / "lightning_trainer.py")
SAMPLES, BATCH = 512, 8  # each example's dataset and batch size per worker


def lightning_checkpoints(directory: Path) -> list[int]:
    return [int(p.name[5:13]) for p in directory.glob("step-*.pt")]


def huggingface_checkpoints(directory: Path) -> list[int]:
    from elasticctl.integrations.huggingface import MANIFEST

    return [int(p.name.split("-")[1]) for p in directory.glob("checkpoint-*") if (p / MANIFEST).exists()]


# framework: (the module it needs, its example, the arguments that make it run until `down`,
# the steps of its committed checkpoints)
FRAMEWORKS = {
    "lightning": ("lightning", LIGHTNING_EXAMPLE, ["--max-epochs", "100000"], lightning_checkpoints),
    "huggingface": ("transformers", str(REPO / "docs" / "examples" / "huggingface_trainer.py"),
                    ["--epochs", "100000"], huggingface_checkpoints),
}


# loop: (the module it needs, its extra, its example) for hot mode
LOOPS = {
    "fabric": ("lightning", "lightning", str(REPO / "docs" / "examples" / "fabric_loop.py")),
    "accelerate": ("accelerate", "huggingface", str(REPO / "docs" / "examples" / "accelerate_loop.py")),
}


def read_ledger(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    if lines and not path.read_text().endswith("\n"):
        lines = lines[:-1]  # a line being written
    return [json.loads(line) for line in lines]


def generations(ledger: list[dict]) -> list[dict]:
    """The starts of the workers in order, each with its world size, the step it started at and
    the steps its ranks trained. Every rank of a start writes its "start" line before any rank
    can finish a step (the step's all-reduce waits for every rank), so a "start" after a step
    line begins the next generation."""
    found: list[dict] = []
    stepped = True
    for record in ledger:
        if record.get("event") == "start":
            if stepped:
                found.append({"step": record["step"], "world_size": record["world_size"],
                              "consumed": record["consumed"], "steps": []})
                stepped = False
        elif found:
            found[-1]["steps"].append(record)
            stepped = True
    return found


def committed(gens: list[dict]) -> list[dict]:
    """The step records that count: each generation's up to the step the next one resumed at."""
    kept = []
    for i, gen in enumerate(gens):
        until = gens[i + 1]["step"] if i + 1 < len(gens) else None
        kept += [r for r in gen["steps"] if until is None or r["step"] <= until]
    return kept


def exactly_once(gens: list[dict]) -> None:
    """Every sample of every whole epoch trained once, and none twice in the last one. A step's
    samples are the union of its records: each rank of a Trainer names its own share; each rank
    of an elasticctl.train loop names the whole step's (a rank killed right after the step's
    all-reduce writes no line, yet its samples were trained)."""
    steps: dict[int, tuple[int, set]] = {}
    for record in committed(gens):
        steps.setdefault(record["step"], (record["epoch"], set()))[1].update(record["indices"])
    by_epoch = collections.defaultdict(collections.Counter)
    for epoch, indices in steps.values():
        by_epoch[epoch].update(indices)
    last = max(by_epoch)
    for epoch, counts in by_epoch.items():
        assert max(counts.values()) == 1, f"epoch {epoch}: a sample was trained twice"
        if epoch < last:
            assert sorted(counts) == list(range(SAMPLES)), f"epoch {epoch}: a sample was never trained"


def trained_at(ledger: list[dict], world: int, steps_after_start: int) -> bool:
    """Whether the newest generation trains at ``world`` and has done ``steps_after_start`` steps."""
    gens = generations(ledger)
    if not gens or gens[-1]["world_size"] != world:
        return False
    done = {r["step"] for r in gens[-1]["steps"]}
    return len(done) >= steps_after_start


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_a_frameworks_trainer_goes_through_a_kill_a_join_and_a_leave_training_every_sample_once(
        nodes, default_etcd, run_id, tmp_path, framework):
    module, example, endless, committed_steps = FRAMEWORKS[framework]
    pytest.importorskip(module, reason=f"{module} is not installed: pip install 'elasticctl[{framework}]'")
    ledger, checkpoints = tmp_path / "ledger.jsonl", tmp_path / "checkpoints"
    env = {"ELASTICCTL_SAMPLE_LEDGER": str(ledger)}
    # Long enough never to end by itself while the test watches: it ends with `down`.
    # Under constant-batch: every step holds the global batch of the first start at each world size.
    up = [*ELASTICCTL, "up", "--etcd", default_etcd.endpoint, "--job", run_id, "--nnodes", "1:2", "--node-id", "a",
          "--checkpoint-dir", str(checkpoints), example, *endless, "--batch-policy", "constant-batch"]
    a = nodes("a", up, env, cwd=tmp_path)  # where Lightning's logger writes lightning_logs/

    def join(name: str):
        return nodes(name, [*ELASTICCTL, "join", "--etcd", default_etcd.endpoint, "--job", run_id,
                            "--node-id", name], env, cwd=tmp_path)

    with EtcdClient(default_etcd.client_settings()) as client:
        wait_for(Registry(client, run_id).read_spec, 60, "the job spec in etcd")
    b = join("b")  # a may train alone until b is in
    # Past the first checkpoints (every 10 steps) at world 2, then b dies as a machine does.
    wait_for(lambda: trained_at(read_ledger(ledger), 2, 25), 240, "25 steps at world size 2")
    b.kill()
    wait_for(lambda: trained_at(read_ledger(ledger), 1, 25), 240, "a training alone after b died")
    c = join("c")
    # A whole epoch (32 steps at world 2) after c joined.
    wait_for(lambda: trained_at(read_ledger(ledger), 2, 40), 240, "a and c training at world size 2")
    # c leaves: a final checkpoint at the step both trained last, c exits 0, a goes on alone from it.
    assert cli("leave", "--etcd", default_etcd.endpoint, "--job", run_id, "--node", "c").returncode == 0
    assert c.wait(120) == 0, c.log()
    wait_for(lambda: trained_at(read_ledger(ledger), 1, 5), 240, "a training alone after c left")
    assert cli("down", "--etcd", default_etcd.endpoint, "--job", run_id).returncode == 0
    assert a.wait(120) == 0, a.log()
    # SIGTERM stopped the workers at a step boundary, not torchrun's SIGKILL 30 s later.
    assert "forcefully exiting" not in a.log() + c.log()

    gens = generations(read_ledger(ledger))
    # (a may have trained alone before b was in: a generation at world 1 first)
    assert [g["world_size"] for g in gens][-4:] == [2, 1, 2, 1], gens
    killed, joined, left = gens[-3:]
    # b's death: a resumed from the newest checkpoint before it, a periodic one (every 10 steps),
    # or one of the step both trained last when b's worker got its parent's death signal
    # (SIGTERM) a moment before its own SIGKILL and the two stopped together
    trained_before = max(r["step"] for r in gens[-4]["steps"])
    assert killed["step"] <= trained_before and (killed["step"] % 10 == 0 or killed["step"] == trained_before)
    # c's join and c's leave lost no step: torchrun stops the workers with SIGTERM to re-form, and
    # they stop at a step boundary with a checkpoint of the step they trained last
    assert joined["step"] == max(r["step"] for r in killed["steps"]), gens
    assert left["step"] == max(r["step"] for r in joined["steps"]), gens
    # and `down` wrote one more at a's last step
    assert max(committed_steps(checkpoints)) == max(r["step"] for r in gens[-1]["steps"])
    kept = committed(gens)
    exactly_once(gens)
    # b's death was mid-epoch (the point of the sampler): a resumed alone inside an epoch.
    assert 0 < killed["consumed"] < SAMPLES, killed
    # The global batch held at both world sizes (the first start's: 8, or 16 where b was in at
    # once). Lightning counts its accumulation windows from the epoch's top, so the first step
    # of a start (and an epoch's last) may be short there; every other step is whole.
    world = next(g for g in gens if g["steps"])["world_size"]  # the first start that trained
    first_start = f"world size {world} ({world} nodes x 1);" if framework == "lightning" else f"world size {world};"
    assert f"{first_start} batch policy 'constant-batch': global batch {BATCH * world}" in a.log() + b.log(), \
        a.log()
    for gen in gens:
        per_step = collections.Counter()
        for record in gen["steps"]:
            per_step[(record["epoch"], record["step"])] += len(record["indices"])
        steps = sorted(per_step)
        # Not a generation's last step: a rank killed right after its all-reduce wrote no line of
        # it. Lightning: nor the start's first step, nor an epoch's last (the window the short
        # first step shifted).
        ends = {max(s for s in steps if s[0] == epoch) for epoch, _ in steps}
        whole = [s for s in steps[1:] if s not in ends] if framework == "lightning" else steps[:-1]
        assert {per_step[s] for s in whole} <= {BATCH * world}, (gen["world_size"], per_step)
    # The loss goes on from where it was, not from an untrained model's: after c joined it is a
    # fraction of the first steps' (Lightning's regression: about 0.1 against 12; transformers'
    # counting sequences: about 2.2 against 4.4, which an untrained model starts at).
    losses = {r["step"]: r["loss"] for r in kept if r["rank"] == 0}
    first = sum(losses[s] for s in sorted(losses)[:5]) / 5
    after_join = [losses[s] for s in sorted(losses) if s > joined["step"]][:5]
    assert sum(after_join) / len(after_join) < 0.6 * first, (first, after_join)


def test_the_lightning_example_run_twice_goes_on_where_the_first_run_ended(nodes, tmp_path):
    pytest.importorskip("lightning", reason="Lightning is not installed: pip install 'elasticctl[lightning]'")
    # A world of one (`python lightning_trainer.py`): the first run ends with a checkpoint of its
    # last step; the second, with one more epoch, resumes there and trains that epoch, each sample once.
    ledger, checkpoints = tmp_path / "ledger.jsonl", tmp_path / "checkpoints"
    env = {"ELASTICCTL_SAMPLE_LEDGER": str(ledger), "ELASTICCTL_CHECKPOINT_DIR": str(checkpoints)}
    first = nodes("first", [sys.executable, LIGHTNING_EXAMPLE, "--max-epochs", "1"], env, cwd=tmp_path)
    assert first.wait(180) == 0, first.log()
    second = nodes("second", [sys.executable, LIGHTNING_EXAMPLE, "--max-epochs", "2"], env, cwd=tmp_path)
    assert second.wait(180) == 0, second.log()
    assert "Traceback" not in second.log(), second.log()

    gens = generations(read_ledger(ledger))
    steps_per_epoch = SAMPLES // BATCH  # 64; checkpoints every 10, and one as training ends
    assert [g["step"] for g in gens] == [0, steps_per_epoch], gens
    assert f"resuming at step 64 from {checkpoints / 'step-00000064.pt'}" in second.log(), second.log()
    kept = committed(gens)
    assert sorted(r["step"] for r in kept) == list(range(1, 2 * steps_per_epoch + 1))
    for epoch in (0, 1):
        counts = collections.Counter(i for r in kept if r["epoch"] == epoch for i in r["indices"])
        assert sorted(counts) == list(range(SAMPLES)) and max(counts.values()) == 1, epoch


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_frameworks_own_loop_in_hot_mode_keeps_its_survivor_through_a_kill_and_a_join(
        nodes, default_etcd, run_id, tmp_path, loop):
    module, extra, example = LOOPS[loop]
    pytest.importorskip(module, reason=f"{module} is not installed: pip install 'elasticctl[{extra}]'")
    ledger = tmp_path / "ledger.jsonl"
    env = {"ELASTICCTL_SAMPLE_LEDGER": str(ledger)}
    up = [*ELASTICCTL, "up", "--etcd", default_etcd.endpoint, "--job", run_id, "--nnodes", "1:2", "--node-id", "a",
          "--recovery", "hot", example, "--epochs", "100000"]
    a = nodes("a", up, env, cwd=tmp_path)

    def join(name: str):
        return nodes(name, [*ELASTICCTL, "join", "--etcd", default_etcd.endpoint, "--job", run_id,
                            "--node-id", name], env, cwd=tmp_path)

    with EtcdClient(default_etcd.client_settings()) as client:
        wait_for(Registry(client, run_id).read_spec, 60, "the job spec in etcd")
    b = join("b")
    wait_for(lambda: trained_at(read_ledger(ledger), 2, 25), 240, "25 steps at world size 2")
    b.kill()
    wait_for(lambda: trained_at(read_ledger(ledger), 1, 25), 240, "a training alone after b died")
    c = join("c")
    # More than an epoch at world 2 (32 steps) after c joined.
    wait_for(lambda: trained_at(read_ledger(ledger), 2, 40), 240, "a and c training at world size 2")
    assert cli("down", "--etcd", default_etcd.endpoint, "--job", run_id).returncode == 0
    assert a.wait(120) == 0, a.log()
    assert c.wait(120) == 0, c.log()
    assert "Traceback" not in a.log() + c.log(), a.log() + c.log()

    records = read_ledger(ledger)
    gens = generations(records)
    # (a may have trained alone before b was in, and `down` may reach one node a moment before the
    # other, which then trains on alone until it stops: a generation at world 1 first and last)
    joined_at = max(i for i, g in enumerate(gens) if g["world_size"] == 2)
    assert [g["world_size"] for g in gens][joined_at - 2:joined_at + 1] == [2, 1, 2], gens
    together, alone, joined = gens[joined_at - 2:joined_at + 1]
    # Hot: a's worker kept its process from before b's death to after c's join (the same pid
    # trained at world 2, alone, and with c), and each generation went on at the step the last
    # one reached: nothing rolled back, nothing restarted.
    (a_pid,) = {r["pid"] for r in alone["steps"]}
    assert a_pid in {r["pid"] for r in together["steps"]} and a_pid in {r["pid"] for r in joined["steps"]}
    assert alone["step"] == max(r["step"] for r in together["steps"] if r["pid"] == a_pid)
    assert joined["step"] == max(r["step"] for r in alone["steps"])
    # c trained from the state a sent it: its first step is the generation's, not the first one.
    c_steps = [r["step"] for r in joined["steps"] if r["pid"] != a_pid]
    assert c_steps and min(c_steps) == joined["step"] + 1, joined["step"]
    assert 0 < alone["consumed"] < SAMPLES or 0 < joined["consumed"] < SAMPLES, (alone, joined)
    exactly_once(gens)
    # The loss went on from where it was: after c joined it is a fraction of the first steps'.
    losses = {r["step"]: r["loss"] for r in committed(gens) if r["rank"] == 0}
    first = sum(losses[s] for s in sorted(losses)[:5]) / 5
    after_join = [losses[s] for s in sorted(losses) if s > joined["step"]][:5]
    assert sum(after_join) / len(after_join) < first / 2, (first, after_join)
