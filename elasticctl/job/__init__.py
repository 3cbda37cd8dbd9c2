"""What a job keeps in etcd, owned in one place.

* :mod:`elasticctl.job.keys` — the key layout: every path a job uses, and nothing else
  builds one.
* :mod:`elasticctl.job.records` — the records under those keys: typed, JSON (never
  pickle), validated when read, signed with the job secret where it matters.

Everything that reads or writes a job's keys goes through these two modules.
"""
