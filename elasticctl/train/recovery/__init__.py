"""Hot recovery's sources of a training state, behind one seam.

When a generation forms, its members must train on from one state. Several places may hold it,
each cheaper than the next: the **replicas** (the live state of the members that trained on:
the whole state of a replicated model, or per shard index of a sharded one), the **peer
copies** (shards a buddy keeps in memory, ``State(peer_copies=K)``) and the **checkpoint**. Each
is a :class:`~elasticctl.train.recovery.source.RecoverySource` (:mod:`.source`):

1. **report**: a few integers saying what this member holds (fixed width, so that one
   all-gather carries every source's report, beside the common part: step, generation last in
   sync, step trained to, shard index: :class:`~elasticctl.train.recovery.source.Reports`);
2. **plan**: a pure function of every member's report, returning one variant of the plan (a
   frozen dataclass: :class:`~.source.NothingToMove`, :class:`~.replicas.FromReplicas`,
   :class:`~.peer_copies.FromPeerCopies`, :class:`~.checkpoint.FromCheckpoint`; the union is
   :data:`~.sources.Plan`), or None where this source cannot bring every member to one state;
3. **restore**: every member's part in carrying out the plan that source made.

The pure chooser (:func:`~.source.choose_plan`) asks the sources in precedence order and takes
the first plan; the order is :func:`~.sources.recovery_sources`': a live replica beats a
buddy's copy, which beats the checkpoint (the checkpoint always has a plan). Every source
believes the same members (:func:`~.source.trust`: the previous generation's members, none far
ahead of its peers). :class:`elasticctl.train.recovery.state_sync.GenerationStateSync` gathers the reports
once, chooses, and hands the plan to the source that made it.

Adding a source (2-3 files):

- its module here, ``recovery/<name>.py``: its plan variant (a frozen dataclass) and a class with
  ``name``, ``report_width``, ``report()``, the pure ``plan(reports)`` and ``restore(plan, reports,
  restoring)``;
- its table tests, ``tests/unit/test_recovery_<name>.py`` (the plan is pure: reports in, plan out);
- its registration in :mod:`.sources`: a place in :func:`~.sources.recovery_sources`' order and
  its variant in :data:`~.sources.Plan`.

This package imports nothing at import time: its modules import each other, never through it.
"""
