"""Training, fine-tuning and operations, in sub-packages by concern (lowest first):

- ``loading``  the streaming loader (manifest -> resumable batches);
- ``engine``   run config, Trainer loop, distributed setup, checkpoints, optimizers, schedules,
               objectives, export;
- ``finetune`` classification and extractive-QA fine-tuning on released checkpoints;
- ``study``    the optimizer x warmup sweep and its analysis;
- ``ops``      SLURM submission, the demo and the run planner (``pretrain plan``).

The top level holds only the entry points users type: ``cli`` (the ``pretrain`` command) and
``pretrain`` (``python -m pipelines.pretrain CONFIG k=v…`` under a launcher); ``python -m
pipelines.finetune`` is ``finetune/__main__``. A sub-package imports only those listed before it,
plus ``models``, ``monitoring``, ``data_prep`` (``ops`` only) and ``core`` (tests/test_layering.py).
"""
