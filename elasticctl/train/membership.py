"""How a worker's generations come and go: one interface, restart mode and hot mode.

The runtime (:mod:`elasticctl.train.runtime`) trains in a generation and acts on step
boundaries; which workers form a generation, when the flags of a boundary are agreed
on, and whether a failure can be recovered in process is its :class:`Membership`'s:

* :class:`RestartMembership`: one generation per process, torchrun's round as the agent
  formed it. A boundary that lets a worker go ends the process; the agent re-forms.
* :class:`HotMembership`: generations agreed in etcd by the workers themselves
  (:mod:`elasticctl.train.generations`), re-formed in process after a failure or a change.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.distributed as dist

from elasticctl.errors import ElasticctlError
from elasticctl.job.records import Round
from elasticctl.job.settings import HotSettings
from elasticctl.train import script as worker_env
from elasticctl.job.options import RecoveryMode
from elasticctl.train.loss_abort import LossAbort
from elasticctl.train import entry as worker_env_entry
from elasticctl.train.process_group import (build_control_group, build_generation_group, generation_store,
                                            reset_group_counter)
from elasticctl.train.reconfigure import GroupStrategy, ReconfigurableGroup, handles_of, next_group
from elasticctl.train.state import StateError

if TYPE_CHECKING:
    from elasticctl.train.generations import Generations
    from elasticctl.train.group import Group
    from elasticctl.train.runtime import Runtime

log = logging.getLogger(__name__)

FORM_ATTEMPTS = 5  # generations in a row that fail while they form


class Membership(abc.ABC):
    """Who trains together, generation after generation, for one worker."""

    mode: RecoveryMode
    node_ttl: float | None = None  # seconds a member may be silent (None: torch's agent decides)

    @property
    def agreed_at_once(self) -> bool:
        """Whether a boundary's flags are agreed at that boundary (blocking), not at the next."""
        return self.mode is RecoveryMode.RESTART

    @property
    def recovers_in_process(self) -> bool:
        """Whether a failure of the script's step is met with a new generation in this process."""
        return self.mode is RecoveryMode.HOT

    @property
    def records_generations(self) -> bool:
        """Whether rank 0 records each generation formed (the agent records torchrun's rounds)."""
        return self.mode is RecoveryMode.HOT

    @abc.abstractmethod
    def form(self, runtime: Runtime) -> Group:
        """The first generation, its process groups up (the training group, then the runtime's
        control group: ``process_group.build_control_group``) and the state in sync."""

    @abc.abstractmethod
    def re_form(self, runtime: Runtime, why: str, noticed_at: float | None, failed: bool = False) -> Group:
        """Leave the current generation and train in the next (``why``: for the log; ``failed``:
        a step failed, rather than a change agreed at a boundary)."""

    def change_pending(self) -> bool:
        """Whether the generation must re-form (no etcd request: asked at every boundary)."""
        return False

    def describe_change(self) -> str:
        return "a worker is leaving"

    def cancel(self) -> None:
        """End a wait for a generation, now or the next one (the worker was told to stop)."""

    def leave(self) -> None:
        """Withdraw from the generations: the others see it at once."""

    def close(self) -> None:
        pass


class RestartMembership(Membership):
    """Restart mode: the generation is torchrun's round, one per process."""

    mode = RecoveryMode.RESTART

    def form(self, runtime: Runtime) -> Group:
        ctx = worker_env.init(timeout=runtime.pg_timeout.total_seconds(), backend=runtime.backend,
                              environment=runtime.environment)
        generation = Round(number=ctx.restart, members=())
        runtime.control_group = build_control_group(runtime.backend, runtime.pg_timeout)
        return runtime.start_generation(generation, ctx.rank, ctx.world_size, noticed_at=None)

    def re_form(self, runtime: Runtime, why: str, noticed_at: float | None, failed: bool = False) -> Group:
        # Never asked: a restart-mode boundary stops for the agent, a failure ends the worker.
        raise ElasticctlError(f"A restart-mode worker does not re-form in process ({why}).")


class HotMembership(Membership):
    """Hot mode: generations of workers, agreed in etcd, re-formed in process."""

    mode = RecoveryMode.HOT

    def __init__(self, settings: HotSettings, connect: Callable[[], Generations]) -> None:
        self.settings = settings
        self.node_ttl = settings.node_ttl
        self._connect = connect  # the job's generations, from the worker's environment
        self.generations: Generations | None = None  # connected by form()

    def form(self, runtime: Runtime) -> Group:
        self.generations = self._connect()
        # A member lost while this worker may wait in a collective with it: abort the group
        # where the backend can (train/loss_abort.py), not wait for the collective's timeout.
        self.generations.on_member_lost(LossAbort(runtime.worker, runtime.backend,
                                                  lambda: (runtime.phase, runtime.running_generation)).on_lost)
        return self.re_form(runtime, "", None)

    def re_form(self, runtime: Runtime, why: str, noticed_at: float | None, failed: bool = False) -> Group:
        """A generation that fails while it forms (a peer lost while the group connects or the
        state is sent) is formed again, up to FORM_ATTEMPTS times. The group is reconfigured in
        place where train/reconfigure.py's rule says so, else built anew."""
        for attempt in range(1, FORM_ATTEMPTS + 1):
            step = next_group(runtime.group_choice.strategy, group_alive=runtime.reconfigurable is not None,
                              failed=failed or attempt > 1)
            runtime.teardown(keep_group=step is GroupStrategy.RECONFIGURE)
            runtime.mark_recovery("torn_down")
            generation = self.generations.join()
            runtime.mark_recovery("sealed")
            rank = generation.rank_of(runtime.worker)
            try:
                if runtime.group_choice.strategy is GroupStrategy.RECONFIGURE:
                    runtime.store = self._reconfigure(runtime, generation, rank)
                else:
                    runtime.store = build_generation_group(generation, rank, runtime.backend, runtime.pg_timeout,
                                                           runtime.device)
                runtime.control_group = build_control_group(runtime.backend, runtime.pg_timeout)
                runtime.mark_recovery("group_reconfigured" if step is GroupStrategy.RECONFIGURE else "group_built")
                return runtime.start_generation(generation, rank, generation.world_size,
                                                noticed_at if why else None)
            except StateError:
                raise  # what a peer sent does not fit: another generation would send the same
            except Exception as exc:  # noqa: BLE001 - a taken port, a peer lost while connecting or sending
                if not dist.is_initialized():
                    reset_group_counter()  # the failed init left torch's group counter raised
                log.warning("[%s] generation %d did not form (attempt %d of %d): %s", runtime.worker,
                            generation.number, attempt, FORM_ATTEMPTS, " ".join(str(exc).split())[:300])
        raise ElasticctlError(f"The worker '{runtime.worker}' could not form a generation in "
                              f"{FORM_ATTEMPTS} attempts; its node restarts it.")

    @staticmethod
    def _reconfigure(runtime: Runtime, generation: Round, rank: int):
        """This worker's reconfigurable group (made now if it has none) re-formed over
        ``generation``; returns the generation's store, kept alive with the group."""
        store = generation_store(generation, rank, runtime.pg_timeout)
        if runtime.reconfigurable is None:
            runtime.reconfigurable = ReconfigurableGroup(runtime.backend, runtime.pg_timeout)
        group = runtime.reconfigurable
        prefixed = dist.PrefixStore(f"generation-{generation.number}", store)
        group.reconfigure(generation.number, handles_of(prefixed, rank, generation.world_size, group.handle), prefixed)
        worker_env_entry.note_joined()
        return store

    def change_pending(self) -> bool:
        return self.generations is not None and self.generations.change_pending()

    def describe_change(self) -> str:
        return self.generations.describe_change() if self.generations is not None else super().describe_change()

    def cancel(self) -> None:
        if self.generations is not None:  # not connected yet: there is no wait to end
            self.generations.cancel()

    def leave(self) -> None:
        if self.generations is not None:
            self.generations.leave()

    def close(self) -> None:
        if self.generations is not None:
            self.generations.close()
