"""Sharded models across generations: the HSDP mesh and the re-wrap per generation, local shards
for the state transfer (:mod:`~elasticctl.train.sharding.shards`), and the in-memory copies of a
worker's shards kept by a buddy (:mod:`~elasticctl.train.sharding.buddy_copies`)."""
