"""The one place training metrics go: ``metrics.jsonl`` plus every configured sink (``monitoring.sink``).

Only rank 0 writes; on other ranks ``RunLogger`` is a no-op so the trainer can call it
unconditionally. ``metrics.jsonl`` is the source of truth (reports are built from it): one strict
JSON object per line, flushed per call so a crash of the process loses at most the line being
written; fdatasync'ed for every event, on close and otherwise at most every ``SYNC_EVERY_S`` seconds.
On resume the file is appended to; lines from the earlier session that lie past the resumed step
are dropped (``truncate_after`` or automatically on the first overlapping ``log``) so no step is
ever shown twice, and every sink is told to purge the same steps (TensorBoard hides them).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.files import atomic_write_text
from monitoring.sink import Sink, SinkContext, open_sinks
from monitoring.sinks import plain

__all__ = ["RunLogger", "MetricsFile", "read_metrics_lines"]

log = logging.getLogger(__name__)


def _scalar(value: Any) -> float | None:
    """The float TensorBoard/trackers get, or None for non-numeric values."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    if isinstance(value, str):
        return float(value) if value in ("nan", "inf", "-inf") else None
    return float(value)


def read_metrics_lines(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete, parseable JSON object in a metrics.jsonl (a torn last line is skipped)."""
    records = []
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return records
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(obj, dict):
            records.append(obj)
    return records


_sync = getattr(os, "fdatasync", os.fsync)  # the data is what matters; skip the metadata flush
SYNC_EVERY_S = 10.0  # fdatasync metrics.jsonl at most this often, besides events and close (lines reach the OS at once)


class MetricsFile(Sink):
    """``run_dir/metrics.jsonl``, the run's record: appended to, repaired after a crash, and cut back
    on resume (``guard`` / ``truncate_after`` return the first step the other sinks must purge)."""

    def __init__(self, run_dir: Path) -> None:
        self.metrics_path = run_dir / "metrics.jsonl"
        self._synced_at = float("-inf")
        self._prior_end, self._prior_max_step = self._repair_and_scan()
        self._fh = open(self.metrics_path, "a", encoding="utf-8")

    def _repair_and_scan(self) -> tuple[int, int]:
        """Cut a torn last line left by a crash; return (size, highest step) of the existing file."""
        try:
            data = self.metrics_path.read_bytes()
        except FileNotFoundError:
            return 0, -1
        end = data.rfind(b"\n") + 1
        if end != len(data):
            os.truncate(self.metrics_path, end)
            log.warning("metrics.jsonl ended in a partial line (crash?); removed %d bytes.", len(data) - end)
        steps = [r["step"] for r in read_metrics_lines(self.metrics_path) if isinstance(r.get("step"), int)]
        return end, max(steps, default=-1)

    def _append(self, record: dict[str, Any], durable: bool = False) -> None:
        """Write one line and hand it to the OS (a crash of the process loses nothing written).

        fdatasync (against a machine crash) costs ms on a busy disk, so it runs at most every
        ``SYNC_EVERY_S`` seconds, for every event (rare, and what a post-mortem needs) and on close.
        """
        self._fh.write(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")
        self._fh.flush()
        now = time.monotonic()
        if durable or now - self._synced_at >= SYNC_EVERY_S:
            _sync(self._fh.fileno())
            self._synced_at = now

    def _rewrite(self, keep: Callable[[dict[str, Any]], bool], prior_only: bool) -> int:
        """Atomically rewrite metrics.jsonl without the records ``keep`` rejects; returns how many."""
        self._fh.close()
        data = self.metrics_path.read_bytes()
        split_at = self._prior_end if prior_only else len(data)
        kept, steps, dropped = [], [], 0
        for raw in data[:split_at].split(b"\n"):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                rec = None
            step = rec.get("step") if isinstance(rec, dict) else None
            if rec is None or not isinstance(rec, dict) or (isinstance(step, int) and not keep(rec)):
                dropped += 1
                continue
            kept.append(raw.decode("utf-8"))
            steps.append(step)
        prior_text = "".join(line + "\n" for line in kept)
        atomic_write_text(self.metrics_path, prior_text + data[split_at:].decode("utf-8"))
        self._prior_end = len(prior_text.encode("utf-8")) if prior_only else 0
        self._prior_max_step = max((s for s in steps if isinstance(s, int)), default=-1) if prior_only else -1
        self._fh = open(self.metrics_path, "a", encoding="utf-8")
        return dropped

    def truncate_after(self, step: int) -> int:
        """Drop every line with a step > ``step``; returns the number dropped."""
        dropped = self._rewrite(lambda r: r["step"] <= step, prior_only=False)
        self._prior_max_step = min(self._prior_max_step, step)
        return dropped

    def guard(self, step: int, inclusive: bool) -> int | None:
        """Drop lines of an earlier session at (``inclusive``) or after the step about to be written;
        returns the first dropped step, or None when nothing overlaps."""
        if step > self._prior_max_step or (not inclusive and step == self._prior_max_step):
            return None
        cut = step - 1 if inclusive else step
        self._rewrite(lambda r: r["step"] <= cut, prior_only=True)
        return cut + 1

    def log(self, step: int, split: str, values: dict[str, Any], scalars: dict[str, float]) -> None:
        self._append({"step": step, "split": split, "time": time.time(), **values})

    def event(self, step: int, kind: str, message: str, fields: dict[str, Any]) -> None:
        self._append({"step": step, "event": kind, "message": message, "time": time.time(), **fields}, durable=True)

    def close(self) -> None:
        self._fh.flush()
        _sync(self._fh.fileno())
        self._fh.close()


class RunLogger:
    """Fan-out of metrics and events to ``metrics.jsonl`` and every configured sink (rank 0 only).

    Args:
        run_dir: the run directory; writes ``metrics.jsonl`` (and the sinks' files) there.
        cfg: ``LoggingConfig`` (``progress``, ``tensorboard``, ``wandb``, ``mlflow``, ``prometheus_port``,
            ``sinks``: further registered sinks by name).
        is_main: False makes every method a no-op (non-zero ranks).
        total_steps: for the progress bar and ETA.
        config_dict: the resolved run config, stored as TensorBoard text and tracker hyperparameters.
        throughput_unit: what ``tokens_per_s`` counts: "tok", or "img" for image models.
        console: False leaves the console sink out (runs trained together print one line for all).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        cfg: Any,
        *,
        is_main: bool,
        total_steps: int,
        config_dict: dict[str, Any] | None = None,
        throughput_unit: str = "tok",
        console: bool = True,
    ) -> None:
        self.enabled = bool(is_main)
        self.run_dir = Path(run_dir)
        self.cfg = cfg
        self.total_steps = int(total_steps)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.sinks: dict[str, Sink] = {}  # by registered name, in fan-out order
        self._file: MetricsFile | None = None
        self._closed = False
        if not self.enabled:
            return
        ctx = SinkContext(run_dir=self.run_dir, cfg=cfg, total_steps=self.total_steps,
                          config_dict=config_dict or {}, throughput_unit=throughput_unit)
        early = open_sinks(ctx, early=True)  # e.g. a taken Prometheus port fails before any file is written
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._file = MetricsFile(self.run_dir)
            self.sinks = {**early, **open_sinks(ctx, early=False)}
            if not console and "console" in self.sinks:
                self.sinks.pop("console").close()
        except BaseException:
            for sink in early.values():
                sink.close()
            raise

    def _purge(self, first_stale_step: int | None) -> None:
        if first_stale_step is not None:
            for sink in self.sinks.values():
                sink.purge(first_stale_step)

    def truncate_after(self, step: int) -> int:
        """Drop every line with a step > ``step`` (call with the resumed checkpoint's step).

        Also makes the sinks hide the events past ``step``. Returns the number of lines dropped.
        """
        if not self.enabled:
            return 0
        dropped = self._file.truncate_after(step)
        self._purge(step + 1)
        if dropped:
            log.info("metrics.jsonl: dropped %d lines past step %d (resume).", dropped, step)
        return dropped

    def log(self, step: int, metrics: dict[str, Any], split: str = "train") -> None:
        """Record ``metrics`` for ``step`` in every sink; TensorBoard tags are ``split/name``."""
        if not self.enabled or self._closed:
            return
        step = int(step)
        self._purge(self._file.guard(step, inclusive=True))
        values = {str(k): plain(v) for k, v in metrics.items()}
        scalars = {f"{split}/{k}": x for k, v in values.items() if (x := _scalar(v)) is not None}
        self._file.log(step, split, values, scalars)
        for sink in self.sinks.values():
            sink.log(step, split, values, scalars)

    def log_histogram(self, step: int, tag: str, values: Any = None, *, counts: Any = None, edges: Any = None) -> None:
        """A histogram of raw ``values`` (tensor, array or list), or of a ready-made one given as
        ``counts`` (n bins) and ``edges`` (n + 1), e.g. from ``monitoring.diagnostics.gradient_histogram``.
        Only sinks that draw histograms (TensorBoard) take them; metrics.jsonl does not."""
        if not self.enabled or self._closed:
            return
        for sink in self.sinks.values():
            sink.histogram(int(step), tag, values=values, counts=counts, edges=edges)

    def event(self, step: int, kind: str, message: str, **fields: Any) -> None:
        """A notable occurrence (NaN skip, spike, starvation, resume…) in metrics.jsonl and every sink."""
        if not self.enabled or self._closed:
            return
        step = int(step)
        self._purge(self._file.guard(step, inclusive=False))
        extra = {str(k): plain(v) for k, v in fields.items() if k not in ("step", "event", "message")}
        self._file.event(step, kind, message, extra)
        for sink in self.sinks.values():
            sink.event(step, kind, message, extra)

    def flush(self) -> None:
        if self.enabled and not self._closed:
            for sink in self.sinks.values():
                sink.flush()

    def close(self) -> None:
        """Flush and release every sink (metrics.jsonl last); safe to call twice."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        for sink in reversed(self.sinks.values()):
            sink.close()
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
