"""Checkpoints on disk: what the replicated checkpointer (:mod:`elasticctl.train.checkpoint`, the one
a script imports) and the sharded one (:mod:`~elasticctl.train.checkpoints.sharded`, DCP shards
resharded on load) share: errors, atomic writes, digests, the loading allow-list
(:mod:`~elasticctl.train.checkpoints.files`)."""
