"""Fine-tuning: a released checkpoint + a task head, trained with the pretraining `Trainer`.

`pretrain finetune CONFIG` (or `python -m pipelines.finetune CONFIG k=v…` under a launcher) loads
a release directory — ours or a Hugging Face one — through `models.hf.from_hf`, attaches a
classification head (BERT or GPT-2 architecture: ``classification.CLASSIFIER_FAMILIES``), an
extractive-QA head (BERT) or an image-classification head (ViT), trains it with the same
engine as pretraining (accelerate/DeepSpeed, mixed precision, accumulation), evaluates every
epoch, keeps the best epoch by the dev metric and writes `metrics.json` plus a release directory
that `transformers` loads.

Owns: ``config`` (FinetuneConfig), ``data`` (classification files), ``image_data`` (class folders of
images), ``squad`` (SQuAD reading,
windowing, decoding, scoring), ``metrics``, ``card`` (the release's model card), ``runner`` (the skeleton
every task shares: run config per epoch, checkpoint resolution, early stopping, best epoch) and one
module per task (``classification``, ``qa``, ``image_classification``).
May import ``pipelines.engine``, ``pipelines.loading``, ``models``, ``monitoring`` and ``core``.
"""

from __future__ import annotations

from typing import Any

from pipelines.finetune.config import FINETUNE_TASKS, FinetuneConfig
from pipelines.finetune.data import FinetuneError

__all__ = ["FinetuneConfig", "FinetuneError", "FINETUNE_TASKS", "run_finetune", "task_families"]


def task_families(task: str) -> tuple[str, ...]:
    """The model families ``task`` fine-tunes (its module's ``FAMILIES``): a release of another is refused first."""
    import importlib

    return importlib.import_module(FINETUNE_TASKS[task].split(":")[0]).FAMILIES


def run_finetune(cfg: FinetuneConfig) -> dict[str, Any]:
    """Fine-tune and export; returns the dev metrics of the best epoch and the output paths."""
    import importlib

    from pipelines.engine.distributed import in_process_run

    module, func = FINETUNE_TASKS[cfg.train.task].split(":")
    with in_process_run():
        return getattr(importlib.import_module(module), func)(cfg)
