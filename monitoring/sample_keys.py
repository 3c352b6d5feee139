"""``logging.sample_keys``: each rank's append-only log of which samples every step trained on, and its
own loss (docs/monitoring.md) -- what the exact-resume tests compare, and what a user reads to find the
batch behind a loss spike."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class SampleKeyLog:
    """``rank-N.jsonl`` under ``run_dir/where`` (an absolute ``where`` stays as it is); one line per step."""

    def __init__(self, run_dir: Path, where: str, rank: int) -> None:
        folder = Path(run_dir) / where
        folder.mkdir(parents=True, exist_ok=True)
        self._file = open(folder / f"rank-{rank}.jsonl", "a", encoding="utf-8")

    @classmethod
    def open(cls, run_dir: Path, where: str, rank: int) -> SampleKeyLog | None:
        return cls(run_dir, where, rank) if where else None

    def write(self, step: int, loss: float, keys: list[Any]) -> None:
        self._file.write(json.dumps({"step": step, "loss": loss, "keys": keys, "pid": os.getpid()}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
