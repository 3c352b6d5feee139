"""What a sweep checks once before its first run, and how a run's failure is reported and recorded.

A grid of N runs that share a typo (``--set optim.lrr=1``) or a missing corpus used to start N runs that
each failed the same way, the reason only in ``sweep.jsonl``. Here every grid point's resolved config
(base + ``run`` + grid overrides + ``--set``) passes the pre-launch ``check`` and each corpus the runs
read is checked once, the way ``pretrain train`` checks one, before anything is written; a refusal is
one ``ConfigError`` naming the grid point. Torch-free, milliseconds per grid point.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from core.config import ConfigError

__all__ = ["check_grid", "report_failure", "EXIT_CONFIG", "EXIT_FAILURE"]

EXIT_CONFIG = 2  # a run stopped by a config or data error (what `pretrain train` exits with)
EXIT_FAILURE = 1  # any other failure of an in-process run


def check_grid(specs: Sequence[Any], resolve: Callable[[Any], Any], *, world_size: int, where: str,
               extra: Sequence[str] = (), inputs: bool = True) -> None:
    """Raise ``ConfigError`` for the first grid point whose resolved config (``resolve(spec)``) or corpus
    would fail its run. ``where`` names the sweep (its file or out_dir); ``extra`` are the ``--set`` overrides."""
    from pipelines.engine.check import check, check_inputs

    with_set = f" with --set {' '.join(extra)}" if extra else ""
    seen: set[str] = set()
    for spec in specs:
        try:
            cfg = resolve(spec)  # loading checks names (optim.lr, schedule.warmup) and suggests the near ones
            check(cfg, world_size=world_size)
            key = repr((cfg.data, cfg.train.global_batch_size, cfg.train.grad_accum_steps))
            if inputs and key not in seen:  # the runs of a sweep mostly share one corpus: read its manifest once
                seen.add(key)
                check_inputs(cfg, world_size=world_size)
        except ConfigError as exc:
            raise ConfigError(f"{where}: grid point {spec.index} ({spec.name}){with_set}: {exc}") from None


def report_failure(exc: BaseException) -> tuple[str, int]:
    """Print a failed in-process run's error as ``pretrain train`` would and return (record text, exit code):
    a config or data error is one paragraph (its traceback only with ``PRETRAIN_DEBUG=1``), exit 2;
    anything else is a crash, shown whole, exit 1."""
    user_error = isinstance(exc, (ConfigError, FileNotFoundError))
    if not user_error or os.environ.get("PRETRAIN_DEBUG", "") not in ("", "0"):
        traceback.print_exc()
    if user_error:
        print(f"error: {exc}", file=sys.stderr, flush=True)
    return f"{type(exc).__name__}: {exc}", EXIT_CONFIG if user_error else EXIT_FAILURE
