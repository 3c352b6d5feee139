"""Static run reports: PNG plots and one HTML page, for one run or several overlaid.

Built only from files in the run dir (``metrics.jsonl``, ``config.yaml``), so it works on a run that
is still going or one that died: a torn last line is skipped and a step logged twice (an old
resume) counts once, the later line winning. matplotlib is used through its object API on the Agg
canvas so the caller's pyplot state/backend is never touched. Every file is written under a
temporary name and renamed.
"""

from __future__ import annotations

import datetime as _dt
import html
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.config import ConfigError, parse_command_line
from core.files import MARKER, OutsideError, atomic_write_text, claim_output_dir, inside, output_kind
from monitoring.logger import read_metrics_lines

__all__ = ["Run", "load_run", "render_report", "main"]

Series = list[tuple[int, float]]

_HIGHLIGHTS = [
    ("model", ("model", "name")),
    ("task", ("train", "task")),
    ("optimizer", ("optim", "name")),
    ("lr", ("optim", "lr")),
    ("warmup", ("schedule", "warmup")),
    ("warmup steps", ("schedule", "warmup_steps")),
    ("decay", ("schedule", "decay")),
    ("micro batch", ("data", "micro_batch_size")),
    ("grad accum", ("train", "grad_accum_steps")),
    ("precision", ("train", "precision")),
    ("max steps", ("train", "max_steps")),
    ("engine", ("distributed", "engine")),
    ("ZeRO stage", ("distributed", "zero_stage")),
]
_FINAL_TRAIN = ("loss", "tokens_per_s", "mfu", "step_time", "data_wait_share", "mem_peak_mb", "host_rss_mb")
_EVAL_PLOTTED = ("accuracy", "mlm_accuracy", "nsp_accuracy", "perplexity", "top1")


@dataclass
class Run:
    """One run dir's metrics, split by split and metric name, as sorted (step, value) series."""

    name: str
    path: Path
    config: dict[str, Any]
    series: dict[str, dict[str, Series]] = field(default_factory=dict)  # split -> metric -> series
    last: dict[str, dict[str, Any]] = field(default_factory=dict)  # split -> last record
    events: list[dict[str, Any]] = field(default_factory=list)
    first_time: float | None = None
    last_time: float | None = None

    def get(self, split: str, metric: str) -> Series:
        return self.series.get(split, {}).get(metric, [])


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    return None


def _read_config(run_dir: Path) -> dict[str, Any]:
    try:
        import yaml

        data = yaml.safe_load(inside(run_dir, "config.yaml", what="the run's config").read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except OutsideError:
        raise
    except Exception:  # missing or half-written config: the report still renders
        return {}


def load_run(run_dir: str | os.PathLike, name: str | None = None) -> Run:
    """Parse a run dir; tolerates a missing config, a torn last line and repeated steps."""
    path = Path(run_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"Run dir {path} does not exist.")
    if not (path / "metrics.jsonl").exists() and not (path / "config.yaml").exists() and output_kind(path) != "run":
        raise ConfigError(f"{path} is not a run directory: it has no metrics.jsonl, config.yaml or run marker ({MARKER}). "
                          f"Pass a run's train.run_dir (written by `pretrain train` or `pretrain finetune`) or a sweep directory.")
    run = Run(name=name or path.resolve().name, path=path, config=_read_config(path))
    latest: dict[tuple[str, int], dict[str, Any]] = {}
    for rec in read_metrics_lines(inside(path, "metrics.jsonl", what="the run's metrics")):
        step = rec.get("step")
        if not isinstance(step, int):
            continue
        t = _number(rec.get("time"))
        if t is not None and math.isfinite(t):
            run.first_time = t if run.first_time is None else min(run.first_time, t)
            run.last_time = t if run.last_time is None else max(run.last_time, t)
        if "event" in rec:
            run.events.append(rec)
        elif isinstance(rec.get("split"), str):
            latest[(rec["split"], step)] = rec  # a re-logged step: the later line wins
    for (split, step), rec in sorted(latest.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        run.last[split] = rec
        for key, value in rec.items():
            num = _number(value)
            if key in ("step", "time") or num is None:
                continue
            run.series.setdefault(split, {}).setdefault(key, []).append((step, num))
    run.events.sort(key=lambda e: e["step"])
    return run


# ------------------------------------------------------------------------------------- plotting
def save_figure(fig: Any, out_dir: Path, filename: str) -> str:
    """Save ``fig`` as PNG under ``out_dir`` atomically (temp file + rename); returns the file name."""
    fd, tmp = tempfile.mkstemp(prefix=f".{filename}.", suffix=".tmp", dir=out_dir)
    os.close(fd)
    try:
        fig.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, out_dir / filename)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return filename


def _figure(title: str, rows: int = 1) -> tuple[Any, list[Any]]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3.2 * rows), layout="constrained")
    axes = [fig.add_subplot(rows, 1, i + 1) for i in range(rows)]
    axes[0].set_title(title)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    return fig, axes


def _plot_lines(
    ax: Any, runs: list[Run], colors: list[str], curves: list[tuple[str, str, str]], scale: float = 1.0
) -> int:
    """Draw (split, metric, label-suffix) curves for every run; returns how many were drawn."""
    drawn = 0
    for run, color in zip(runs, colors, strict=True):
        for i, (split, metric, suffix) in enumerate(curves):
            data = [(s, v * scale) for s, v in run.get(split, metric) if math.isfinite(v)]
            if not data:
                continue
            xs, ys = zip(*data, strict=True)
            style = ("-", "--", ":", "-.")[i % 4]
            marker = "o" if split != "train" or len(data) < 3 else None
            label = f"{run.name} {suffix}".strip() if len(runs) > 1 else suffix or run.name
            ax.plot(xs, ys, style, color=color, marker=marker, markersize=3, linewidth=1.2, label=label)
            drawn += 1
    if drawn:
        ax.legend(fontsize=8, loc="best")
    return drawn


_EVENT_COLORS = {
    "nan_skip": "tab:red",
    "nan_stop": "darkred",
    "loss_spike": "tab:orange",
    "data_starvation": "tab:purple",
}


def _render_plots(runs: list[Run], out_dir: Path) -> list[tuple[str, str]]:
    """Write every plot that has data; returns (filename, caption) pairs in page order."""
    from matplotlib import colormaps

    palette = colormaps["tab10"].colors
    colors = [palette[i % len(palette)] for i in range(len(runs))]
    images: list[tuple[str, str]] = []

    def simple(
        filename: str,
        title: str,
        ylabel: str,
        curves: list[tuple[str, str, str]],
        *,
        scale: float = 1.0,
        logy: bool = False,
        events: bool = False,
    ) -> None:
        fig, (ax,) = _figure(title)
        if _plot_lines(ax, runs, colors, curves, scale) == 0:
            return
        ax.set_ylabel(ylabel)
        if logy:
            ax.set_yscale("log")
        if events:
            for run in runs:
                for ev in run.events:
                    ax.axvline(ev["step"], color=_EVENT_COLORS.get(ev["event"], "grey"), alpha=0.4, linewidth=0.8)
        images.append((save_figure(fig, out_dir, filename), title))

    simple(
        "loss.png",
        "Loss (solid: train, dashed: eval; vertical lines: events)",
        "loss",
        [("train", "loss", "train"), ("eval", "loss", "eval")],
        events=True,
    )
    simple("lr.png", "Learning rate", "lr", [("train", "lr", "")])
    simple("tokens_per_s.png", "Throughput (global tokens/s)", "tokens/s", [("train", "tokens_per_s", "")])
    simple("mfu.png", "Model FLOPs utilization", "MFU (%)", [("train", "mfu", "")], scale=100.0)
    simple(
        "memory.png",
        "Memory (MiB)",
        "MiB",
        [
            ("train", "mem_allocated_mb", "allocated"),
            ("train", "mem_peak_mb", "peak"),
            ("train", "host_rss_mb", "host RSS"),
        ],
    )
    simple("grad_norm.png", "Gradient norm (before clipping)", "norm", [("train", "grad_norm", "")], logy=True)

    eval_metrics = [m for m in _EVAL_PLOTTED if any(run.get("eval", m) for run in runs)]
    if eval_metrics:
        fig, axes = _figure("Evaluation metrics", rows=len(eval_metrics))
        for ax, metric in zip(axes, eval_metrics, strict=True):
            _plot_lines(ax, runs, colors, [("eval", metric, "")])
            ax.set_ylabel(metric)
        images.append((save_figure(fig, out_dir, "eval.png"), "Evaluation metrics"))

    if any(run.events for run in runs):
        fig, (ax,) = _figure("Events")
        kinds = sorted({ev["event"] for run in runs for ev in run.events})
        for offset, (run, color) in enumerate(zip(runs, colors, strict=True)):
            if run.events:
                ys = [kinds.index(ev["event"]) + 0.1 * offset for ev in run.events]
                ax.scatter([ev["step"] for ev in run.events], ys, color=color, s=18, label=run.name)
        ax.set_yticks(range(len(kinds)), kinds)
        ax.set_ylim(-0.5, len(kinds) - 0.5)
        ax.legend(fontsize=8, loc="best")
        images.append((save_figure(fig, out_dir, "events.png"), "Events"))
    return images


# ----------------------------------------------------------------------------------------- HTML
def _dig(config: dict[str, Any], keys: tuple[str, ...]) -> Any:
    node: Any = config
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    s = int(seconds)
    return f"{s // 3600}h {s % 3600 // 60:02d}m {s % 60:02d}s"


def _summary_rows(run: Run) -> list[tuple[str, str]]:
    rows = [(label, _fmt(_dig(run.config, keys))) for label, keys in _HIGHLIGHTS if _dig(run.config, keys) is not None]
    train_last = run.last.get("train", {})
    tokens = train_last.get("tokens")
    rows += [
        ("steps logged", _fmt(train_last.get("step"))),
        ("tokens", _fmt(tokens) if tokens is not None else "—"),
        ("wall time", _duration(run.last_time - run.first_time if run.first_time is not None else None)),
        (
            "last update",
            _dt.datetime.fromtimestamp(run.last_time).strftime("%Y-%m-%d %H:%M:%S")
            if run.last_time is not None
            else "—",
        ),
    ]
    for split in sorted(run.last):
        for key, value in run.last[split].items():
            if split == "train" and key not in _FINAL_TRAIN:
                continue
            if key not in ("step", "time", "split", "tokens") and _number(value) is not None:
                shown = f"{_number(value):.2%}" if key == "mfu" else _fmt(_number(value))
                rows.append((f"final {split} {key}", shown))
    counts: dict[str, int] = {}
    for ev in run.events:
        counts[ev["event"]] = counts.get(ev["event"], 0) + 1
    rows.append(("events", ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "none"))
    return rows


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
figure { margin: 1.5em 0; } img { max-width: 100%; border: 1px solid #eee; }
.muted { color: #777; font-size: 0.85em; }
"""


def _html(runs: list[Run], images: list[tuple[str, str]]) -> str:
    esc = html.escape
    per_run = [dict(_summary_rows(run)) for run in runs]
    labels = list(dict.fromkeys(label for rows in per_run for label in rows))
    head = "".join(f"<th>{esc(run.name)}</th>" for run in runs)
    body = "".join(
        f"<tr><th>{esc(label)}</th>" + "".join(f"<td>{esc(rows.get(label, '—'))}</td>" for rows in per_run) + "</tr>"
        for label in labels
    )
    figures = (
        "".join(
            f'<figure><img src="{esc(name)}" alt="{esc(caption)}"><figcaption>{esc(caption)}</figcaption></figure>'
            for name, caption in images
        )
        or "<p>No metrics logged yet.</p>"
    )
    event_rows = [(run.name, ev) for run in runs for ev in run.events][:500]
    events = ""
    if event_rows:
        events = (
            "<h2>Events</h2><table><tr><th>run</th><th>step</th><th>kind</th><th>message</th></tr>"
            + "".join(
                f"<tr><td>{esc(name)}</td><td>{ev['step']}</td><td>{esc(str(ev['event']))}</td>"
                f"<td>{esc(str(ev.get('message', '')))}</td></tr>"
                for name, ev in event_rows
            )
            + "</table>"
        )
    paths = "<br>".join(esc(str(run.path.resolve())) for run in runs)
    now = _dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>pretrain report: {esc(', '.join(r.name for r in runs))}</title><style>{_CSS}</style></head><body>"
        f'<h1>Training report</h1><p class="muted">Generated {now} from<br>{paths}</p>'
        f"<h2>Summary</h2><table><tr><th></th>{head}</tr>{body}</table>"
        f"<h2>Plots</h2>{figures}{events}</body></html>\n"
    )


def _unique_names(run_dirs: list[Path]) -> list[str]:
    names = [p.resolve().name for p in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [f"{p.resolve().parent.name}/{p.resolve().name}" for p in run_dirs]


def render_report(run_dirs: list[str | os.PathLike], out_dir: str | os.PathLike | None = None) -> Path:
    """Write PNG plots and ``report.html`` for the runs into ``out_dir``; returns the HTML path.

    ``out_dir`` defaults to ``<first run dir>/report``. Several run dirs are overlaid in every plot
    and get one column each in the summary table.
    """
    paths = [Path(p) for p in run_dirs]
    if not paths:
        raise ValueError("render_report needs at least one run dir.")
    runs = [load_run(p, name) for p, name in zip(paths, _unique_names(paths), strict=True)]
    out = claim_output_dir(Path(out_dir) if out_dir is not None else paths[0] / "report", "report",
                           what="Report directory (--out)")  # a user's folder is refused, never overwritten
    images = _render_plots(runs, out)
    target = out / "report.html"
    atomic_write_text(target, _html(runs, images))
    return target


def main(argv: list[str] | None = None) -> int:
    """``python -m monitoring.report RUN_DIR [RUN_DIR ...] [--out DIR]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m monitoring.report", description=main.__doc__)
    parser.add_argument("run_dirs", nargs="+")
    parser.add_argument("--out", default=None, help="Output dir (default: FIRST_RUN_DIR/report).")
    args = parse_command_line(parser, argv)
    try:
        path = render_report(args.run_dirs, args.out)
    except (FileNotFoundError, ConfigError) as exc:
        print(exc, file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
