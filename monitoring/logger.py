"""The one place training metrics go: console progress, metrics.jsonl, TensorBoard, W&B/MLflow.

Only rank 0 writes; on other ranks ``RunLogger`` is a no-op so the trainer can call it
unconditionally. ``metrics.jsonl`` is the source of truth (reports are built from it): one strict
JSON object per line, flushed per call so a crash of the process loses at most the line being
written; fdatasync'ed for every event, on close and otherwise at most every ``SYNC_EVERY_S`` seconds.
On resume the file is appended to; lines from the earlier session that lie past the resumed step
are dropped (``truncate_after`` or automatically on the first overlapping ``log``) so no step is
ever shown twice, and TensorBoard is told to purge the same steps.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.files import atomic_write_text

__all__ = ["RunLogger", "read_metrics_lines"]

log = logging.getLogger(__name__)

#: File in the run dir holding the W&B run id, so every session of a run logs to one W&B run.
WANDB_ID_FILE = "wandb_run_id"

_TRAIN_KEYS = (
    ("loss", "loss", "{:.4f}"),
    ("lr", "lr", "{:.2e}"),
    ("tokens_per_s", "tok/s", "{:,.0f}"),
    ("mfu", "mfu", "{:.1%}"),
    ("grad_norm", "gnorm", "{:.3g}"),
)


def _plain(value: Any) -> Any:
    """A JSON-safe scalar: tensors/numpy to Python, non-finite floats to "nan"/"inf"/"-inf"."""
    if hasattr(value, "item") and callable(value.item):
        try:
            value = value.item()
        except (ValueError, RuntimeError):  # a multi-element tensor/array
            value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


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


def _wait_for_later_second(tb_dir: Path) -> None:
    """TensorBoard reads a dir's event files in name order, and names start with the creation
    second; a new file must not share a second with an older one or the order can come out wrong
    (it then compares pid and a counter as text). Only ever waits when a writer is reopened at once."""
    stamps = [
        int(p.name.split(".")[3])
        for p in tb_dir.glob("events.out.tfevents.*")
        if len(p.name.split(".")) > 3 and p.name.split(".")[3].isdigit()
    ]
    if stamps and max(stamps) >= int(time.time()):
        time.sleep(max(stamps) + 1 - time.time() + 0.01)


def _fmt_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}"


class RunLogger:
    """Fan-out of metrics and events to every configured sink (rank 0 only).

    Args:
        run_dir: the run directory; writes ``metrics.jsonl`` and ``tb/`` there.
        cfg: ``LoggingConfig`` (``progress``, ``tensorboard``, ``wandb``, ``mlflow``).
        is_main: False makes every method a no-op (non-zero ranks).
        total_steps: for the progress bar and ETA.
        config_dict: the resolved run config, stored as TensorBoard text and tracker hyperparameters.
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
    ) -> None:
        self.enabled = bool(is_main)
        self.throughput_unit = throughput_unit  # what ``tokens_per_s`` counts: "tok", or "img" for image models
        self.run_dir = Path(run_dir)
        self.cfg = cfg
        self.total_steps = int(total_steps)
        self.config_dict = config_dict or {}
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self._fh = None
        self._synced_at = float("-inf")
        self._tb = None
        self._tb_purge_step: int | None = None
        self._trackers: list[Any] = []
        self._prometheus = None
        self._progress = None
        self._task = None
        self._eta_origin: tuple[int, float] | None = None
        self._closed = False
        if not self.enabled:
            return
        if getattr(cfg, "prometheus_port", 0):  # first: a taken port fails before any file is opened
            from monitoring.prometheus import PrometheusExporter

            self._prometheus = PrometheusExporter(int(cfg.prometheus_port), addr=getattr(cfg, "prometheus_host", "127.0.0.1"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._prior_end, self._prior_max_step = self._repair_and_scan()
        self._fh = open(self.metrics_path, "a", encoding="utf-8")
        self._trackers = self._open_trackers()
        self._use_bar = bool(cfg.progress) and sys.stdout.isatty()
        if self._use_bar:
            self._start_progress_bar()

    # --------------------------------------------------------------------------- metrics.jsonl
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
        """Drop every line with a step > ``step`` (call with the resumed checkpoint's step).

        Also makes TensorBoard hide the events past ``step``. Returns the number of lines dropped.
        """
        if not self.enabled:
            return 0
        dropped = self._rewrite(lambda r: r["step"] <= step, prior_only=False)
        self._prior_max_step = min(self._prior_max_step, step)
        self._purge_tensorboard(step + 1)
        if dropped:
            log.info("metrics.jsonl: dropped %d lines past step %d (resume).", dropped, step)
        return dropped

    def _guard_resume(self, step: int, inclusive: bool) -> None:
        """Drop lines of an earlier session at or after the step we are about to write."""
        if step > self._prior_max_step or (not inclusive and step == self._prior_max_step):
            return
        cut = step - 1 if inclusive else step
        self._rewrite(lambda r: r["step"] <= cut, prior_only=True)
        self._purge_tensorboard(cut + 1)

    # -------------------------------------------------------------------------------- TensorBoard
    def _writer(self) -> Any:
        """The SummaryWriter, created on first use so a resume's purge step is known by then."""
        if self._tb is None and self.cfg.tensorboard and not self._closed:
            from torch.utils.tensorboard import SummaryWriter

            tb_dir = self.run_dir / "tb"
            _wait_for_later_second(tb_dir)
            self._tb = SummaryWriter(log_dir=str(tb_dir), purge_step=self._tb_purge_step, flush_secs=30)
            if self.config_dict:
                text = json.dumps(_plain(self.config_dict), indent=2)
                self._tb.add_text("config", "```\n" + text + "\n```", 0)
        return self._tb

    def _tb_scalars(self, scalars: dict[str, float], step: int) -> None:
        """All of a step's scalars as one event record: one queue hand-off instead of one per tag."""
        from torch.utils.tensorboard.summary import scalar

        writer = self._writer()
        get_writer = getattr(writer, "_get_file_writer", None)
        if get_writer is None:  # a future torch without it: the public, slower path
            for tag, value in scalars.items():
                writer.add_scalar(tag, value, step)
            return
        items = iter(scalars.items())
        merged = scalar(*next(items))
        for tag, value in items:
            merged.value.extend(scalar(tag, value).value)
        get_writer().add_summary(merged, step, time.time())

    def _purge_tensorboard(self, first_stale_step: int) -> None:
        """Make TensorBoard hide events at or after this step from earlier sessions' files."""
        self._tb_purge_step = first_stale_step
        if self._tb is not None:  # already writing: a new file whose first record is the purge
            self._tb.close()
            self._tb = None

    # ----------------------------------------------------------------------------- W&B / MLflow
    def _open_trackers(self) -> list[Any]:
        trackers = []
        flat = _flatten(self.config_dict)
        if self.cfg.wandb:
            trackers += self._start_tracker("wandb", self._make_wandb, flat)
        if self.cfg.mlflow:
            trackers += self._start_tracker("mlflow", self._make_mlflow, flat)
        return trackers

    def _start_tracker(self, name: str, make: Callable[[], Any], flat: dict[str, Any]) -> list[Any]:
        import importlib.util

        if importlib.util.find_spec(name) is None:
            log.warning("logging.%s is on but the %s package is not installed; skipping it.", name, name)
            return []
        try:
            tracker = make()
            tracker.start()
            if flat:
                tracker.store_init_configuration(flat)
            return [tracker]
        except Exception as exc:  # an external service must never stop training
            log.warning("Could not start the %s tracker (%s); continuing without it.", name, exc)
            return []

    def wandb_run_id(self) -> str:
        """The W&B run id of this run dir: made once and kept in ``RUN_DIR/wandb_run_id``.

        A requeued or resumed job reads it back and continues the same W&B run (``resume="allow"``)
        instead of starting a new one per SLURM requeue.
        """
        path = self.run_dir / WANDB_ID_FILE
        if path.is_file() and (run_id := path.read_text(encoding="utf-8").strip()):
            return run_id
        import uuid

        run_id = uuid.uuid4().hex[:16]
        atomic_write_text(path, run_id + "\n")
        return run_id

    def _make_wandb(self) -> Any:
        from accelerate.tracking import WandBTracker

        return WandBTracker(
            os.environ.get("WANDB_PROJECT", "pretrain"),
            name=self.run_dir.name,
            dir=str(self.run_dir),
            mode=os.environ.get("WANDB_MODE", "offline"),
            id=self.wandb_run_id(),
            resume="allow",
        )

    def _make_mlflow(self) -> Any:
        import mlflow
        from accelerate.tracking import MLflowTracker

        if not os.environ.get("MLFLOW_TRACKING_URI"):  # offline: a file store inside the run dir
            mlflow.set_tracking_uri((self.run_dir / "mlruns").resolve().as_uri())
        return MLflowTracker(experiment_name="pretrain", run_name=self.run_dir.name)

    def _tracker_log(self, values: dict[str, float], step: int) -> None:
        for tracker in list(self._trackers):
            try:
                tracker.log(values, step=step)
            except Exception as exc:
                log.warning("Tracker %s failed (%s); disabling it.", getattr(tracker, "name", tracker), exc)
                self._trackers.remove(tracker)

    # ------------------------------------------------------------------------------------ console
    def _start_progress_bar(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            refresh_per_second=2,
        )
        self._task = self._progress.add_task("train", total=self.total_steps, info="")
        self._progress.start()

    def _print(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False)
        else:
            print(text, flush=True)

    def _eta(self, step: int) -> str:
        now = time.monotonic()
        if self._eta_origin is None:
            self._eta_origin = (step, now)
        s0, t0 = self._eta_origin
        if step <= s0:
            return "?"
        rate = (step - s0) / (now - t0)
        return _fmt_duration((self.total_steps - step) / rate) if rate > 0 else "?"

    def _console(self, step: int, split: str, metrics: dict[str, Any]) -> None:
        if split == "train":
            parts = [
                f"{f'{self.throughput_unit}/s' if k == 'tokens_per_s' else label} {fmt.format(metrics[k])}"
                for k, label, fmt in _TRAIN_KEYS
                if isinstance(metrics.get(k), (int, float)) and not isinstance(metrics.get(k), bool)
            ]
        else:
            parts = [f"{k} {v:.4g}" for k, v in metrics.items() if isinstance(v, float)]
        info = "  ".join(parts)
        if self._progress is not None and split == "train":
            self._progress.update(self._task, completed=min(step, self.total_steps), info=info)
            return
        eta = self._eta(step) if split == "train" else None
        pct = f" {step / self.total_steps:.0%}" if self.total_steps > 0 else ""
        tail = f"  eta {eta}" if eta else ""
        self._print(f"[step {step}/{self.total_steps}{pct}] {split}  {info}{tail}")

    # ------------------------------------------------------------------------------------ public
    def log(self, step: int, metrics: dict[str, Any], split: str = "train") -> None:
        """Record ``metrics`` for ``step`` in every sink; TensorBoard tags are ``split/name``."""
        if not self.enabled or self._closed:
            return
        step = int(step)
        self._guard_resume(step, inclusive=True)
        values = {str(k): _plain(v) for k, v in metrics.items()}
        self._append({"step": step, "split": split, "time": time.time(), **values})
        scalars = {f"{split}/{k}": s for k, v in values.items() if (s := _scalar(v)) is not None}
        if self.cfg.tensorboard and scalars:
            self._tb_scalars(scalars, step)
        if self._trackers:
            self._tracker_log(scalars, step)
        if self._prometheus is not None:
            self._prometheus.update(step, split, values)
        self._console(step, split, values)

    def log_histogram(self, step: int, tag: str, values: Any = None, *, counts: Any = None, edges: Any = None) -> None:
        """A TensorBoard histogram of raw ``values`` (tensor, array or list), or of a ready-made
        histogram given as ``counts`` (n bins) and ``edges`` (n + 1), e.g. from
        ``monitoring.diagnostics.gradient_histogram``. Other sinks ignore histograms."""
        if not self.enabled or self._closed or not self.cfg.tensorboard:
            return
        if counts is not None or edges is not None:
            self._raw_histogram(int(step), tag, counts, edges)
            return
        if hasattr(values, "detach"):
            values = values.detach().float().cpu()
        self._writer().add_histogram(tag, values, int(step))

    def _raw_histogram(self, step: int, tag: str, counts: Any, edges: Any) -> None:
        counts = [float(c) for c in _plain(counts)]
        edges = [float(e) for e in _plain(edges)]
        if len(edges) != len(counts) + 1:
            raise ValueError(
                f"log_histogram({tag!r}): {len(counts)} counts need {len(counts) + 1} edges, got {len(edges)}."
            )
        centers = [(a + b) / 2 for a, b in itertools.pairwise(edges)]
        self._writer().add_histogram_raw(
            tag,
            min=edges[0],
            max=edges[-1],
            num=sum(counts),
            sum=sum(c * x for c, x in zip(counts, centers, strict=True)),  # bin centres: exact data is gone
            sum_squares=sum(c * x * x for c, x in zip(counts, centers, strict=True)),
            bucket_limits=edges[1:],
            bucket_counts=counts,
            global_step=step,
        )

    def event(self, step: int, kind: str, message: str, **fields: Any) -> None:
        """A notable occurrence (NaN skip, spike, starvation, resume…) in metrics.jsonl and console."""
        if not self.enabled or self._closed:
            return
        step = int(step)
        self._guard_resume(step, inclusive=False)
        extra = {str(k): _plain(v) for k, v in fields.items() if k not in ("step", "event", "message")}
        self._append({"step": step, "event": kind, "message": message, "time": time.time(), **extra}, durable=True)
        if self._prometheus is not None:
            self._prometheus.event(kind)
        self._print(f"[step {step}] {kind}: {message}")

    def flush(self) -> None:
        if self.enabled and self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        """Flush and release every sink; safe to call twice."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
        for tracker in self._trackers:
            try:
                tracker.finish()
            except Exception as exc:
                log.warning("Tracker %s did not finish cleanly: %s", getattr(tracker, "name", tracker), exc)
        if self._prometheus is not None:
            self._prometheus.close()
        if self._fh is not None:
            self._fh.flush()
            _sync(self._fh.fileno())
            self._fh.close()

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 1}} -> {"optim.lr": 1}; lists become strings (tracker hparams are scalars)."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)) or value is None:
            out[name] = value
        else:
            out[name] = json.dumps(_plain(list(value) if isinstance(value, tuple) else value))
    return out
