"""``RunHooks``: what a caller with more than pretraining adds to a ``Trainer`` run, in one object."""

from __future__ import annotations

from typing import Any

__all__ = ["RunHooks"]


class RunHooks:
    """What a caller with more than pretraining adds to a run (fine-tuning: ``finetune.runner.EpochSelection``).

    ``config_to_save``: what ``run_dir/config.yaml`` holds when the caller's config is richer than
    ``RunConfig`` (None: the run's own). ``on_evaluation`` sees every evaluation, on every rank (the
    metrics are already reduced over ranks); returning True after a periodic one stops the run
    (early stopping). ``finished_line`` is the line a rerun of a finished run prints when the caller names its
    budget otherwise than ``train.*`` (fine-tuning: ``epochs``); None keeps ``Resume.nothing_to_do``'s. The
    defaults do nothing.
    """

    config_to_save: Any = None

    def finished_line(self, resume: Any, run_dir: Any) -> str | None:
        return None

    def on_evaluation(self, step: int, metrics: dict[str, float]) -> bool:
        return False
