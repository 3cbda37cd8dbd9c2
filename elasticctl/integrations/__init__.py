"""The training frameworks people already use, elastic: one import changed in their script.

* :mod:`elasticctl.integrations.lightning`: PyTorch Lightning's ``Trainer``
  (``pip install 'elasticctl[lightning]'``).
* :mod:`elasticctl.integrations.huggingface`: Hugging Face ``transformers``' ``Trainer``
  (``pip install 'elasticctl[huggingface]'``).
* :mod:`elasticctl.integrations.fabric` and :mod:`elasticctl.integrations.accelerate`: a loop of
  one's own on Lightning Fabric or ``accelerate``, in hot mode under ``elasticctl.train.run``
  (its ``Fabric``/``Accelerator`` made on each generation).

The two ``Trainer`` integrations share the batch policy (:mod:`~elasticctl.integrations.batching`)
and the sampler (:mod:`~elasticctl.integrations.sampling`); the two loops share
:func:`~elasticctl.integrations.loops.unwrapped`. None of these three imports a framework.

Each module imports its framework; this package and the core of elasticctl import none. What the
integrations share with :mod:`elasticctl.train` (the checkpoints, the resumable sampler) is the
same code, not a copy: a checkpoint is written atomically with its digest, the newest ``keep`` are
kept, and every sample of an epoch is trained once across a change of the world size.
"""
