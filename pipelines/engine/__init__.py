"""The training engine: run config, the `Trainer` loop, distributed setup, checkpoints,
optimizers, LR schedules, training objectives and export to Hugging Face releases.

Nothing here is model-family specific beyond the objective registry (``objectives``). May import
``pipelines.loading``, ``models``, ``monitoring`` and ``core``; never ``finetune``, ``study`` or
``ops``.
"""
