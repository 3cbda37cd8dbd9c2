"""The one owner of a worker's generations: its membership, the process groups (the training
group, kept across generations where it is reconfigured in place, and the gloo side group),
the generation's store, the connections its groups opened, and the generation in use.

Other threads reach the groups only through here: the lost-member abort (from the rendezvous
view's writer thread) aborts under the same lock the teardown holds, and only the generation it
was asked for, so an abort never hits a group being torn down or its successor. Whether a group
is kept, and whether a failed generation's connections are severed, is the lifecycle's decision
(:mod:`elasticctl.train.worker.lifecycle`); this part carries it out."""

from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from elasticctl.errors import ElasticctlError
from elasticctl.job import environment as environment_names
from elasticctl.job.environment import WorkerEnvironment
from elasticctl.job.options import RecoveryMode
from elasticctl.train.groups.connections import GenerationConnections
from elasticctl.train.group import Group
from elasticctl.train.groups.lost_member_abort import LossAbort, backend_aborts
from elasticctl.train.groups.membership import HotMembership, Membership, RestartMembership, Sealed
from elasticctl.train.phase import Phase
from elasticctl.train.groups.process_group import (build_control_group, build_generation_group,
                                            reconfigure_generation_group, reset_group_counter)
from elasticctl.train.groups.roster import Roster
from elasticctl.train.groups.reconfigure import GroupStrategy, ReconfigurableGroup, StrategyChoice
from elasticctl.train.sharding.shards import hsdp_layout
from elasticctl.train.worker.place import WorkerPlace

log = logging.getLogger(__name__)

EXIT_RECOVERY_FAILED = 75  # the worker cannot recover in process: its node restarts it
TEARDOWN_BOUND = 10.0      # seconds a process group may take to come down before the worker exits


class GenerationManager:
    """Worker ``worker``'s generations on ``backend``. ``phase()``: where the worker is (the
    lost-member abort acts only while it trains)."""

    def __init__(self, environment: WorkerEnvironment, place: WorkerPlace, *, group_choice: StrategyChoice,
                 keeps_mesh: bool, sharded: bool, phase: Callable[[], Phase]) -> None:
        self.environment = environment
        self.place = place
        self.group_choice = group_choice
        self.keeps_mesh = keeps_mesh
        self.sharded = sharded
        self._phase = phase
        settings = environment.settings
        hot = environment.recovery is RecoveryMode.HOT
        self.membership: Membership = (HotMembership(settings.hot, self._connect_generations) if hot
                                       else RestartMembership(place.backend, place.pg_timeout, environment))
        self.reconfigurable: ReconfigurableGroup | None = None  # the group kept across generations
        self.store: Any = None  # the generation's TCPStore (hot mode), kept alive with its group
        # The generation's group for the boundary flags and the watches' exchanges (CPU tensors on
        # gloo; None: the training group is gloo and carries them): process_group.py.
        self.control_group: Any = None
        self.connections: GenerationConnections | None = None  # hot mode: its generations' groups' connections
        self.group: Group | None = None  # the generation in use, while the worker trains in it (and its end)
        self.roster = Roster(place.node, place.worker)  # each rank's node name, one gather per generation
        self._lock = threading.Lock()  # the groups change (teardown) or are aborted under it, never both

    @property
    def worker(self) -> str:
        return self.place.worker

    @property
    def backend(self) -> str:
        return self.place.backend

    @property
    def pg_timeout(self) -> datetime.timedelta:
        return self.place.pg_timeout

    @property
    def running_generation(self) -> int | None:
        """The generation of the training group in use (None: none yet)."""
        group = self.group
        return None if group is None else group.number

    def describe_control_group(self) -> str:
        """For the generation's log line: where the boundary flags and the watches' exchanges go."""
        if self.control_group is None:
            return f"the training group ({self.backend})"
        return f"a side group ({dist.get_backend(self.control_group)}) beside the training group ({self.backend})"

    # -- forming -----------------------------------------------------------------------------

    def group_alone_maker(self) -> Callable[[], ReconfigurableGroup] | None:
        """How to make this worker's reconfigurable group before its first generation (the sharded
        warm-up's); None where its generations do not reconfigure one in process."""
        if not self.membership.recovers_in_process or self.group_choice.strategy is not GroupStrategy.RECONFIGURE:
            return None
        return self.make_group_alone

    def make_group_alone(self) -> ReconfigurableGroup:
        """This worker's reconfigurable group before its first generation (the sharded warm-up's)."""
        self.reconfigurable = ReconfigurableGroup(self.backend, self.pg_timeout, with_mesh=True)
        return self.reconfigurable

    def sever(self) -> None:
        """The failed generation's connections shut down: the peers still waiting on this worker
        in its collectives learn of the failure now, not at their timeout (train/groups/connections.py)."""
        if self.connections is not None:
            self.connections.sever()

    def build(self, sealed: Sealed, keep_group: bool) -> str | None:
        """The process groups of the generation ``sealed``: the training group reconfigured (the
        kept one, or a new reconfigurable one) or built, and the side group. Returns the recovery
        phase it ended (None: torchrun's round had the group up already)."""
        # Only gloo's connections (train/groups/connections.py): an NCCL group's own sockets are its
        # abort's business, so with NCCL only the gloo side group's are recorded.
        records_training_group = self.connections is not None and not backend_aborts(self.backend)
        connections_before = self.connections.current() if records_training_group else None
        if not sealed.groups_ready:
            if self.group_choice.strategy is GroupStrategy.RECONFIGURE:
                rows = (hsdp_layout(sealed.generation.members, sealed.world_size, self.place.local_world_size)
                        if self.keeps_mesh else None)
                self.reconfigurable, self.store = reconfigure_generation_group(
                    self.reconfigurable, sealed.generation, sealed.rank, self.backend, self.pg_timeout,
                    mesh_rows=rows)
            else:
                self.store = build_generation_group(sealed.generation, sealed.rank, self.backend,
                                                    self.pg_timeout, self.place.device)
        if self.connections is not None and connections_before is None:
            connections_before = self.connections.current()
        self.control_group = build_control_group(self.backend, self.pg_timeout)
        if connections_before is not None:
            self.connections.record_build(connections_before, sealed.generation.master_port)
        if sealed.groups_ready:
            return None
        return "group_reconfigured" if keep_group else "group_built"

    def after_failed_form(self) -> None:
        """A generation did not form: a failed init leaves torch's group counter raised."""
        if not dist.is_initialized():
            reset_group_counter()

    def mesh_groups(self) -> Any:
        """The kept HSDP mesh's groups, where the groups are reconfigured in place (None: else)."""
        return self.reconfigurable.mesh_groups if self.reconfigurable is not None and self.keeps_mesh else None

    def enter(self, group: Group) -> None:
        """The generation ``group`` is the one in use from now on."""
        with self._lock:
            self.group = group
        self.roster.forget()

    # -- ending ------------------------------------------------------------------------------

    def teardown(self, keep_group: bool = False) -> None:
        """Take the process groups down, bounded: one that will not come down ends the worker.
        ``keep_group``: the next generation reconfigures this worker's group in place."""
        with self._lock:
            self.group = None
            if keep_group and self.reconfigurable is not None:
                # The group stays; the generation's store goes (its port may be the next one's).
                self.reconfigurable.release_store()
                self.store = None
                return
            self.reconfigurable = None
            # destroy_process_group() below takes the side group down with the training group; the
            # last reference goes here, so that its gloo threads and sockets go with it. (A failed
            # generation's connections were shut down before: train/groups/connections.py.)
            self.control_group = None
            if not dist.is_initialized():
                return
            stuck = threading.Timer(TEARDOWN_BOUND, _exit_stuck, args=(self.worker,))
            stuck.daemon = True
            stuck.start()
            try:
                if self.backend == "nccl":
                    dist.group.WORLD.abort()  # unblocks NCCL kernels waiting on a lost peer
                dist.destroy_process_group()
            finally:
                stuck.cancel()
            self.store = None

    def withdraw(self) -> None:
        """Out of the generations without a generation to leave (told to stop while waiting)."""
        try:
            self.membership.leave()
        except ElasticctlError as exc:  # etcd away: the declaration goes with its lease instead
            log.warning("[%s] could not withdraw its declaration: %s", self.worker, exc)

    def close(self) -> None:
        self.membership.close()
        with self._lock:
            self.control_group = None  # destroyed with the training group (the run ended without a teardown)
            if dist.is_initialized():
                dist.destroy_process_group()

    # -- hot mode ----------------------------------------------------------------------------

    def _connect_generations(self):
        """Hot mode: this worker's part in its job's generations, from its environment."""
        from elasticctl.etcd.client import EtcdClient
        from elasticctl.train.groups.generations import Generations

        etcd = self.environment.etcd_settings(retry_timeout=30.0)
        if etcd is None:
            raise ElasticctlError(f"{environment_names.WORKER_SETTINGS} asks for hot recovery but "
                                  f"{environment_names.ETCD} or {environment_names.JOB} is not.")
        if self.backend == "nccl":
            # A lost peer must raise in this process, not end it (why: environment.NCCL_HOT_RECOVERY).
            for name, value in environment_names.NCCL_HOT_RECOVERY.items():
                os.environ.setdefault(name, value)
        addr = self.environment.node_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
        # The connections of each generation's groups, shut down when one fails (train/groups/connections.py):
        # never etcd's, whose client lives on across generations.
        self.connections = GenerationConnections(self.worker, other_ports={e.port for e in etcd.endpoints})
        generations = Generations(EtcdClient(etcd), self.environment.job_keys(), self.worker, addr,
                                  self.membership.settings, self.environment.secret_bytes(), sharded=self.sharded)
        # A member lost while this worker may wait in a collective with it: abort the group
        # where the backend can (train/groups/lost_member_abort.py), not wait for the collective's timeout;
        # under the lock the teardown holds, so never a group coming down or its successor.
        generations.on_member_lost(LossAbort(self.worker, self.backend,
                                             lambda: (self._phase(), self.running_generation),
                                             lock=self._lock).on_lost)
        return generations


def _exit_stuck(worker: str) -> None:
    log.error("[%s] its process group did not come down within %g s; the node restarts the worker",
              worker, TEARDOWN_BOUND)
    sys.stderr.flush()
    os._exit(EXIT_RECOVERY_FAILED)
