"""The built-in sinks: console, TensorBoard, W&B and MLflow (Prometheus: ``monitoring.prometheus``;
``metrics.jsonl``: ``monitoring.logger``). Each is one ``Sink`` class and one registration."""

from __future__ import annotations

import importlib.util
import itertools
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from core.files import atomic_write_text
from monitoring.sink import Sink, SinkContext, register_sink

__all__ = ["ConsoleSink", "TensorBoardSink", "TrackerSink", "WANDB_ID_FILE", "plain", "flatten"]

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


def plain(value: Any) -> Any:
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
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return str(value)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 1}} -> {"optim.lr": 1}; lists become strings (tracker hparams are scalars)."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)) or value is None:
            out[name] = value
        else:
            out[name] = json.dumps(plain(list(value) if isinstance(value, tuple) else value))
    return out


def _fmt_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}"


# ------------------------------------------------------------------------------------ console
class ConsoleSink(Sink):
    """A rich progress bar on a terminal (``logging.progress``), else one compact line per log; events
    always print."""

    def __init__(self, ctx: SinkContext) -> None:
        self.total_steps, self.unit = ctx.total_steps, ctx.throughput_unit
        self.progress = None
        self._task = None
        self._eta_origin: tuple[int, float] | None = None
        if bool(ctx.cfg.progress) and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("eta"),
                                     TimeRemainingColumn(), TextColumn("{task.fields[info]}"), refresh_per_second=2)
            self._task = self.progress.add_task("train", total=self.total_steps, info="")
            self.progress.start()

    def _print(self, text: str) -> None:
        if self.progress is not None:
            self.progress.console.print(text, markup=False, highlight=False)
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

    def log(self, step: int, split: str, values: dict[str, Any], scalars: dict[str, float]) -> None:
        if split == "train":
            parts = [
                f"{f'{self.unit}/s' if k == 'tokens_per_s' else label} {fmt.format(values[k])}"
                for k, label, fmt in _TRAIN_KEYS
                if isinstance(values.get(k), (int, float)) and not isinstance(values.get(k), bool)
            ]
        else:
            parts = [f"{k} {v:.4g}" for k, v in values.items() if isinstance(v, float)]
        info = "  ".join(parts)
        if self.progress is not None and split == "train":
            self.progress.update(self._task, completed=min(step, self.total_steps), info=info)
            return
        eta = self._eta(step) if split == "train" else None
        pct = f" {step / self.total_steps:.0%}" if self.total_steps > 0 else ""
        tail = f"  eta {eta}" if eta else ""
        self._print(f"[step {step}/{self.total_steps}{pct}] {split}  {info}{tail}")

    def event(self, step: int, kind: str, message: str, fields: dict[str, Any]) -> None:
        self._print(f"[step {step}] {kind}: {message}")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


register_sink("console", enabled=lambda cfg: True, order=100)(ConsoleSink)


# -------------------------------------------------------------------------------- TensorBoard
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


class TensorBoardSink(Sink):
    """Event files under ``run_dir/tb``; the writer opens on first use, so a resume's purge step is
    known by then (a purge reopens it: the new file's first record hides the stale steps)."""

    def __init__(self, ctx: SinkContext) -> None:
        self.tb_dir, self.config_dict = ctx.run_dir / "tb", ctx.config_dict
        self.writer_: Any = None
        self._purge_step: int | None = None
        self._closed = False

    def _writer(self) -> Any:
        if self.writer_ is None and not self._closed:
            from torch.utils.tensorboard import SummaryWriter

            _wait_for_later_second(self.tb_dir)
            self.writer_ = SummaryWriter(log_dir=str(self.tb_dir), purge_step=self._purge_step, flush_secs=30)
            if self.config_dict:
                text = json.dumps(plain(self.config_dict), indent=2)
                self.writer_.add_text("config", "```\n" + text + "\n```", 0)
        return self.writer_

    def log(self, step: int, split: str, values: dict[str, Any], scalars: dict[str, float]) -> None:
        """All of a step's scalars as one event record: one queue hand-off instead of one per tag."""
        if not scalars:
            return
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

    def histogram(self, step: int, tag: str, *, values: Any = None, counts: list[float] | None = None,
                  edges: list[float] | None = None) -> None:
        if counts is None and edges is None:
            if hasattr(values, "detach"):
                values = values.detach().float().cpu()
            self._writer().add_histogram(tag, values, step)
            return
        counts, edges = [float(c) for c in plain(counts)], [float(e) for e in plain(edges)]
        if len(edges) != len(counts) + 1:
            raise ValueError(f"log_histogram({tag!r}): {len(counts)} counts need {len(counts) + 1} edges, got {len(edges)}.")
        centers = [(a + b) / 2 for a, b in itertools.pairwise(edges)]
        self._writer().add_histogram_raw(
            tag, min=edges[0], max=edges[-1], num=sum(counts),
            sum=sum(c * x for c, x in zip(counts, centers, strict=True)),  # bin centres: exact data is gone
            sum_squares=sum(c * x * x for c, x in zip(counts, centers, strict=True)),
            bucket_limits=edges[1:], bucket_counts=counts, global_step=step,
        )

    def purge(self, first_stale_step: int) -> None:
        self._purge_step = first_stale_step
        if self.writer_ is not None:
            self.writer_.close()
            self.writer_ = None

    def flush(self) -> None:
        if self.writer_ is not None:
            self.writer_.flush()

    def close(self) -> None:
        self._closed = True
        if self.writer_ is not None:
            self.writer_.flush()
            self.writer_.close()


register_sink("tensorboard", enabled=lambda cfg: bool(cfg.tensorboard))(TensorBoardSink)


# ------------------------------------------------------------------------------ W&B / MLflow
class TrackerSink(Sink):
    """An accelerate tracker (W&B, MLflow); a failure disables it, never the training."""

    def __init__(self, name: str, tracker: Any, config_dict: dict[str, Any]) -> None:
        self.name, self.tracker = name, tracker
        tracker.start()
        if flat := flatten(config_dict):
            tracker.store_init_configuration(flat)

    @classmethod
    def start(cls, name: str, ctx: SinkContext, make: Any) -> TrackerSink | None:
        if importlib.util.find_spec(name) is None:
            log.warning("logging.%s is on but the %s package is not installed; skipping it.", name, name)
            return None
        try:
            return cls(name, make(ctx), ctx.config_dict)
        except Exception as exc:  # an external service must never stop training
            log.warning("Could not start the %s tracker (%s); continuing without it.", name, exc)
            return None

    def log(self, step: int, split: str, values: dict[str, Any], scalars: dict[str, float]) -> None:
        if self.tracker is None or not scalars:
            return
        try:
            self.tracker.log(scalars, step=step)
        except Exception as exc:
            log.warning("Tracker %s failed (%s); disabling it.", self.name, exc)
            self.tracker = None

    def close(self) -> None:
        if self.tracker is None:
            return
        try:
            self.tracker.finish()
        except Exception as exc:
            log.warning("Tracker %s did not finish cleanly: %s", self.name, exc)


def wandb_run_id(run_dir: Path) -> str:
    """The W&B run id of this run dir: made once and kept in ``RUN_DIR/wandb_run_id``.

    A requeued or resumed job reads it back and continues the same W&B run (``resume="allow"``)
    instead of starting a new one per SLURM requeue.
    """
    path = run_dir / WANDB_ID_FILE
    if path.is_file() and (run_id := path.read_text(encoding="utf-8").strip()):
        return run_id
    import uuid

    run_id = uuid.uuid4().hex[:16]
    atomic_write_text(path, run_id + "\n")
    return run_id


def _make_wandb(ctx: SinkContext) -> Any:
    from accelerate.tracking import WandBTracker

    return WandBTracker(os.environ.get("WANDB_PROJECT", "pretrain"), name=ctx.run_dir.name, dir=str(ctx.run_dir),
                        mode=os.environ.get("WANDB_MODE", "offline"), id=wandb_run_id(ctx.run_dir), resume="allow")


def _make_mlflow(ctx: SinkContext) -> Any:
    import mlflow
    from accelerate.tracking import MLflowTracker

    if not os.environ.get("MLFLOW_TRACKING_URI"):  # offline: a file store inside the run dir
        mlflow.set_tracking_uri((ctx.run_dir / "mlruns").resolve().as_uri())
    return MLflowTracker(experiment_name="pretrain", run_name=ctx.run_dir.name)


register_sink("wandb", enabled=lambda cfg: bool(cfg.wandb))(lambda ctx: TrackerSink.start("wandb", ctx, _make_wandb))
register_sink("mlflow", enabled=lambda cfg: bool(cfg.mlflow))(lambda ctx: TrackerSink.start("mlflow", ctx, _make_mlflow))
