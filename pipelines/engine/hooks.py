"""``RunHooks``: what a caller with more than pretraining adds to a ``Trainer`` run, in one object."""

from __future__ import annotations

from typing import Any

__all__ = ["RunHooks"]


class RunHooks:
    """What a caller with more than pretraining adds to a run (fine-tuning: ``finetune.runner.EpochSelection``).

    ``config_to_save``: what ``run_dir/config.yaml`` holds when the caller's config is richer than
    ``RunConfig`` (None: the run's own). ``on_evaluation`` sees every evaluation, on every rank (the
    metrics are already reduced over ranks); returning True after a periodic one stops the run
    (early stopping). The defaults do nothing.
    """

    config_to_save: Any = None

    def on_evaluation(self, step: int, metrics: dict[str, float]) -> bool:
        return False
