"""Forming a generation, as the lifecycle's :class:`~elasticctl.train.worker.lifecycle.Form` command
says: the generation in use ends (its group torn down, or kept to be reconfigured in place), the
next one is sealed, its groups are built, the state is brought in sync and the model wrapped,
and every part hears of the new generation. The order is this module's; each step is a part's."""

from __future__ import annotations

import logging
from typing import Any

from elasticctl.rendezvous.member import JoinCancelled
from elasticctl.train.worker import lifecycle
from elasticctl.train.group import Group
from elasticctl.train.worker.lifecycle import Form
from elasticctl.train.state import State, StateError
from elasticctl.train.worker.checkpoint_duty import CheckpointDuty
from elasticctl.train.worker.generation_manager import GenerationManager
from elasticctl.train.worker.liveness import LivenessBoard
from elasticctl.train.worker.model_placement import ModelPlacement
from elasticctl.train.worker.reporter import Reporter
from elasticctl.train.worker.step_boundary import StepBoundary
from elasticctl.train.worker.watch_supervisor import Watches

log = logging.getLogger(__name__)


class GenerationForming:
    """Carries out the Form command over the worker's parts (it owns none of their state)."""

    def __init__(self, state: State, *, generations: GenerationManager, model: ModelPlacement,
                 checkpoints: CheckpointDuty, boundary: StepBoundary, watches: Watches, reporter: Reporter,
                 liveness: LivenessBoard) -> None:
        self.state = state
        self.generations = generations
        self.model = model
        self.checkpoints = checkpoints
        self.boundary = boundary
        self.watches = watches
        self.reporter = reporter
        self.liveness = liveness

    @property
    def worker(self) -> str:
        return self.generations.worker

    def form(self, command: Form, attempt: int) -> lifecycle.Event:
        """Into the next generation as ``command`` says: the group in use down or kept, the
        generation sealed, its groups built or reconfigured, the state in sync."""
        generations, reporter = self.generations, self.reporter
        if generations.group is not None:  # a generation ends: what ended it
            log.warning("[%s] generation %s ends at step %d: %s", self.worker, generations.group.number,
                        self.state.step, command.ending)
            reporter.generation_ends()
        if command.sever:
            generations.sever()
        if command.rewrap:
            self.model.after_failure_on_kept_group()
        self.tear_down(keep_group=command.keep_group)
        reporter.mark_recovery("torn_down")
        try:
            sealed = generations.membership.join()
        except JoinCancelled:
            return lifecycle.JoinCancelled()
        reporter.mark_recovery("sealed")
        try:
            built = generations.build(sealed, keep_group=command.keep_group)
            if built is not None:
                reporter.mark_recovery(built)
            self._enter(sealed.generation, sealed.rank, sealed.world_size,
                        command.noticed_at if command.recovering else None)
        except StateError as exc:  # what a peer sent does not fit: another generation would send the same
            return lifecycle.FormFailed(exc, fatal=True)
        except Exception as exc:  # noqa: BLE001 - a taken port, a peer lost while connecting or sending
            generations.after_failed_form()
            if generations.membership.recovers_in_process:
                log.warning("[%s] generation %d did not form (attempt %d of %d): %s", self.worker,
                            sealed.generation.number, attempt, lifecycle.FORM_ATTEMPTS,
                            " ".join(str(exc).split())[:300])
            return lifecycle.FormFailed(exc)
        return lifecycle.Formed()

    def _enter(self, generation: Any, rank: int, world_size: int, noticed_at: float | None) -> Group:
        """Train in ``generation`` (its process group is up): the state in sync, the sampler
        re-dealt, the model wrapped."""
        place, generations = self.generations.place, self.generations
        self.checkpoints.follow_rank(rank)
        group = Group(number=generation.number, rank=rank, world_size=world_size, local_rank=place.local_rank,
                      device=place.device, model=self.state.model, members=generation.members,
                      local_world_size=place.local_world_size, timeout=place.pg_timeout,
                      mesh_groups=generations.mesh_groups())
        group, sent_from = self.model.enter(group, reconfigured_in_place=generations.reconfigurable is not None,
                                            mark=self.reporter.mark_recovery)
        generations.enter(group)
        self.boundary.new_generation()
        self.watches.new_generation()
        log.info("[%s] generation %d: rank %d of %d at step %d%s; boundary collectives on %s", self.worker,
                 generation.number, rank, world_size, self.state.step,
                 f" (state from rank {', '.join(map(str, sent_from))})" if sent_from else "",
                 generations.describe_control_group())
        self.reporter.generation_formed(group, noticed_at, generations.membership.records_generations)
        self.liveness.restart_clock()  # steps (and silences) count from here
        return group

    def tear_down(self, keep_group: bool = False) -> None:
        """The generation ends here: its flags and copies are dropped, its groups come down (or the
        group is kept, to be reconfigured in place)."""
        self.boundary.new_generation()
        self.model.freeze()
        self.generations.teardown(keep_group=keep_group)
