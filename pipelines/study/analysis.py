"""The optimizer x warmup study report: PNG figures, a table and one static HTML page for a sweep dir.

``render_study(SWEEP_DIR, OUT)`` reads what ``pipelines.study.sweep`` wrote (``sweep.json``, ``sweep.jsonl``,
``runs/NAME/{config.yaml,metrics.jsonl,done}``) and groups runs into *arms* (the run name without its
``-sSEED`` suffix); curves of several seeds are drawn as mean +- one standard deviation. Figures:

- ``lr.png``: the learning rate of every arm's schedule over the run, computed from its config with
  ``pipelines.engine.check.run_schedule`` -- the trainer's own call -- (Vaswani et al. 2017 eq. 3 for noam), and RAdam's effective
  rate lr r_t (``radam_rectification``; 0 while rho_t <= 5), as in Liu et al. 2020 (arXiv:1908.03265),
  Fig. 3 / the seed thesis' Fig. 3.15; logged ``diag`` learning rates are overlaid as dots.
- ``loss.png``: training and validation loss.
- ``histograms.png``: log10|g| and log10|delta w| early in training, with and without warmup
  (Liu et al. 2020 Fig. 2; the seed thesis' Fig. 3.16), from ``monitoring.diagnostics.log_diagnostics``.
- ``adam_variance.png``: Var[1 / (sqrt(v^) + eps)] of the adaptive step size over steps -- large
  early, which is what warmup (Ma & Yarats 2019, arXiv:1910.04209) and RAdam's rectification tame.

The table (also ``study_table.md`` and ``study_summary.json``), over each arm's finished runs (ok or diverged;
runs still going, interrupted or failed are drawn but not counted): final train loss (mean of the last
3 logged values), best validation loss, steps until the smoothed train loss first reaches the target
(``target_loss`` of the sweep, else the median over arms of the final train loss),
divergence events (runs stopped on NaN/Inf + nan_skip/loss_spike events) and wall time per run.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.files import atomic_write_text, claim_output_dir, inside
from monitoring.logger import read_metrics_lines
from monitoring.report import Run, load_run, save_figure
from pipelines.study.study_page import markdown_table, study_html

__all__ = ["StudyRun", "load_study", "render_study", "is_sweep_dir", "arm_of"]

FIGURES = ("lr.png", "loss.png", "histograms.png", "adam_variance.png")
_SEED = re.compile(r"^(?P<arm>.+)-s(?P<seed>\d+)$")
_GRID_NAME = re.compile(r"^(?P<optimizer>[^-]+)-(?P<warmup>[^-]+)-lr[0-9.]+e-?\d+(?P<axes>(-[^-]+)*)$")  # sweep.expand's
_DIVERGENCE_EVENTS = ("nan_skip", "nan_stop", "loss_spike")
FINISHED = ("ok", "diverged")  # a run's final statuses (pipelines.study.attempts.FINAL_STATUSES)


def arm_of(name: str) -> tuple[str, int | None]:
    """``adam-none-lr1e-3-s2`` -> (``adam-none-lr1e-3``, 2); a name without a seed suffix is its own arm."""
    m = _SEED.match(name)
    return (m["arm"], int(m["seed"])) if m else (name, None)


@dataclass
class StudyRun:
    """One run of the sweep: its metrics (``report.Run``), diagnostics records and sweep status."""

    name: str
    arm: str
    seed: int | None
    run: Run
    diag: list[dict[str, Any]] = field(default_factory=list)  # split == "diag" records, histograms included
    status: dict[str, Any] = field(default_factory=dict)  # the last sweep.jsonl record / done marker
    labels: dict[str, str] = field(default_factory=dict)  # grid labels: optimizer, warmup, one per axis (grid_labels)

    @property
    def config(self) -> dict[str, Any]:
        return self.run.config


def grid_labels(entry: dict[str, Any], name: str, axes: list[str]) -> dict[str, str]:
    """A run's grid labels -- ``optimizer``, ``warmup`` and one per sweep axis -- from its ``sweep.json`` entry;
    an entry without them gives them back from the run name (``adam-lin10-lr1e-3-post-L6-s0``: the same labels
    joined by '-', which no label contains). {} when neither has them."""
    keys = ["optimizer", "warmup", *axes]
    if all(entry.get(k) is not None for k in keys):
        return {k: str(entry[k]) for k in keys}
    m = _GRID_NAME.match(arm_of(name)[0])
    parts = [m["optimizer"], m["warmup"], *m["axes"].split("-")[1:]] if m else []
    return dict(zip(keys, parts, strict=True)) if len(parts) == len(keys) else {}


def is_sweep_dir(path: str | os.PathLike) -> bool:
    """A directory ``pipelines.study.sweep`` wrote (``sweep.json``, or ``runs/*/metrics.jsonl`` without its own metrics)."""
    p = Path(path)
    if (p / "sweep.json").is_file():
        return True
    return p.is_dir() and not (p / "metrics.jsonl").exists() and any(p.glob("runs/*/metrics.jsonl"))


def load_study(sweep_dir: str | os.PathLike) -> tuple[dict[str, Any], list[StudyRun]]:
    """(``sweep.json`` contents or {}, the runs that have a metrics.jsonl), in grid order."""
    root = Path(sweep_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"Sweep dir {root} does not exist.")
    try:
        manifest = json.loads((root / "sweep.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        manifest = {}
    entries = {r["name"]: r for r in manifest.get("runs", []) if isinstance(r, dict) and "name" in r}
    names = list(entries) or sorted(p.parent.name for p in root.glob("runs/*/metrics.jsonl"))
    axes = list((manifest.get("config") or {}).get("axes") or {})
    statuses: dict[str, dict[str, Any]] = {}
    for rec in read_metrics_lines(root / "sweep.jsonl"):
        if isinstance(rec.get("name"), str):
            statuses[rec["name"]] = rec  # the latest attempt wins
    runs = []
    for name in names:
        run_dir = inside(root, Path("runs") / str(name), what="a run of the sweep")  # sweep.json names no outside dir
        if not (run_dir / "metrics.jsonl").is_file():
            continue
        status = statuses.get(name, {})
        try:
            status = json.loads((run_dir / "done").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            pass
        arm, seed = arm_of(name)
        diag = [r for r in read_metrics_lines(run_dir / "metrics.jsonl") if r.get("split") == "diag"]
        labels = grid_labels(entries.get(name, {}), name, axes)
        runs.append(StudyRun(name, arm, seed, load_run(run_dir, name), diag, status, labels))
    return manifest, runs


# ---------------------------------------------------------------------------------- numbers
def _finite(values: list[float]) -> list[float]:
    return [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    vals = _finite(values)
    if not vals:
        return None, None
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def _smoothed(series: list[tuple[int, float]], window: int = 3) -> list[tuple[int, float]]:
    """Trailing mean over ``window`` logged points (the per-batch train loss is noisy)."""
    out = []
    for i, (step, _) in enumerate(series):
        chunk = _finite([v for _, v in series[max(0, i - window + 1) : i + 1]])
        if chunk:
            out.append((step, statistics.fmean(chunk)))
    return out


def _diverged(r: StudyRun) -> bool:
    if r.status.get("status") == "diverged" or any(e.get("event") == "nan_stop" for e in r.run.events):
        return True
    losses = [v for _, v in r.run.get("train", "loss")]
    return bool(losses) and not math.isfinite(losses[-1])


def _run_numbers(r: StudyRun, target: float | None) -> dict[str, Any]:
    train = r.run.get("train", "loss")
    tail = _finite([v for _, v in train[-3:]])
    final = statistics.fmean(tail) if tail and not _diverged(r) else None
    best_val = min(_finite([v for _, v in r.run.get("eval", "loss")]), default=None)
    reached = None
    if target is not None:
        reached = next((s for s, v in _smoothed(train) if v <= target), None)
    wall = r.status.get("wall_time_s")
    if wall is None and r.run.first_time is not None:
        wall = r.run.last_time - r.run.first_time
    events = sum(1 for e in r.run.events if e.get("event") in _DIVERGENCE_EVENTS)
    return {
        "name": r.name,
        "arm": r.arm,
        "seed": r.seed,
        "status": r.status.get("status", "?"),
        "final_loss": final,
        "best_val_loss": best_val,
        "steps_to_target": reached,
        "divergence_events": events,
        "diverged": _diverged(r),
        "wall_time_s": wall,
        "steps": train[-1][0] if train else 0,
    }


def _arms(runs: list[StudyRun]) -> dict[str, list[StudyRun]]:
    arms: dict[str, list[StudyRun]] = {}
    for r in runs:
        arms.setdefault(r.arm, []).append(r)
    return arms


def _finished(r: StudyRun) -> bool:
    return r.status.get("status") in FINISHED


def summarize(runs: list[StudyRun], target_loss: float | None = None) -> dict[str, Any]:
    """Per-run and per-arm numbers; ``target_loss`` None/0 = the median over arms of the mean final train loss.

    The arms' numbers count finished runs only (ok or diverged; ``unfinished`` names the others: running,
    interrupted or failed, whose last loss is from the middle of their run) -- all runs when none has finished
    (a directory without the sweep's records)."""
    counted = [r for r in runs if _finished(r)] or runs
    unfinished = [r.name for r in runs if r not in counted]
    arms = _arms(runs)
    if not target_loss:
        finals = [_mean_std([_run_numbers(r, None)["final_loss"] for r in rs if r in counted])[0] for rs in arms.values()]
        finals = _finite([f for f in finals if f is not None])
        target_loss = statistics.median(finals) if finals else None
    per_run = [_run_numbers(r, target_loss) for r in runs]
    per_arm = []
    for arm in arms:
        rows = [p for p in per_run if p["arm"] == arm and p["name"] not in unfinished]
        reached = [p["steps_to_target"] for p in rows if p["steps_to_target"] is not None]
        final_m, final_s = _mean_std([p["final_loss"] for p in rows if p["final_loss"] is not None])
        val_m, val_s = _mean_std([p["best_val_loss"] for p in rows if p["best_val_loss"] is not None])
        per_arm.append(
            {
                "arm": arm,
                "runs": len(rows),
                "unfinished": sum(p["arm"] == arm for p in per_run) - len(rows),
                "ok": sum(p["status"] == "ok" for p in rows),
                "diverged": sum(p["diverged"] for p in rows),
                "final_loss": final_m,
                "final_loss_std": final_s,
                "best_val_loss": val_m,
                "best_val_loss_std": val_s,
                "steps_to_target": statistics.fmean(reached) if reached else None,
                "reached_target": len(reached),
                "divergence_events": sum(p["divergence_events"] for p in rows) + sum(p["diverged"] for p in rows),
                "wall_time_s": _mean_std([p["wall_time_s"] for p in rows if p["wall_time_s"] is not None])[0],
            }
        )
    return {"target_loss": target_loss, "arms": per_arm, "runs": per_run, "unfinished": unfinished}


# --------------------------------------------------------------------------------- figures
def _colors(arms: list[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    palette = colormaps["tab10"].colors
    return {arm: palette[i % len(palette)] for i, arm in enumerate(arms)}


def _band(ax: Any, rs: list[StudyRun], getter: Any, color: Any, label: str, logy: bool = False) -> bool:
    """Mean +- std over seeds at the steps every seed logged (steps after a divergence drop out)."""
    by_step: dict[int, list[float]] = {}
    for r in rs:
        for step, value in getter(r):
            if math.isfinite(value) and (value > 0 or not logy):
                by_step.setdefault(step, []).append(value)
    steps = sorted(by_step)
    if not steps:
        return False
    mean = [statistics.fmean(by_step[s]) for s in steps]
    std = [statistics.stdev(by_step[s]) if len(by_step[s]) > 1 else 0.0 for s in steps]
    lo = [max(m - d, m * 1e-3) if logy else m - d for m, d in zip(mean, std, strict=True)]
    few = len(steps) < 3  # e.g. one validation at the end of each run: a line of one point draws nothing
    ax.plot(steps, mean, color=color, linewidth=1.4, marker="o" if few else None, label=f"{label} (n={len(rs)})")
    if few:
        ax.errorbar(steps, mean, yerr=std, fmt="none", color=color, capsize=3)
    else:
        ax.fill_between(steps, lo, [m + d for m, d in zip(mean, std, strict=True)], color=color, alpha=0.18, linewidth=0)
    return True


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=9, color="grey", wrap=True)


def _schedule_curve(cfg: dict[str, Any]) -> tuple[list[int], list[float], list[float] | None]:
    """(t, lr_t, lr_t r_t or None) for t = 1..max_steps from a resolved run config.

    Drawn through ``check.run_schedule``, the call the trainer makes: the run's LR, steps, beta2
    and model width (``model.overrides.hidden_size`` or the registered size's), so a noam curve is
    the one that was trained.
    """
    from core.config import from_dict
    from core.optim_math import radam_rectification
    from pipelines.engine.check import run_schedule
    from pipelines.engine.config import RunConfig
    from pipelines.engine.registries import OPTIMIZERS

    run = from_dict(RunConfig, cfg, source="run config.yaml")
    sched = run_schedule(run)
    base, beta2, total = run.optim.lr, run.optim.betas[1], run.train.max_steps
    ts = list(range(1, total + 1))
    lrs = [base * sched(t - 1) for t in ts]
    eff = None
    if OPTIMIZERS.lookup(run.optim.name).has_rectification:
        eff = [lr * (radam_rectification(t, beta2)[1] or 0.0) for t, lr in zip(ts, lrs, strict=True)]
    return ts, lrs, eff


def _fig_lr(arms: dict[str, list[StudyRun]], colors: dict[str, Any], out: Path) -> str:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3.6), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title("Learning rate of every schedule (dashed: RAdam's effective lr·r_t; dots: logged)")
    for arm, rs in arms.items():
        try:
            ts, lrs, eff = _schedule_curve(rs[0].config)
        except Exception as exc:  # noqa: BLE001 - a config we cannot rebuild: say so, draw the rest
            _empty(ax, f"{arm}: cannot rebuild the schedule ({exc})")
            continue
        ax.plot(ts, lrs, color=colors[arm], linewidth=1.3, label=arm)
        if eff is not None:
            ax.plot(ts, eff, "--", color=colors[arm], linewidth=1.3, label=f"{arm} lr·r_t")
        logged = [(d["step"], d["lr"]) for d in rs[0].diag if isinstance(d.get("lr"), (int, float))]
        if logged:
            ax.plot(*zip(*logged, strict=True), ".", color=colors[arm], markersize=3)
    ax.set_xlabel("update t")
    ax.set_ylabel("learning rate")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return save_figure(fig, out, "lr.png")


def _fig_loss(arms: dict[str, list[StudyRun]], colors: dict[str, Any], out: Path) -> str:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 6.4), layout="constrained")
    for i, (split, title) in enumerate((("train", "Training loss"), ("eval", "Validation loss"))):
        ax = fig.add_subplot(2, 1, i + 1)
        ax.set_title(f"{title} (mean ± std over seeds)")
        drawn = [_band(ax, rs, lambda r, s=split: r.run.get(s, "loss"), colors[arm], arm) for arm, rs in arms.items()]
        if any(drawn):
            ax.legend(fontsize=7)
        else:
            _empty(ax, f"no {split} loss logged")
        ax.set_ylabel("loss")
        ax.grid(True, alpha=0.3)
    ax.set_xlabel("step")
    return save_figure(fig, out, "loss.png")


def _hist_steps(arms: dict[str, list[StudyRun]], total: int, k: int = 4) -> list[int]:
    """Up to ``k`` early diagnostics steps that every arm's first run logged a histogram at."""
    common: set[int] | None = None
    for rs in arms.values():
        steps = {d["step"] for d in rs[0].diag if "grad_log10_counts" in d}
        common = steps if common is None else common & steps
    steps = sorted(common or ())
    early = [s for s in steps if s <= max(1, total // 4)] or steps
    if len(early) <= k:
        return early
    return sorted({early[round(i * (len(early) - 1) / (k - 1))] for i in range(k)})


def _fig_histograms(arms: dict[str, list[StudyRun]], colors: dict[str, Any], out: Path, total: int) -> str:
    from matplotlib.figure import Figure

    steps = _hist_steps(arms, total)
    cols = max(1, len(steps))
    fig = Figure(figsize=(3.0 * cols + 1, 5.6), layout="constrained")
    fig.suptitle(
        "Early histograms of log10|gradient| (top) and log10|update Δw| (bottom), seed of each arm's first run"
    )
    for row, key in enumerate(("grad", "update")):
        for col in range(cols):
            ax = fig.add_subplot(2, cols, row * cols + col + 1)
            ax.grid(True, alpha=0.3)
            if not steps:
                _empty(ax, "no histograms logged:\nset logging.diagnostics_every > 0")
                continue
            step = steps[col]
            for arm, rs in arms.items():
                rec = next((d for d in rs[0].diag if d["step"] == step and f"{key}_log10_counts" in d), None)
                if rec is None:
                    continue
                counts, edges = rec[f"{key}_log10_counts"], rec[f"{key}_log10_edges"]
                total_n = sum(counts) or 1.0
                centers = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:], strict=True)]
                width = (edges[-1] - edges[0]) / max(1, len(counts))
                ax.plot(centers, [c / total_n / width for c in counts], color=colors[arm], linewidth=1.1, label=arm)
            ax.set_title(f"{key} · step {step}", fontsize=9)
            if row == 1:
                ax.set_xlabel("log10 |value|")
            if col == 0:
                ax.set_ylabel("density")
    if steps:
        fig.axes[0].legend(fontsize=6)
    return save_figure(fig, out, "histograms.png")


def _fig_variance(arms: dict[str, list[StudyRun]], colors: dict[str, Any], out: Path) -> str:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 6.4), layout="constrained")
    panels = (("adam/step_size_var", "all weights"), ("adam/step_size_var_blocks", "transformer blocks only"))
    for i, (key, where) in enumerate(panels):
        ax = fig.add_subplot(2, 1, i + 1)
        ax.set_title(f"Variance of Adam's adaptive step size 1/(√v̂+ε), {where} (mean ± std over seeds)", fontsize=10)

        def getter(r: StudyRun, key: str = key) -> list[tuple[int, float]]:
            return [(d["step"], d[key]) for d in r.diag if isinstance(d.get(key), (int, float))]

        if any([_band(ax, rs, getter, colors[arm], arm, logy=True) for arm, rs in arms.items()]):
            ax.set_yscale("log")
            ax.legend(fontsize=7)
        else:
            _empty(ax, "no optimizer diagnostics logged: set logging.diagnostics_every > 0")
        ax.set_ylabel("Var[1/(√v̂+ε)]")
        ax.grid(True, alpha=0.3)
    ax.set_xlabel("step (statistics of the optimizer state before this update)")
    return save_figure(fig, out, "adam_variance.png")


def render_study(
    sweep_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None, target_loss: float | None = None
) -> Path:
    """Write every figure in ``FIGURES``, ``study_table.md``, ``study_summary.json`` and ``study.html``.

    ``out_dir`` defaults to ``SWEEP_DIR/study``; ``target_loss`` to ``sweep.json``'s, else the median over
    arms of each arm's mean final train loss. Returns the HTML path. Figures without data say so inside them.
    """
    manifest, runs = load_study(sweep_dir)
    if not runs:
        raise FileNotFoundError(f"{sweep_dir} holds no run with a metrics.jsonl (run `pretrain sweep` first).")
    out = claim_output_dir(Path(out_dir) if out_dir is not None else Path(sweep_dir) / "study", "report",
                           what="Study report directory (--out)")  # a user's folder is refused, never overwritten
    map_images = []
    if manifest.get("config", {}).get("axes"):  # a depth x lr x norm sweep: the warmup map, figures of its hardest cell
        from pipelines.study.warmup_map import focus_runs, render_map

        map_images, map_summary, _ = render_map(runs, out, k=float(manifest["config"].get("fail_k", 2.0)))
        runs = focus_runs(runs, map_summary.get("focus")) or runs
    arms = _arms(runs)
    colors = _colors(list(arms))
    total = max(int(r.config.get("train", {}).get("max_steps", 0) or 0) for r in runs) or 1
    images = [
        (
            _fig_lr(arms, colors, out),
            "Learning rate per schedule; RAdam's effective rate lr·r_t dashed (0 while ρ_t ≤ 5)",
        ),
        (_fig_loss(arms, colors, out), "Training and validation loss, mean ± std over seeds"),
        (
            _fig_histograms(arms, colors, out, total),
            "Gradient and update magnitudes early in training, with and without warmup",
        ),
        (_fig_variance(arms, colors, out), "Variance of Adam's adaptive step size over steps"),
        *map_images,
    ]
    summary = summarize(runs, target_loss if target_loss is not None else manifest.get("target_loss"))
    atomic_write_text(out / "study_summary.json", json.dumps(summary, indent=1) + "\n")
    atomic_write_text(out / "study_table.md", markdown_table(summary))
    page = out / "study.html"
    atomic_write_text(page, study_html(manifest.get("name") or Path(sweep_dir).resolve().name, summary, images))
    return page
