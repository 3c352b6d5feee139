"""How a sweep records its runs' attempts: the ``done`` marker, ``run_status`` read from a run dir, ``sweep.jsonl``.

A run is complete when ``RUN_DIR/done`` exists (written atomically after the run): status ``ok`` or ``diverged``
(``FINAL_STATUSES``), both results that the next invocation skips. Every attempt, whatever its end, appends one
line to ``SWEEP_DIR/sweep.jsonl``. Used by ``pipelines.study.sweep`` (one run at a time and ensembles).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from core.files import atomic_write_text

__all__ = ["DONE", "SWEEP_LOG", "FINAL_STATUSES", "done_record", "run_status", "append_log", "close_attempt"]

DONE = "done"
SWEEP_LOG = "sweep.jsonl"
FINAL_STATUSES = ("ok", "diverged")


def done_record(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The ``done`` marker of a run that ended ok or diverged (None: not finished, or an unreadable marker)."""
    try:
        rec = json.loads((Path(run_dir) / DONE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return rec if isinstance(rec, dict) and rec.get("status") in FINAL_STATUSES else None


def run_status(run_dir: str | os.PathLike, max_steps: int) -> dict[str, Any]:
    """What a run dir says about its run: ``ok`` | ``diverged`` | ``interrupted`` | ``missing``, plus facts.

    ``ok``: ``checkpoints/latest`` names ``step-{max_steps}``. ``diverged``: a ``nan_stop`` event (or
    a non-finite last train loss) in metrics.jsonl. Otherwise ``interrupted`` (or ``missing``).
    """
    from monitoring.logger import read_metrics_lines
    from pipelines.engine.checkpoint import step_dir_name

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return {"status": "missing"}
    records = read_metrics_lines(run_dir / "metrics.jsonl")
    events = [r for r in records if "event" in r]
    train = [r for r in records if r.get("split") == "train" and "loss" in r]
    last_loss = train[-1]["loss"] if train else None
    finite = isinstance(last_loss, (int, float)) and last_loss == last_loss and abs(last_loss) != float("inf")
    latest = run_dir / "checkpoints" / "latest"
    final = latest.is_file() and latest.read_text(encoding="utf-8").strip() == step_dir_name(max_steps)
    info = {
        "last_step": train[-1]["step"] if train else 0,
        "final_loss": last_loss if finite else None,
        "events": len(events),
        "nan_stop": any(e["event"] == "nan_stop" for e in events),
        "stopped_by": next((e.get("reason") for e in reversed(events) if e["event"] == "stop"), None),
    }
    if info["nan_stop"] or (last_loss is not None and not finite):
        return {"status": "diverged", **info}
    if final:
        return {"status": "ok", **info}
    return {"status": "interrupted", **info}


def append_log(sweep_dir: Path, record: dict[str, Any]) -> None:
    """One JSON line in SWEEP_DIR/sweep.jsonl, locked so concurrent array tasks never interleave."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, default=str) + "\n"
    with open(sweep_dir / SWEEP_LOG, "a", encoding="utf-8") as fh:
        try:
            import fcntl

            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        except (ImportError, OSError):  # no flock (Windows, some network FS): one small append is still atomic
            pass
        fh.write(line)
        fh.flush()
        os.fsync(fh.fileno())


def close_attempt(sweep_dir: str | os.PathLike, spec: Any, started: float, status: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """The attempt's record for ``spec`` (a ``sweep.RunSpec``; ``run_status`` facts + ``fields``): the ``done``
    marker when final, a line in SWEEP_DIR/sweep.jsonl."""
    status = dict(status)
    record = {"index": spec.index, "name": spec.name, "run_dir": str(spec.run_dir), **spec.axes,
              "status": status.pop("status"), "wall_time_s": round(time.time() - started, 3), "time": started,
              "rc": 0, "error": None, **fields, **status}
    if record["status"] in FINAL_STATUSES:
        atomic_write_text(spec.run_dir / DONE, json.dumps(record, default=str) + "\n")
    append_log(Path(sweep_dir), record)
    return record
