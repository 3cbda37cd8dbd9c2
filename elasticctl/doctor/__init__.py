"""`elasticctl doctor`: can this host run a node of the job, and what to fix if not.

Each check is a pure ``decide_*`` function (facts in, :class:`Check` out) in
``checks.py``, so every verdict is testable with a table of facts; the ``gather_*``
functions of ``gather.py`` do the I/O (psutil, nvidia-smi, etcd, the checkpoint
directory). This module runs them: ``up`` and ``join`` run the quick subset
(:func:`run_checks` with ``quick=True``): no torch import, no nvidia-smi, one clock
sample, nothing that waits (but up to 2 s for an etcd member that does not answer
the version check).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Collection, Sequence

import psutil

from elasticctl import launcher
from elasticctl.doctor.checks import (
    Check,
    Status,
    decide_checkpoint_dir,
    decide_advertised,
    decide_checkpoint_health,
    decide_etcd,
    decide_interface,
    decide_job,
    decide_torch_agreement,
    decide_versions,
    skipped,
)
from elasticctl.doctor.gather import (
    MarkerOutcome,
    CUSTOM_CHECK_TIMEOUT_S,
    DEVICE_PROBE_TIMEOUT_S,
    gather_advertised,
    gather_checkpoint_marker,
    gather_clock,
    gather_code,
    gather_custom,
    gather_devices,
    gather_etcd_latency,
    gather_etcd_members,
    gather_gpus,
    gather_interface,
    gather_port,
    gather_shm,
    gather_torch_build,
    installed_torch_version,
    newest_checkpoint_bytes,
    probe_creatable,
    probe_writable,
    read_checkpoint_marker,
)
from elasticctl.etcd.client import EtcdClient, EtcdSettings
from elasticctl.job.registry import DEFAULT_KEY_PREFIX, Registry, read_probe
from elasticctl.job.spec import JobSpec


__all__ = ["ADMISSION_CHECKS", "Check", "Report", "Status", "decide_job", "refusal", "run_checks"]

# The checks up and join run before a node registers (the admission checks), by name: what
# --skip-check takes. "custom" is every --check CMD.
ADMISSION_CHECKS = ("versions", "torch-agreement", "checkpoint-writes", "interface", "address", "etcd",
                    "etcd-version", "clock", "ports", "shm", "checkpoint-dir", "checkpoint-shared", "code", "devices",
                    "custom")
# All of them together, the etcd reads and the processes they run (the device probe, --check) included.
ADMISSION_BUDGET_S = 10.0


@dataclasses.dataclass(frozen=True)
class Report:
    checks: tuple[Check, ...]
    claimed_marker: str | None = None
    seconds: tuple[tuple[str, float], ...] = ()  # (check, seconds it took), in the order they ran

    @property
    def failed(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if c.status is Status.FAIL)


def run_checks(*, settings: EtcdSettings | None, client: EtcdClient | None, etcd_error: str | None,
               registry: Registry | None, checkpoint_dir: str | None, local_addr: str,
               quick: bool, deep: bool = False, key_prefix: str = DEFAULT_KEY_PREFIX,
               prepare: bool = True, spec: JobSpec | None = None, skip: Collection[str] = (),
               custom: Sequence[str] = (), budget: float = ADMISSION_BUDGET_S) -> Report:
    """Every check this host can answer. ``client`` None: etcd is unreachable (``etcd_error``)
    or not given; ``registry`` None: no job to compare with. ``quick``: what up/join run.
    ``prepare``: create the checkpoint directory and claim the job's marker when this is its
    first node (up and join); without it (``elasticctl doctor``) nothing is changed but a probe
    file, removed again. ``spec``: the job's, to compare this host's code with. ``skip``: checks
    by name (ADMISSION_CHECKS) whose verdict does not count: the code, the devices and the custom
    checks are not even run, the cheap others run and their verdict is replaced. ``custom``: the
    user's own commands (--check). The processes (device probe, custom checks) get what is left
    of ``budget`` seconds, counted from the start."""
    deadline = time.monotonic() + budget

    def left(at_most: float) -> float:
        return max(0.0, min(at_most, deadline - time.monotonic()))

    checks: list[Check] = []
    seconds: list[tuple[str, float]] = []
    began = time.monotonic()

    def add(check: Check) -> None:
        """Keep ``check``, and the time since the previous one was kept: what computing it took."""
        nonlocal began
        now = time.monotonic()
        checks.append(check)
        seconds.append((check.name, now - began))
        began = now

    add(decide_versions(sys.version_info, installed_torch_version()))
    nodes: dict[str, dict] = {}
    if registry is not None:
        nodes = {n: r for n, r in registry.live_nodes().items() if r.get("pid") != os.getpid()}
        add(decide_torch_agreement(installed_torch_version(), {n: r.get("torch") for n, r in nodes.items()}))
        add(decide_checkpoint_health(registry.progress()))
    if deep:
        add(gather_torch_build(launcher.visible_gpu_count()))
    if not quick:
        add(gather_gpus(sorted(n for n, r in nodes.items() if r.get("gpus"))))
    add(decide_interface(gather_interface(local_addr, nodes)))
    add(decide_advertised(gather_advertised(local_addr, settings.endpoints[0] if client is not None and settings
                                            else None)))
    described = settings.describe() if settings else "(none)"
    if client is not None and settings is not None:
        read = registry.read_spec if registry else (lambda: read_probe(client, key_prefix))
        add(decide_etcd(described, gather_etcd_latency(read, 3 if quick else 7), None))
        add(gather_etcd_members(client))
        add(gather_clock(settings, 1 if quick else 6))
    else:
        add(decide_etcd(described, [], etcd_error))
    add(gather_port())
    add(gather_shm())
    claimed = None
    if checkpoint_dir is not None:
        missing = not prepare and not os.path.isdir(checkpoint_dir)
        created_under = None
        if missing:
            error, created_under = probe_creatable(checkpoint_dir)
        else:
            error = probe_writable(checkpoint_dir, create=prepare)
        free = None if error else psutil.disk_usage(created_under or checkpoint_dir).free
        newest = None if error or created_under else newest_checkpoint_bytes(checkpoint_dir)
        add(decide_checkpoint_dir(checkpoint_dir, error, free, created_under, newest))
        if error is None and registry is not None:
            try:
                outcome = (gather_checkpoint_marker(registry, checkpoint_dir) if prepare
                           else read_checkpoint_marker(registry, checkpoint_dir))
            except OSError as exc:
                outcome = MarkerOutcome(decide_checkpoint_dir(checkpoint_dir, exc.strerror or str(exc)), None)
            add(outcome.check)
            claimed = outcome.claimed_token
    else:
        add(decide_checkpoint_dir(None, None))
    if spec is not None:
        add(skipped("code", "--skip-check code") if "code" in skip else gather_code(spec))
    if "devices" in skip:
        add(skipped("devices", "--skip-check devices"))
    else:
        gpus = launcher.visible_gpu_count()
        add(gather_devices(gpus, left(DEVICE_PROBE_TIMEOUT_S)) if gpus else gather_devices(0))
    for command in custom:
        add(skipped("custom", f"--skip-check custom ({command})") if "custom" in skip
            else gather_custom(command, left(CUSTOM_CHECK_TIMEOUT_S)))
    checks = [skipped(c.name, f"--skip-check {c.name}") if c.name in skip and not c.detail.startswith("skipped")
              else c for c in checks]
    return Report(tuple(checks), claimed, tuple(seconds))


def refusal(report: Report, job: str) -> str | None:
    """The one sentence with which up/join refuse to join ``job``, or None when nothing failed."""
    if not report.failed:
        return None
    first = report.failed[0]
    more = f" (and {len(report.failed) - 1} more failed check(s) above)" if len(report.failed) > 1 else ""
    fix = first.fix[:1].lower() + first.fix[1:].rstrip(".")
    return f"This host cannot join job '{job}': check {first.name}: {first.detail}{more}; {fix}."
