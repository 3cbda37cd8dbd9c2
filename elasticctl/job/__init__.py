"""What a job keeps in etcd, owned in one place.

* :mod:`elasticctl.job.keys` — the key layout: every path a job uses, and nothing else
  builds one.
* :mod:`elasticctl.job.records` — the records under those keys: typed, JSON (never
  pickle), validated when read, signed with the job secret where it matters.

* :mod:`elasticctl.job.registry`, :mod:`elasticctl.job.rdzv_records` and
  :mod:`elasticctl.job.events` — the reads and writes of those records, as typed methods;
  :mod:`elasticctl.job.snapshot` — one read of a job, which ``status`` and the dashboard present.
* :mod:`elasticctl.job.counters` — the job's counters: totals of its events for its life, which
  :class:`~elasticctl.job.events.EventLog` adds each recorded event to (compare-and-swap).

Everything that reads or writes a job's keys goes through these modules: no module above
``job/`` calls the etcd client for them.
"""
