"""The worker-side elastic runtime: a script hands it its state and its training function.

:func:`run` calls ``train(state, group)`` for each generation of workers. The script
ends each step with :meth:`State.commit`; a step boundary is where membership changes:

* **Hot recovery** (the job runs with ``--recovery hot``: the worker environment has hot settings).
  Survivors never restart. A peer's crash makes the step's collective raise at once; a
  frozen peer makes it time out (the process group's timeout is the node TTL). The
  workers then tear the process group down, agree on the next generation in etcd
  (:mod:`elasticctl.train.groups.generations`), build a new group on a fresh store, bring every
  member to the most advanced state (the workers that hold it send it in buckets when steps
  differ or a member is new: :mod:`elasticctl.train.state_transfer.transfer`), re-shard the sampler at the
  exact global position and re-enter ``train``. Joiners, and leavers (SIGTERM), are admitted or let go at a step boundary
  that every worker agrees on: each boundary all-reduces two flags (a change is
  pending; a worker is leaving) asynchronously, and the result is read at the next.
  Replicas stay bit-identical: either every survivor applied the step in flight, or the
  ones that did send their state to the others.
* **Restart mode** (anything else, plain torchrun too): one generation per process, as
  torchrun's round set up; a failure ends the worker and the agent restarts the group,
  which resumes from the newest checkpoint. SIGTERM still ends at a step boundary with a
  final checkpoint.

In either mode every ``--straggler-interval`` steps the workers exchange their own step times
and rank 0 names (and, with ``--evict-stragglers``, asks to leave) a node that sets everyone's
pace: :mod:`elasticctl.train.watches.stragglers`. Every ``--replica-check`` steps they exchange a
checksum of their parameters: rank 0 names (and, with ``--evict-diverged``, asks to leave) a
node whose replica differs from its replicas' majority, and replicas with no majority stop the
job: :mod:`elasticctl.train.watches.replica_check`.

The flags, the straggler exchange and the replica check's are CPU tensors on gloo, never the GPU's: the training
group carries them when it is gloo, a gloo side group over the same ranks otherwise (NCCL),
built and torn down with each generation (why: ``process_group.control_channel``). No step
waits for the device on elasticctl's behalf.

The two modes are two :class:`elasticctl.train.groups.membership.Membership` implementations
(``RestartMembership``, ``HotMembership``), which join generations and return them. Where the
worker goes next is one pure state machine, :func:`elasticctl.train.worker.lifecycle.transition` (it
takes :func:`elasticctl.train.worker.boundary.at_boundary`'s decision at a boundary); the
:class:`Runtime` is its executor.

What the runtime cannot handle in process (etcd unreachable for the whole join timeout,
a process group that will not come down) ends the worker with a non-zero status, and the
node's restart path takes over.

The executor and its parts are in :mod:`elasticctl.train.worker` (the generations and their
groups, the step boundary, the checkpoint duty, the watches, the model's placement, the reporter,
the liveness the other threads read); this module is what a script calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elasticctl.train.group import Group
from elasticctl.train.phase import Phase
from elasticctl.train.state import State
from elasticctl.train.worker.executor import Runtime, step_failure
from elasticctl.train.worker.generation_manager import EXIT_RECOVERY_FAILED, TEARDOWN_BOUND
from elasticctl.train.worker.watchdog import EXIT_STOPPED_WITHOUT_BOUNDARY, STOP_BOUND, no_step_warning_after

__all__ = ["EXIT_RECOVERY_FAILED", "EXIT_STOPPED_WITHOUT_BOUNDARY", "STOP_BOUND", "TEARDOWN_BOUND", "Phase",
           "Runtime", "no_step_warning_after", "run", "step_failure"]


def run(state: State, train: Callable[[State, Group], object], **options: Any) -> None:
    """Train ``state`` with ``train(state, group)``, generation after generation; see the module
    docstring. ``options``: ``checkpoint_dir`` (default: the one elasticctl hands out),
    ``checkpoint_every`` (steps; 0: only a final checkpoint), ``backend``, ``wrap``
    (``(model, group) -> model``, default DDP), ``pg_timeout`` (seconds), ``keep`` (checkpoints
    kept), ``async_checkpoint`` (periodic saves written by a background thread; default on).

    ``on_event(kind, **fields)``, if given, hears what the runtime did, for the script's own
    records: ``"resume"`` after a checkpoint restore (step, epoch, consumed, from_world_size,
    path); ``"checkpoint"`` on the writing rank after each save (step, epoch, consumed,
    async, blocked_ms: how long the save held up training); ``"checkpoint_failed"`` on the
    writing rank when a save (or the background write of the previous one) failed (step,
    reason); training goes on; ``"final_checkpoint"`` on every
    rank when a stop (SIGTERM) ends training with a final checkpoint (step, signalled: this
    worker was the one told to stop); ``"recovery_timeline"`` on every rank at the first step
    after a fault or change (round, noticed: the wall time the fault was seen, then the seconds
    from it to the end of each phase: torn_down, sealed, group_built or group_reconfigured, rewrapped or module_kept (sharded models),
    state_synced, first_step;
    see elasticctl/train/recovery/timeline.py). ``no_step_warning``: seconds without a step boundary
    (``state.commit``) after which the worker warns (default :func:`no_step_warning_after`).
    ``transfer_bucket_bytes``: the largest message of a hot recovery's state transfer (default
    64 MiB; :mod:`elasticctl.train.state_transfer.transfer`).

    ``sharded=True``: ``wrap`` shards the model (FSDP2 ``fully_shard`` on a mesh it builds); the
    runtime wraps a new module for each generation's mesh (``group.model``, also ``state.model``:
    use these, not the model object the script made), writes sharded checkpoints (DCP, resharded
    on load) and in hot mode moves shards: :mod:`elasticctl.train.sharding.shards`. ``sharded="hsdp"``: the
    wrap shards on :func:`elasticctl.train.sharding.shards.hsdp_mesh` (replicated across nodes, sharded
    within one), and where groups are reconfigured in place (``recovery_timeline``'s
    ``group_reconfigured``) that mesh and the module sharded on it outlive generations: a change
    agreed at a step boundary re-forms its groups, a survivor keeps its module and its shards, and
    only a newcomer wraps; after a frozen peer's timeout the groups are kept and the module is
    re-wrapped on the same mesh; after a lost peer every group, and so the module, is made anew.

    In hot mode ``"state_restored"`` on a rank whose state was restored when its generation formed:
    step, source ("replica": senders, nbytes, seconds; "checkpoint": path; "peer_copy": the shards
    held in memory, ``State(peer_copies=K)``: trained, redone, copies_of, copy_holders, nbytes,
    seconds), and for a sharded model the shard this worker holds (and, from a checkpoint,
    ``missing``: the shards that had no replica). With peer copies, ``"peer_copy"`` at the first
    step boundary after each copy round every worker agreed was whole (step, shard, nbytes sent,
    copies_of: the shards received, seconds)."""
    Runtime(state, **options).run(train)
