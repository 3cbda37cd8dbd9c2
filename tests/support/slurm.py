"""A real Slurm cluster on this one machine: munge, slurmctld and one slurmd per node, from Debian.

Debian's Slurm 22.05 is built with ``--enable-multiple-slurmd`` (``scontrol show config``:
``MULTIPLE_SLURMD = Yes``), so several slurmd run on one host, each started as ``slurmd -N
<node>`` with its own port, spool, pid and log files (``%n`` in slurm.conf). Every Slurm host
(the controller ``ctl`` and the nodes ``n1``, ``n2``, ...) is a process tree in namespaces of
its own, started by ``unshare``:

- UTS: its own host name, so a node's tasks see ``hostname`` = their node name, as on a cluster;
- mount: a private ``/etc/hosts`` in which every host name is 127.0.0.1, so that node names
  resolve (the sbatch script advertises them) without touching this machine's. The network is
  the machine's own: every daemon, etcd and trainer talks over loopback and nothing else;
- PID, with its own /proc: the host's first process is its init; killing it (or its
  ``unshare``, whose child then gets SIGKILL) ends every process on that host at once, which
  is a machine that died, and nothing a host started can outlive it. ``unshare`` itself gets
  SIGKILL if the test process dies, so a killed pytest leaves no cluster behind.

The controller's host also runs the cluster's one munged. Every file (configuration, key,
socket, state, spool, logs) lives under one directory; every port comes from the free-port
helper. No address other than 127.0.0.1 is configured, and Slurm's daemons bind to the address
their host name resolves to (``CommunicationParameters=NoInAddrAny,NoCtldInAddrAny``), which the
private hosts file makes 127.0.0.1, rather than to every interface.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
from support.helpers import wait_for

from elasticctl.embedded_etcd import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "scancel", "sinfo", "squeue")
CONTROLLER = "ctl"
# Job states of a job not yet over (squeue's long names).
ACTIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                 "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT")
# A requeued job may start again only after the job credential's lifetime (AuthInfo
# cred_expire, 120 s by default); 5 s is the least Slurm accepts.
CRED_EXPIRE = 5
# Seconds without an answer from a slurmd before slurmctld sets its node DOWN (pinged every
# third of it). Short, so that a killed node is noticed within the test; a live slurmd answers
# a ping in milliseconds even on a loaded machine.
SLURMD_TIMEOUT = 10
# The parent-death signal for `unshare`: SIGKILL, because unshare ignores SIGTERM while it
# waits for its child, and with --kill-child its death kills the host's whole namespace.
_KILL_WITH_PARENT = """
import ctypes, os, signal, sys
ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit(137)  # the parent died before the signal was armed
os.execvp(sys.argv[2], sys.argv[2:])
"""
# The first process of a host: its hosts file and name, on the controller's host munged (the
# daemons' first request would fail before its socket exists), then the Slurm daemon. It waits
# for the daemon and exits with it, which ends the host; as PID 1 it also reaps the slurmstepd
# processes that slurmd double-forks.
_HOST_INIT = r"""
set -eu
mount --bind "$HOST_HOSTS" /etc/hosts
hostname "$HOST_NAME"
if [ -n "$HOST_MUNGE_SOCKET" ]; then
    munged --foreground --force --socket="$HOST_MUNGE_SOCKET" --key-file="$HOST_MUNGE_KEY" \
        --pid-file="$HOST_STATE/munged.pid" --log-file="$HOST_STATE/munged.log" \
        --seed-file="$HOST_STATE/munged.seed" &
    munged=$!
    while [ ! -S "$HOST_MUNGE_SOCKET" ]; do
        kill -0 "$munged" 2> /dev/null || { echo "munged exited; see $HOST_STATE/munged.log" >&2; exit 1; }
        sleep 0.05
    done
fi
"$@" &
daemon=$!
status=0
wait "$daemon" || status=$?
echo "$1 exited with status $status" >&2
exit "$status"
"""


def unavailable_reason() -> str | None:
    """Why this machine cannot run the cluster (one sentence), or None if it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "a Slurm cluster needs root (its daemons, namespaces and mounts)"
    missing = [name for name in (*DAEMONS, *CLIENTS, "unshare") if shutil.which(name) is None]
    if missing:
        return (f"{', '.join(missing)} not found (Debian: apt-get install --no-install-recommends "
                "slurm-wlm munge)")
    return None


class SlurmError(RuntimeError):
    pass


class SlurmCluster:
    """A controller and ``nodes`` slurmd hosts under ``root``; ``start()``, then Slurm commands."""

    def __init__(self, root: Path, nodes: tuple[str, ...] = ("n1", "n2", "n3"), cpus: int = 2) -> None:
        self.root = root
        self.nodes = nodes
        self.cpus = cpus
        self.conf = root / "slurm.conf"
        self.hosts_file = root / "hosts"
        self.munge_key = root / "munge.key"
        self.munge_socket = root / "munge" / "munge.socket"
        self.jobs = root / "jobs"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.hosts: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}

    # -- configuration ------------------------------------------------------------------

    def host_dir(self, host: str) -> Path:
        return self.root / ("ctl" if host == CONTROLLER else f"nodes/{host}")

    def write(self) -> None:
        for directory in (self.munge_socket.parent, self.jobs, self.host_dir(CONTROLLER) / "state",
                          *(self.host_dir(n) / "spool" for n in self.nodes)):
            directory.mkdir(parents=True, exist_ok=True)
        self.munge_socket.parent.chmod(0o755)  # munged refuses a socket directory others may write to
        self.munge_key.write_bytes(os.urandom(1024))
        self.munge_key.chmod(0o400)
        self.hosts_file.write_text(f"127.0.0.1 localhost {CONTROLLER} {' '.join(self.nodes)}\n")
        self.ports = {host: free_port() for host in (CONTROLLER, *self.nodes)}
        root, ctl = self.root, self.host_dir(CONTROLLER)
        node_lines = "\n".join(f"NodeName={n} NodeAddr=127.0.0.1 Port={self.ports[n]} CPUs={self.cpus} State=UNKNOWN"
                               for n in self.nodes)
        self.conf.write_text(f"""\
ClusterName=elasticctl
SlurmctldHost={CONTROLLER}(127.0.0.1)
SlurmctldPort={self.ports[CONTROLLER]}
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE}
StateSaveLocation={ctl}/state
SlurmctldPidFile={ctl}/slurmctld.pid
SlurmctldLogFile={ctl}/slurmctld.log
SlurmdSpoolDir={root}/nodes/%n/spool
SlurmdPidFile={root}/nodes/%n/slurmd.pid
SlurmdLogFile={root}/nodes/%n/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# Processes are tracked through /proc, which (like proctrack/cgroup) reaches every descendant
# of a step, not one process group; proctrack/cgroup would write to /sys/fs/cgroup, outside
# the test's directory.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
# Pending jobs are tried every second (default 60): a requeued job starts as soon as it may.
SchedulerParameters=sched_interval=1
SlurmdTimeout={SLURMD_TIMEOUT}
ReturnToService=2
# The nodes share this machine's cores; take their configured CPUs as given.
SlurmdParameters=config_overrides
# Finished jobs stay visible to `scontrol show job` for the rest of the module.
MinJobAge=3600
{node_lines}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    # -- hosts ----------------------------------------------------------------------------

    def start(self, timeout: float = 60) -> None:
        self.write()
        self.start_host(CONTROLLER)
        wait_for(self._controller_answers, timeout, "slurmctld to answer `scontrol ping`")
        for node in self.nodes:
            self.start_host(node)
        self.wait_idle(self.nodes, timeout)

    def start_host(self, host: str) -> None:
        state = self.host_dir(host)
        daemon = (["slurmctld", "-D", "-f", str(self.conf)] if host == CONTROLLER
                  else ["slurmd", "-D", "-f", str(self.conf), "-N", host])
        env = {**self.env, "HOST_NAME": host, "HOST_HOSTS": str(self.hosts_file), "HOST_STATE": str(state),
               "HOST_MUNGE_KEY": str(self.munge_key),
               "HOST_MUNGE_SOCKET": str(self.munge_socket) if host == CONTROLLER else ""}
        unshare = ["unshare", "--mount", "--uts", "--pid", "--fork", "--mount-proc", "--kill-child",
                   "--propagation", "private", "--", "sh", "-c", _HOST_INIT, "host-init", *daemon]
        with open(state / "host.log", "ab") as log:
            self.hosts[host] = subprocess.Popen(
                [sys.executable, "-c", _KILL_WITH_PARENT, str(os.getpid()), *unshare],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def kill_host(self, host: str) -> None:
        """SIGKILL a host's unshare: its init, and so every process on the host, dies with it."""
        process = self.hosts.pop(host)
        process.send_signal(signal.SIGKILL)
        process.wait(30)

    def _controller_answers(self) -> bool:
        self._check_hosts_alive()
        result = self.command("scontrol", "ping", check=False)
        return result.returncode == 0 and "is UP" in result.stdout

    def _check_hosts_alive(self) -> None:
        for host, process in self.hosts.items():
            if process.poll() is not None:
                raise SlurmError(f"Slurm host {host} exited with {process.returncode}:\n{self.logs(host)}")

    def logs(self, host: str, tail: int = 40) -> str:
        state = self.host_dir(host)
        daemon_log = state / ("slurmctld.log" if host == CONTROLLER else "slurmd.log")
        parts = []
        for path in (state / "host.log", state / "munged.log", daemon_log):
            if path.exists():
                lines = path.read_text(errors="replace").splitlines()[-tail:]
                parts.append(f"--- {path}\n" + "\n".join(lines))
        return "\n".join(parts)

    # -- Slurm commands -------------------------------------------------------------------

    def command(self, *args: str, check: bool = True, timeout: float = 30, **kwargs) -> subprocess.CompletedProcess:
        result = subprocess.run(list(args), env=kwargs.pop("env", self.env), check=False, capture_output=True,
                                text=True, timeout=timeout, **kwargs)
        if check and result.returncode != 0:
            raise SlurmError(f"`{' '.join(args)}` exited {result.returncode}: {result.stderr.strip()}")
        return result

    def node_states(self) -> dict[str, str]:
        """Each node's state as sinfo prints it: idle, allocated, down* (not responding), ..."""
        out = self.command("sinfo", "--noheader", "--Node", "--format=%N %T").stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_idle(self, nodes, timeout: float) -> None:
        def idle():
            self._check_hosts_alive()
            states = self.node_states()
            return all(states.get(n) == "idle" for n in nodes)

        try:
            wait_for(idle, timeout, f"nodes {', '.join(nodes)} to be idle", interval=0.2)
        except AssertionError as exc:
            raise SlurmError(f"{exc}: {self.node_states()}\n" + "\n".join(self.logs(n) for n in nodes)) from exc

    def sbatch(self, *args: str, cwd: Path) -> str:
        """Submit; returns the job id."""
        return self.command("sbatch", "--parsable", *args, cwd=cwd).stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as fields (JobState, Restarts, ExitCode, NodeList, ...)."""
        out = self.command("scontrol", "show", "job", "--oneliner", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def active_jobs(self) -> dict[str, str]:
        """{job id: state} of the jobs slurmctld still runs or will run (pending, running, completing)."""
        out = self.command("squeue", "--noheader", "--states=all", "--format=%i %T").stdout
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return {j: s for j, s in states.items() if s in ACTIVE_STATES}

    def cancel_all(self, timeout: float = 90) -> None:
        """scancel every job and wait until none is left (a job that requeued itself is cancelled
        again while pending)."""
        def cancelled():
            jobs = self.active_jobs()
            for job_id, state in jobs.items():
                if state != "COMPLETING":
                    self.command("scancel", job_id, check=False)
            return not jobs

        wait_for(cancelled, timeout, "every job to end", interval=1)

    def stop(self, timeout: float = 30) -> list[str]:
        """Cancel the jobs, shut the daemons down, end every host; returns what is still alive of
        ours (should be nothing)."""
        try:
            if self.hosts.get(CONTROLLER) is not None and self.hosts[CONTROLLER].poll() is None:
                self.cancel_all()
                # slurmctld saves its state, tells every slurmd to stop, and stops; each host's
                # init exits with its daemon, which ends the host.
                self.command("scontrol", "shutdown", check=False)
                try:
                    wait_for(lambda: all(p.poll() is not None for p in self.hosts.values()), timeout,
                             "every Slurm daemon to stop")
                except AssertionError:
                    pass  # what did not stop is killed below, and named by leftovers() if it survives
        finally:
            for host in list(self.hosts):
                self.kill_host(host)
        return self.leftovers()

    def leftovers(self, within: Path | None = None, timeout: float = 10) -> list[str]:
        """Processes whose command line mentions this cluster's directory (its daemons, jobs, etcd,
        trainers), or ``within`` it, still alive ``timeout`` seconds after they were found: a
        killed host's processes die with its init, asynchronously."""
        marker = str(within or self.root)
        found = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            if proc.info["pid"] != os.getpid() and marker in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
        _, alive = psutil.wait_procs(found, timeout=timeout)
        described = []
        for proc in alive:
            try:
                described.append(f"{proc.pid}: {' '.join(proc.cmdline())[:200]}")
            except psutil.NoSuchProcess:
                pass
        return described
