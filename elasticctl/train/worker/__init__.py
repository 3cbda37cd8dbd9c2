"""The worker's executor and its parts: :mod:`~elasticctl.train.worker.executor` carries out the
pure state machine of :mod:`elasticctl.train.worker.lifecycle` through parts that each own their state
(generations and groups, the step boundary, checkpoints, watches, the model's placement, the
reporter, the liveness other threads read). A script imports :func:`elasticctl.train.run`, never
these."""
