"""deploy/slurm/elasticctl.sbatch on a real Slurm (Debian's slurmctld, slurmd and munge) on this host.

The module starts a controller and three slurmd nodes (``n1``, ``n2``, ``n3``), configured by
the test under a temporary directory and on loopback only (tests/support/slurm.py says how:
each Slurm host is a set of namespaces with its own host name, hosts file and PID space,
sharing this machine's network). The jobs are the sbatch script itself, submitted with
``sbatch`` and small settings: it runs ``elasticctl etcd`` on the first node, then ``srun``
runs ``elasticctl up`` on every node, which train ``trainers/mlp.py``. Every wait is on a
Slurm state (sinfo, scontrol), the job's output or the trainer's record, never a sleep.

- the script runs etcd, then ``elasticctl up`` on two nodes, trains to the end at world 2,
  exits 0 and leaves no etcd behind;
- the time limit's warning signal, sent by slurmctld's own time-limit check, stops the run
  gracefully with a final checkpoint; the job requeues itself and the second run resumes
  at that checkpoint's step; SIGTERM (what ``scancel`` and the limit itself send the batch
  script) then ends the job with a final checkpoint and no requeue;
- the loss of one node of three (its whole host killed: slurmd, slurmstepd and the tasks)
  leaves the two others training at world 2, and the job keeps running, on the two, after
  Slurm has set that node DOWN.

Several slurmd on one host: Debian's Slurm 22.05 is built with ``--enable-multiple-slurmd``
(``scontrol show config``: ``MULTIPLE_SLURMD = Yes``); ``slurmd -N n2`` next to ``slurmd -N n1``,
each with its own port, spool and logs, sharing one munged, ran a two-node ``srun`` here.

What does not run here, and why:
- GPUs (``--gres=gpu``): this machine has none.
- ``proctrack/cgroup``: it works here (cgroup v1 freezer, no systemd needed), but it creates
  ``/sys/fs/cgroup/freezer/slurm_<node>`` outside the test's directory and leaves it behind when
  a node is killed; ``proctrack/linuxproc`` is used instead, which likewise signals every
  descendant of a step (a process that double-forks out of the step would escape it, none does).
- Nodes on separate network stacks or machines: every node is 127.0.0.1 (loopback only).
- Preemption (``PreemptMode=REQUEUE``): Slurm requeues the job itself; not configured here.
tests/process/test_deploy_tools.py keeps the static checks and the stub-Slurm runs.

Layer tests/infra: real infrastructure daemons. Needs root and ``slurm-wlm`` + ``munge``;
skipped, saying which is missing, otherwise. ``pytest -s`` prints the measured times.
"""

from __future__ import annotations

import re
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.deploy import SBATCH
from support.helpers import MLP, REPO, read_records, wait_for
from support.slurm import ACTIVE_STATES, SlurmCluster, SlurmError, unavailable_reason

from elasticctl.embedded_etcd import free_port

pytestmark = [pytest.mark.slow, pytest.mark.skipif(unavailable_reason() is not None,
                                                   reason=unavailable_reason() or "")]

# The signal the script asks for before the time limit (its #SBATCH --signal=B:SIG@N line).
WARNING_SIGNAL = re.search(r"^#SBATCH --signal=B:(\w+)@", SBATCH.read_text(), flags=re.MULTILINE).group(1)
# Steps that a run cannot finish before the event a test waits for; the test ends the job.
ENDLESS = ["--steps", "1000000", "--step-sleep", "0.05"]


def report(what: str, seconds: float) -> None:
    print(f"\n[slurm] {what}: {seconds:.1f} s", flush=True)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    started = time.monotonic()
    try:
        cluster.start()
    except (SlurmError, AssertionError):
        cluster.stop()
        raise
    report("cluster up (munge, slurmctld, 3 slurmd idle)", time.monotonic() - started)
    yield cluster
    leftovers = cluster.stop()
    assert not leftovers, f"processes of the Slurm cluster survived its teardown: {leftovers}"


# -- jobs ------------------------------------------------------------------------------------


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_pair() -> int:
    """A free loopback port whose successor is free too: etcd's client and peer ports."""
    for _ in range(100):
        port = free_port()
        if port < 65535 and _bindable(port + 1):
            return port
    raise AssertionError("no two consecutive free ports on 127.0.0.1")


@dataclass
class Job:
    slurm: SlurmCluster
    id: str
    workdir: Path
    etcd_port: int

    @property
    def record(self) -> Path:
        return self.workdir / "record.jsonl"

    def output(self) -> str:
        path = self.workdir / f"slurm-{self.id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def state(self) -> dict[str, str]:
        return self.slurm.job(self.id)

    def records(self) -> list[dict]:
        return read_records(self.record)

    def wait_ended(self, timeout: float) -> dict[str, str]:
        return wait_for(lambda: (s := self.state()).get("JobState") not in ACTIVE_STATES and s, timeout,
                        f"job {self.id} to end")

    def terminate_batch_script(self) -> None:
        """SIGTERM to the batch script alone (its tasks and etcd get none from Slurm)."""
        self.slurm.command("scancel", "--batch", "--signal=TERM", self.id)

    def describe(self) -> str:
        return f"job {self.id}: {self.state()}\n--- output\n{self.output()[-4000:]}"


def submit(slurm: SlurmCluster, name: str, nodes: int, trainer_args: list[str], *sbatch_options: str,
           min_nodes: int = 1) -> Job:
    """sbatch the script from the repository, as docs/operations.md does, with small settings."""
    workdir = slurm.jobs / name
    workdir.mkdir()
    job_settings = {
        "MIN_NODES": min_nodes, "NPROC_PER_NODE": 1, "CHECKPOINT_DIR": workdir / "checkpoints",
        "ETCD_PORT": free_port_pair(), "ETCD_LISTEN": "127.0.0.1",
        "TMPDIR": workdir,  # where the script puts etcd's data directory
        "PATH": f"{Path(sys.executable).parent}:{slurm.env['PATH']}",  # this elasticctl and python
        "PYTHONUNBUFFERED": 1,
    }
    job_id = slurm.sbatch(
        f"--job-name={name}", f"--nodes={nodes}", "--cpus-per-task=1", f"--output={workdir}/slurm-%j.out",
        *sbatch_options, "--export=ALL," + ",".join(f"{k}={v}" for k, v in job_settings.items()),
        str(SBATCH), MLP, "--record", str(workdir / "record.jsonl"), "--log-every", "0", "--batch-size", "8",
        *trainer_args, cwd=REPO)
    return Job(slurm, job_id, workdir, job_settings["ETCD_PORT"])


def steps(records: list[dict], world: int | None = None, since: float = 0.0) -> list[dict]:
    return [r for r in records if "step" in r and "event" not in r and r["time"] > since
            and (world is None or r["world_size"] == world)]


def events(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r.get("event") == kind]


def seconds(duration: str) -> int:
    """Slurm's [D-]HH:MM:SS (RunTime) in seconds."""
    days, _, clock = duration.rpartition("-")
    h, m, s = (int(x) for x in clock.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


def etcd_processes_of(job: Job) -> list[str]:
    return [p for p in job.slurm.leftovers(within=job.workdir) if "etcd" in p]


# -- tests -----------------------------------------------------------------------------------


def test_sbatch_runs_etcd_then_up_on_two_nodes_trains_to_the_end_and_exits_0(slurm):
    total = 40
    started = time.monotonic()
    job = submit(slurm, "slurm-to-the-end", 2, ["--steps", str(total), "--checkpoint-every", "10"], "--time=10",
                 min_nodes=2)
    final = job.wait_ended(240)
    report("sbatch to COMPLETED, 2 nodes, 40 steps", time.monotonic() - started)
    assert final["JobState"] == "COMPLETED" and final["ExitCode"] == "0:0", job.describe()
    records = job.records()
    trained = {host: {r["step"] for r in steps(records, world=2) if r["host"] == host} for host in ("n1", "n2")}
    assert trained == {"n1": set(range(total)), "n2": set(range(total))}, "each node trained every step at world 2"
    assert {e["step"] for e in events(records, "done")} == {total}
    output = job.output()
    assert f"etcd at n1:{job.etcd_port}" in output, output
    assert "requeueing" not in output
    assert not etcd_processes_of(job), "etcd outlived the job"
    assert not list(job.workdir.glob("elasticctl-etcd-*")), "etcd's data directory is removed"
    assert final["Restarts"] == "0"


def test_time_limit_warning_checkpoints_requeues_and_the_second_run_resumes(slurm):
    job = submit(slurm, "slurm-requeue", 1, [*ENDLESS, "--checkpoint-every", "20"], "--time=10",
                 f"--signal=B:{WARNING_SIGNAL}@170")
    wait_for(lambda: len(steps(job.records())) >= 5, 240, "the first run to train")
    # The warning must not come before the first run trains (there would be no checkpoint to
    # resume from), so the limit is brought near only now, 2-3 minutes ahead. With the warning
    # 170 s before it, slurmctld's own time-limit check (every 30 s; it warns once the limit is
    # within the warning time plus that period) sends it at its next pass, and the run keeps
    # over 90 s to stop before the limit itself.
    elapsed = seconds(job.state()["RunTime"])
    slurm.command("scontrol", "update", f"JobId={job.id}", f"TimeLimit={elapsed // 60 + 3}")
    limited = time.monotonic()
    wait_for(lambda: "then requeueing" in job.output(), 90, "slurmctld's time-limit warning in the batch script")
    warned = time.monotonic()
    report("time limit brought near -> warning in the batch script", warned - limited)
    # The warning is sent once; a far limit again lets the requeued run train undisturbed.
    slurm.command("scontrol", "update", f"JobId={job.id}", "TimeLimit=10")

    wait_for(lambda: job.state().get("Restarts") == "1", 120, "the job to requeue itself")
    report("warning -> job requeued", time.monotonic() - warned)
    (final,) = events(job.records(), "final_checkpoint")
    first_run = steps(job.records())
    assert first_run[-1]["step"] == final["step"] - 1, "the first run stopped at its final checkpoint"

    resumed = wait_for(lambda: events(job.records(), "resume"), 180, "the requeued run to resume")
    assert resumed[0]["step"] == final["step"], "the second run resumed from the final checkpoint"
    wait_for(lambda: len(steps(job.records(), since=first_run[-1]["time"])) >= 3, 120, "the second run to train")
    report("warning -> second run trains", time.monotonic() - warned)
    second_run = steps(job.records(), since=first_run[-1]["time"])
    assert [r["step"] for r in second_run[:3]] == [final["step"] + i for i in range(3)], "the step goes on, not from 0"
    output = job.output()
    assert "(restart 1)" in output and "requeueing job" in output, output

    # SIGTERM is what Slurm sends the batch script on scancel and at the time limit itself: the
    # script stops the tasks and ends without requeueing (Slurm would requeue even a cancelled
    # job). Sent to the batch script alone, so that the tasks' graceful stop (etcd still up), not
    # KillWait's SIGKILL, decides whether the script gets as far as a requeue.
    job.terminate_batch_script()

    def ended_or_requeued():
        state = job.state()
        return state if state["Restarts"] != "1" or state["JobState"] not in ACTIVE_STATES else None

    ended = wait_for(ended_or_requeued, 120, "the job to end or requeue itself")
    assert ended["Restarts"] == "1", f"SIGTERM requeued the job: {job.describe()}"
    assert ended["JobState"] == "COMPLETED", job.describe()
    assert "stopping, not requeueing" in job.output()
    assert len(events(job.records(), "final_checkpoint")) == 2, "the second run stopped with a final checkpoint"
    assert not etcd_processes_of(job)


def test_a_dead_node_leaves_the_two_others_training_after_slurm_sets_it_down(slurm):
    job = submit(slurm, "slurm-node-loss", 3, [*ENDLESS, "--checkpoint-every", "20"], "--time=10")
    try:
        wait_for(lambda: {r["host"] for r in steps(job.records(), world=3)} == {"n1", "n2", "n3"}, 240,
                 "all three nodes training at world 3")
        killed = time.time()
        slurm.kill_host("n3")
        wait_for(lambda: steps(job.records(), world=2, since=killed), 120, "training at world 2 without n3")
        report("n3 killed -> first step at world 2", time.time() - killed)
        wait_for(lambda: slurm.node_states().get("n3", "").startswith("down"), 90, "slurmctld to set n3 DOWN")
        down = time.time()
        report("n3 killed -> Slurm sets it DOWN", down - killed)
        # The job must survive Slurm's own reaction to the dead node (without --no-kill it requeues
        # a job that loses a node): training goes on at world 2 on n1 and n2 (steps 2 s after the
        # DOWN: time for that reaction to reach the tasks), and the job is still the same run.
        def trained_after_down_or_ended():
            hosts = {r["host"] for r in steps(job.records(), world=2, since=down + 2)}
            return hosts == {"n1", "n2"} or job.state()["JobState"] != "RUNNING"

        wait_for(trained_after_down_or_ended, 90, "n1 and n2 training after n3 went DOWN")
        state = job.state()
        assert state["JobState"] == "RUNNING" and state["Restarts"] == "0", job.describe()
        assert state["NodeList"] == "n[1-2]", "Slurm took the dead node out of the allocation"
        job.terminate_batch_script()  # a graceful end; scancel would wait KillWait for etcd-less leaves
        job.wait_ended(120)
    finally:
        slurm.cancel_all()
        if "n3" not in slurm.hosts:
            slurm.start_host("n3")
        slurm.wait_idle(["n3"], 60)
