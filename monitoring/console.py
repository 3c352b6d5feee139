"""``configure_logging()``: our INFO/WARNING lines on the console, from rank 0 only.

The library modules log through ``logging.getLogger(__name__)`` and never configure logging
themselves; the entry points (``pretrain``, ``python -m pipelines.pretrain``, ``python -m
pipelines.finetune``) call this once. Without it Python shows nothing below WARNING and every rank
of a job repeats each line. Torch-free: the rank comes from the launcher's environment variables.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["configure_logging", "PACKAGES"]

#: The loggers this project writes to (their children inherit the handler).
PACKAGES = ("pipelines", "monitoring", "data_prep", "models", "core")
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _StderrHandler(logging.StreamHandler):
    """Writes to the current ``sys.stderr`` (which test harnesses and notebooks replace)."""

    _pretrain_console = True

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _rank() -> int:
    for var in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(var)
        if value is not None and value.lstrip("-").isdigit():
            return int(value)
    return 0


def configure_logging(level: int | str | None = None) -> None:
    """One stderr handler on our package loggers: ``level`` (default INFO, or ``PRETRAIN_LOG_LEVEL``) on
    rank 0, ERROR on the other ranks. Idempotent; leaves the root logger and third-party loggers alone."""
    if level is None:
        level = os.environ.get("PRETRAIN_LOG_LEVEL", "INFO")
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
        if not isinstance(level, int):
            level = logging.INFO
    if _rank() != 0:
        level = max(level, logging.ERROR)
    for name in PACKAGES:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        for handler in [h for h in logger.handlers if getattr(h, "_pretrain_console", False)]:
            logger.removeHandler(handler)
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        logger.addHandler(handler)
