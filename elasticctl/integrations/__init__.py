"""The training frameworks people already use, elastic: one import changed in their script.

* :mod:`elasticctl.integrations.lightning`: PyTorch Lightning's ``Trainer``
  (``pip install 'elasticctl[lightning]'``).
* :mod:`elasticctl.integrations.huggingface`: Hugging Face ``transformers``' ``Trainer``
  (``pip install 'elasticctl[huggingface]'``).

Each module imports its framework; this package and the core of elasticctl import none. What the
integrations share with :mod:`elasticctl.train` (the checkpoints, the resumable sampler) is the
same code, not a copy: a checkpoint is written atomically with its digest, the newest ``keep`` are
kept, and every sample of an epoch is trained once across a change of the world size.
"""
