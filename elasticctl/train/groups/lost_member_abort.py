"""Freeze detection independent of the collective timeout: when the membership learns that a
member of the running generation is lost (its lease ended, or ``ctl/reform`` names it), a worker
that may be blocked in a collective with it aborts its training group, so that the pending
collective raises at once and the worker goes to re-form.

Without this, a frozen peer (SIGSTOP, a hung host) holds the survivors in their collective until
its timeout, which hot mode sets to the node TTL, so a freeze costs the TTL plus whatever is
left of the timeout. With it, a freeze costs the node TTL and the watch's round trip.

torch's public ``ProcessGroup.abort()`` aborts what the backend can: NCCL aborts its
communicators and the kernels waiting on a lost peer. Gloo's abort is a no-op (tested on
torch 2.14: a pending gloo collective keeps waiting), so on gloo the path runs, decides, and
logs once that a collective pending on a frozen member ends by its timeout instead. (A dead
member's end reaches every gloo survivor at once another way: the first survivor whose
collective fails shuts the generation's connections down, train/groups/connections.py.) Other backends get the abort: torch
makes it a no-op where the backend has none.

The decision is :func:`loss_action` (pure, table-tested); :class:`LossAbort` is the edge that
runs on the rendezvous view's writer thread (never the training thread) and calls torch.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable

import torch.distributed as dist

from elasticctl.train.phase import Phase

log = logging.getLogger(__name__)


class LossAction(enum.Enum):
    NOTHING = "nothing"         # no member of the running generation lost, or not in one, or done
    ABORT = "abort"             # abort the training group: its pending collective raises now
    NO_ABORT = "no abort"       # the backend has no abort: the collective ends by its timeout


def backend_aborts(backend: str) -> bool:
    """Whether ``backend`` (as ``init_process_group`` takes it: ``"nccl"``,
    ``"cpu:gloo,cuda:nccl"``, a registered name) can abort a pending collective: any but
    gloo alone, whose abort is a no-op."""
    backends = {name.lower() for name in dist.BackendConfig(backend).get_device_backend_map().values()}
    return backends != {dist.Backend.GLOO}


def loss_action(backend: str, phase: Phase, running: int | None, lost_round: int, lost: tuple[str, ...],
                aborted: int | None) -> LossAction:
    """What a worker does when its membership reports ``lost`` members of generation
    ``lost_round``: it trains (``phase``) in generation ``running`` (None: none) on ``backend``,
    and has already aborted generation ``aborted`` (None: none).

    Only while training: forming or re-forming, the group is being built or torn down by the
    training thread (and a failure there is retried by the membership), and a leaving or
    finished worker trains no more. Only a loss in the generation the group belongs to: a loss
    reported for an earlier one is over. Once per generation."""
    if (not lost or phase is not Phase.TRAINING or running is None or lost_round != running
            or aborted == running):
        return LossAction.NOTHING
    return LossAction.ABORT if backend_aborts(backend) else LossAction.NO_ABORT


class LossAbort:
    """Acts on the lost members the membership reports (:meth:`on_lost`, from the view's writer
    thread) for worker ``worker``, whose training group runs on ``backend``; ``running()`` says
    where the worker is: (phase, generation of its group or None); ``lock``: held while the groups
    change."""

    def __init__(self, worker: str, backend: str, running: Callable[[], tuple[Phase, int | None]],
                 lock: threading.Lock | None = None) -> None:
        self.worker = worker
        self.backend = backend
        self._running = running
        # The lock the groups' owner changes them under (train/worker/generation_manager.py): an
        # abort never runs while the group is torn down or its successor built.
        self._lock = lock or threading.Lock()
        self._aborted: int | None = None  # the generation whose group this worker aborted
        self._no_abort_logged = False

    def on_lost(self, lost_round: int, lost: tuple[str, ...]) -> LossAction:
        with self._lock:
            phase, running = self._running()
            # The group to abort, taken before the second look: if the training thread moved on
            # in between, the generation differs and nothing is aborted (a new group is never hit).
            world = dist.group.WORLD if dist.is_initialized() else None
            if self._running() != (phase, running) or world is None:
                return LossAction.NOTHING
            action = loss_action(self.backend, phase, running, lost_round, lost, self._aborted)
            if action is LossAction.ABORT:
                self._aborted = running
                log.warning("[%s] %s of generation %d lost while it may wait in a collective: aborting "
                            "its training group (%s)", self.worker, ", ".join(lost), running, self.backend)
                try:
                    world.abort()
                except Exception as exc:  # noqa: BLE001 - torch's abort of a group already destroyed
                    log.warning("[%s] the abort of generation %d's training group failed: %s",
                                self.worker, running, exc)
            elif action is LossAction.NO_ABORT and not self._no_abort_logged:
                self._no_abort_logged = True
                log.warning("[%s] %s of generation %d lost; the training group's backend (%s) has no "
                            "abort: a collective pending on a frozen member ends by its timeout (the node "
                            "TTL). Logged once.",
                            self.worker, ", ".join(lost), running, self.backend)
            return action
