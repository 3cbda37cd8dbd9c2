"""How a worker's generations come and go: one interface, restart mode and hot mode.

The runtime (:mod:`elasticctl.train.runtime`) trains in a generation and acts on step
boundaries; which workers form a generation, when the flags of a boundary are agreed
on, and whether a failure can be recovered in process is its :class:`Membership`'s. A
membership joins the next generation and returns it (:class:`Sealed`); the runtime builds its
groups, brings the state in sync and decides everything else (:mod:`elasticctl.train.worker.lifecycle`):

* :class:`RestartMembership`: one generation per process, torchrun's round as the agent
  formed it. A boundary that lets a worker go ends the process; the agent re-forms.
* :class:`HotMembership`: generations agreed in etcd by the workers themselves
  (:mod:`elasticctl.train.groups.generations`), re-formed in process after a failure or a change.
"""

from __future__ import annotations

import abc
import dataclasses
import datetime
from collections.abc import Callable
from typing import TYPE_CHECKING

from elasticctl.errors import ElasticctlError
from elasticctl.job.environment import WorkerEnvironment
from elasticctl.job.options import RecoveryMode
from elasticctl.job.records import Round
from elasticctl.job.settings import HotSettings
from elasticctl.train import script as worker_env

if TYPE_CHECKING:
    from elasticctl.train.groups.generations import Generations


@dataclasses.dataclass(frozen=True)
class Sealed:
    """A generation this worker is a member of: the record, its rank and the world's size.
    ``groups_ready``: its process group is already up (restart mode: torchrun's round, set up by
    the script's environment); else the runtime builds or reconfigures it."""

    generation: Round
    rank: int
    world_size: int
    groups_ready: bool = False


class Membership(abc.ABC):
    """Who trains together, generation after generation, for one worker. It joins generations
    and says what it knows; it never touches the runtime: the runtime asks."""

    mode: RecoveryMode
    node_ttl: float | None = None  # seconds a member may be silent (None: torch's agent decides)

    @property
    def recovers_in_process(self) -> bool:
        """Whether a failure of the script's step is met with a new generation in this process."""
        return self.mode is RecoveryMode.HOT

    @property
    def records_generations(self) -> bool:
        """Whether rank 0 records each generation formed (the agent records torchrun's rounds)."""
        return self.mode is RecoveryMode.HOT

    def connect(self) -> None:
        """Before the first generation: whatever the membership needs to join one."""

    @abc.abstractmethod
    def join(self) -> Sealed:
        """The next generation this worker is a member of (blocks until it is sealed; raises
        JoinCancelled when :meth:`cancel` ends the wait)."""

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

    def __init__(self, backend: str, timeout: datetime.timedelta, environment: WorkerEnvironment) -> None:
        self._backend, self._timeout, self._environment = backend, timeout, environment
        self._joined = False

    def join(self) -> Sealed:
        if self._joined:  # never asked: a restart-mode boundary stops for the agent, a failure ends the worker
            raise ElasticctlError("A restart-mode worker does not re-form in process.")
        self._joined = True
        ctx = worker_env.init(timeout=self._timeout.total_seconds(), backend=self._backend,
                              environment=self._environment)
        return Sealed(Round(number=ctx.restart, members=()), ctx.rank, ctx.world_size, groups_ready=True)


class HotMembership(Membership):
    """Hot mode: generations of workers, agreed in etcd, re-formed in process."""

    mode = RecoveryMode.HOT

    def __init__(self, settings: HotSettings, connect: Callable[[], Generations]) -> None:
        self.settings = settings
        self.node_ttl = settings.node_ttl
        self._connect = connect  # the job's generations, from the worker's environment
        self.generations: Generations | None = None  # connected by connect()

    def connect(self) -> None:
        self.generations = self._connect()

    def join(self) -> Sealed:
        generation = self.generations.join()
        return Sealed(generation, generation.rank_of(self.generations.worker), generation.world_size)

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
