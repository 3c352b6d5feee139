"""Where Adam without warmup fails: classify every run of a depth x lr x arm x norm sweep and draw the map.

Issue #21. The literature the study tests -- Liu et al. 2020 (RAdam, arXiv:1908.03265), Xiong et al.
2020 (pre-LN, arXiv:2002.04745), Liu et al. 2020 (Admin, arXiv:2004.08249), Huang et al. 2020
(T-Fixup) -- says a post-LN transformer trained with Adam needs a warmup, more so the deeper it is
and the larger the learning rate, that pre-LN does not, and that T-Fixup's initialisation removes
the need. ``configs/sweeps/warmup_map.yaml`` runs that grid; this module turns it into a verdict.

**When a run fails** (fixed before any run was looked at; ``classify``):

1. *diverged*: the run stopped on NaN/Inf (``nan_stop``, status ``diverged``) or its final loss is
   not finite;
2. *above start*: its final loss is above its first logged training loss;
3. *k sigma*: its final loss is worse than the best arm's mean final loss at the same cell
   (norm placement -- with beta2 and any other axis that tells runs apart there, ``map_runs.label_settings``
   --, depth, lr) by more than ``k`` pooled seed standard deviations of that cell
   (``sqrt`` of the mean per-arm seed variance over the cell's non-diverged arms, floored at
   ``min_std``). The best arm is the one with the lowest mean final loss among its runs that did
   not fail by 1 or 2. A cell where no arm has two such seeds has no seed spread: rule 3 is skipped.

A run's arm (``adam-lin10``) and its axis labels are the sweep's own, read from its entry in
``sweep.json`` (``pipelines.study.map_runs.run_result``). Adam without warmup, the baseline the claims are
about, is the arm whose runs' resolved configs are Adam/AdamW with no warmup (``baseline_arm``), whatever its
label; a sweep without one gets maps and no baseline claims, and its table says so in one line.

The *final loss* is the validation loss logged at the last step (the same batches for every run)
when there is one, else the mean of the last three logged training losses. A cell's *failure
rate* is failed seeds / seeds. ``render_map`` draws ``map_failure.png`` and ``map_loss.png`` (one
panel per norm placement x arm: depth rows x lr columns), ``map_grad_layers.png`` (per-layer
gradient norm in the first updates, with and without warmup, from the diagnostics), and writes
``map_table.md`` / ``map_summary.json`` with the claims computed from the runs (``claims``, and
``grad_spread``: how far apart the blocks' gradient norms are in the first updates).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from monitoring.report import save_figure
from pipelines.study.map_runs import label_settings, run_result
from pipelines.study.plateau import unigram_plateau

__all__ = [
    "DEFAULT_K",
    "run_result",
    "label_settings",
    "baseline_arm",
    "classify",
    "cell_stats",
    "claims",
    "draw_map",
    "grad_spread",
    "focus_cell",
    "unigram_plateau",
    "focus_runs",
    "render_map",
]

DEFAULT_K = 2.0
MIN_STD = 1e-3
MAP_FIGURES = ("map_failure.png", "map_loss.png", "map_grad_layers.png")
PLATEAU_MARGIN = 0.1  # nats below the unigram plateau that count as having left it (perplexity 10 % lower)
_BLOCK = re.compile(r"^grad_norm/(?:.+\.)?blocks\.(\d+)$")  # per-block norms of monitoring.diagnostics


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _cell(res: dict[str, Any]) -> tuple[str, int, float]:
    return res["norm"], res["depth"], res["lr"]


def baseline_arm(results: Iterable[dict[str, Any]]) -> str | None:
    """The arm label of Adam without warmup: the first arm (sweep order) all of whose runs are ``baseline``
    (``map_runs.is_no_warmup_adam`` of their configs); None when the sweep has no such arm."""
    arms: dict[str, bool] = {}
    for r in results:
        arms[r["arm"]] = arms.get(r["arm"], True) and bool(r.get("baseline"))
    return next((arm for arm, ok in arms.items() if ok), None)


NO_BASELINE = ("No arm of this sweep is Adam without warmup (optim.name adam or adamw with schedule.warmup=none "
               "or a linear warmup of 0 steps): the map shows each arm, and nothing is compared against that "
               "baseline; add such an arm (e.g. warmups: {none: [schedule.warmup=none]}) to draw those claims.")


def classify(results: Iterable[dict[str, Any]], k: float = DEFAULT_K, min_std: float = MIN_STD) -> list[dict[str, Any]]:
    """Copies of ``results`` with ``fail`` (bool) and ``reason`` (diverged | above_start | k_sigma | None)."""
    out = [dict(r) for r in results]
    for r in out:
        if not _finite(r["final"]):
            r["fail"], r["reason"] = True, "diverged"
        elif _finite(r["start"]) and r["final"] > r["start"]:
            r["fail"], r["reason"] = True, "above_start"
        else:
            r["fail"], r["reason"] = False, None
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for r in out:
        cells.setdefault(_cell(r), []).append(r)
    for rows in cells.values():
        by_arm: dict[str, list[float]] = {}
        for r in rows:
            if not r["fail"]:
                by_arm.setdefault(r["arm"], []).append(r["final"])
        if not by_arm:
            continue
        best = min(statistics.fmean(v) for v in by_arm.values())
        variances = [statistics.variance(v) for v in by_arm.values() if len(v) > 1]
        if not variances:  # no arm has two good seeds here: no seed spread to compare with, rule 3 is skipped
            continue
        std = max(math.sqrt(statistics.fmean(variances)), min_std)
        for r in rows:
            r["cell_best"], r["cell_std"] = best, std
            if not r["fail"] and r["final"] > best + k * std:
                r["fail"], r["reason"] = True, "k_sigma"
    return out


def cell_stats(classified: list[dict[str, Any]]) -> dict[tuple[str, str, int, float], dict[str, Any]]:
    """(norm, arm, depth, lr) -> runs, failures, failure rate, reasons, mean final loss of non-diverged runs."""
    stats: dict[tuple[str, str, int, float], dict[str, Any]] = {}
    for r in classified:
        s = stats.setdefault((r["norm"], r["arm"], r["depth"], r["lr"]), {"runs": 0, "fail": 0, "reasons": {}, "finals": []})
        s["runs"] += 1
        s["fail"] += bool(r["fail"])
        if r["reason"]:
            s["reasons"][r["reason"]] = s["reasons"].get(r["reason"], 0) + 1
        if _finite(r["final"]):
            s["finals"].append(r["final"])
    for s in stats.values():
        s["rate"] = s["fail"] / s["runs"]
        s["final"] = statistics.fmean(s["finals"]) if s["finals"] else None
    return stats


def _axes(classified: list[dict[str, Any]]) -> tuple[list[str], list[str], list[int], list[float]]:
    order = {"post": 0, "pre": 1, "tfixup": 2}
    beta2 = {r["norm"]: r.get("beta2") or 0.0 for r in classified}
    # post-LN first, then pre-LN, T-Fixup; within a stack the papers' larger beta2 first
    norms = sorted(beta2, key=lambda n: (order.get(n.split()[0], 9), -beta2[n], n))
    arms = list(dict.fromkeys(r["arm"] for r in classified))
    return norms, arms, sorted({r["depth"] for r in classified}), sorted({r["lr"] for r in classified})


def claims(classified: list[dict[str, Any]], k: float = DEFAULT_K) -> dict[str, Any]:
    """What the map says, computed: per norm the (depth, lr) cells where each arm fails in most seeds,
    the smallest failing lr per depth for Adam without warmup, and whether a warmup arm rescues those cells."""
    stats = cell_stats(classified)
    norms, arms, depths, lrs = _axes(classified)
    base = baseline_arm(classified)
    out: dict[str, Any] = {"k": k, "baseline_arm": base, "norms": {}}
    for norm in norms:
        per_arm = {}
        for arm in arms:
            cells = [(d, lr) for d in depths for lr in lrs if stats.get((norm, arm, d, lr), {}).get("rate", 0) > 0.5]
            per_arm[arm] = [{"depth": d, "lr": lr, "rate": stats[(norm, arm, d, lr)]["rate"]} for d, lr in cells]
        ran = [(d, lr) for d in depths for lr in lrs if (norm, base, d, lr) in stats]  # a slice has holes
        first_fail = {}
        for d in sorted({d for d, _ in ran}):
            failing = [lr for lr in lrs if stats.get((norm, base, d, lr), {}).get("rate", 0) > 0.5]
            first_fail[str(d)] = min(failing) if failing else None
        rescued = []
        for c in per_arm.get(base, []):
            ok = [a for a in arms if a != base and stats.get((norm, a, c["depth"], c["lr"]), {}).get("rate", 1) <= 0.5]
            rescued.append({"depth": c["depth"], "lr": c["lr"], "arms_ok": ok})
        out["norms"][norm] = {
            "majority_fail_cells": per_arm,
            "no_warmup_first_failing_lr": first_fail,
            "no_warmup_failures_rescued_by": rescued,
            "no_warmup_fail_cells": len(per_arm.get(base, [])),
            "cells": len(ran),  # the cells where Adam without warmup ran
        }
    return out


def plateau_claims(classified: list[dict[str, Any]], plateau: float | None) -> dict[str, Any]:
    """Per norm and arm, how far below the unigram plateau each (depth, lr) cell's mean final loss ends
    (``gap``, nats), and the cells that left it: more than ``PLATEAU_MARGIN`` below."""
    if plateau is None:
        return {"unigram_loss": None}
    stats = cell_stats(classified)
    norms, arms, depths, lrs = _axes(classified)
    below: dict[str, dict[str, Any]] = {}
    for norm in norms:
        for arm in arms:
            cells = [(d, lr, stats[(norm, arm, d, lr)]["final"]) for d in depths for lr in lrs if (norm, arm, d, lr) in stats]
            if cells:
                gaps = [{"depth": d, "lr": lr, "gap": None if f is None else plateau - f} for d, lr, f in cells]
                left = [g for g in gaps if g["gap"] is not None and g["gap"] > PLATEAU_MARGIN]
                below.setdefault(norm, {})[arm] = {"below": left, "cells": len(cells), "gaps": gaps}
    return {"unigram_loss": plateau, "margin": PLATEAU_MARGIN, "below_plateau": below}


def _lr_text(lr: float) -> str:
    return f"{lr:.0e}".replace("e-0", "e-")


def draw_map(classified: list[dict[str, Any]], out: Path, value: str = "rate") -> tuple[str, list[tuple[str, str]]]:
    """One heat-map panel per (norm placement, arm): rows = depth, columns = lr; ``value`` rate | final.

    Returns the PNG name and the panels as (norm, arm) in drawing order (rows = norms, columns = arms).
    """
    from matplotlib.figure import Figure

    stats = cell_stats(classified)
    norms, arms, depths, lrs = _axes(classified)
    finals = [s["final"] for s in stats.values() if s["final"] is not None]
    vmin, vmax = (0.0, 1.0) if value == "rate" else (min(finals, default=0.0), max(finals, default=1.0))
    fig = Figure(figsize=(2.4 * len(arms) + 1.2, 2.0 * len(norms) + 0.9), layout="constrained")
    what = "failure rate (failed seeds / seeds)" if value == "rate" else "mean final loss (non-diverged seeds)"
    fig.suptitle(f"{what}\nper depth × lr; rows: norm placement, columns: arm", fontsize=9)
    panels, image = [], None
    for i, norm in enumerate(norms):
        for j, arm in enumerate(arms):
            ax = fig.add_subplot(len(norms), len(arms), i * len(arms) + j + 1)
            grid = [[math.nan] * len(lrs) for _ in depths]
            for di, d in enumerate(depths):
                for li, lr in enumerate(lrs):
                    s = stats.get((norm, arm, d, lr))
                    if s is None:
                        continue
                    v = s["rate"] if value == "rate" else s["final"]
                    grid[di][li] = math.nan if v is None else v
                    label = f"{s['fail']}/{s['runs']}" if value == "rate" else ("div" if v is None else f"{v:.2f}")
                    high = v is not None and (v - vmin) / ((vmax - vmin) or 1.0) > 0.6
                    dark = high if value == "rate" else not high  # Reds: high = dark; viridis: high = light
                    color = "w" if dark and v is not None else "k"  # a diverged cell is blank: black "div"
                    ax.text(li, di, label, ha="center", va="center", fontsize=7, color=color)
            cmap = "Reds" if value == "rate" else "viridis"
            image = ax.imshow(grid, origin="lower", aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax)
            ax.set_xticks(range(len(lrs)), [_lr_text(lr) for lr in lrs], fontsize=7)
            ax.set_yticks(range(len(depths)), [str(d) for d in depths], fontsize=7)
            ax.set_title(f"{norm} · {arm}", fontsize=8)
            if i == len(norms) - 1:
                ax.set_xlabel("lr", fontsize=7)
            if j == 0:
                ax.set_ylabel("layers", fontsize=7)
            panels.append((norm, arm))
    if image is not None:
        fig.colorbar(image, ax=fig.axes, shrink=0.6)
    name = "map_failure.png" if value == "rate" else "map_loss.png"
    return save_figure(fig, out, name), panels


def draw_grad_layers(runs: list[Any], classified: list[dict[str, Any]], out: Path, first: int = 3) -> str:
    """Per-layer gradient norm at the first logged updates, Adam without vs. with warmup, at the focus
    cell (``focus_cell``: post-LN, deepest depth; first seed of each arm)."""
    from matplotlib.figure import Figure

    focus = focus_cell(classified)
    norm, depth, lr = focus["norm"], focus["depth"], focus["lr"]
    target = {r["name"]: r for r in classified}
    chosen = {}
    for r in runs:
        c = target.get(r.name)
        if c and c["norm"] == norm and c["depth"] == depth and c["lr"] == lr and c["arm"] not in chosen:
            chosen[c["arm"]] = r
    fig = Figure(figsize=(3.2 * first + 1, 3.4), layout="constrained")
    fig.suptitle(f"|gradient| per block, first updates: {norm}, {depth} layers, lr {_lr_text(lr)}")
    for col in range(first):
        ax = fig.add_subplot(1, first, col + 1)
        ax.grid(True, alpha=0.3)
        drawn = False
        for arm, r in chosen.items():
            recs = [d for d in r.diag if any(_BLOCK.match(k) for k in d)]
            if col >= len(recs):
                continue
            rec = recs[col]
            layers = sorted((int(m[1]), v) for k, v in rec.items() if (m := _BLOCK.match(k)))
            ax.semilogy([i for i, _ in layers], [v for _, v in layers], marker="o", markersize=3, label=arm)
            ax.set_title(f"update {rec['step']}", fontsize=9)
            drawn = True
        ax.set_xlabel("block")
        if col == 0:
            ax.set_ylabel("gradient norm")
        if not drawn:
            ax.text(0.5, 0.5, "no per-block diagnostics:\nset logging.diagnostics_every > 0", ha="center",
                    va="center", transform=ax.transAxes, fontsize=8, color="0.4")
    if fig.axes and fig.axes[0].get_legend_handles_labels()[0]:
        fig.axes[0].legend(fontsize=7)
    return save_figure(fig, out, "map_grad_layers.png")


def grad_spread(runs: list[Any], classified: list[dict[str, Any]], first: int = 3) -> dict[str, Any]:
    """Largest / smallest per-block gradient norm at the first ``first`` diagnostics updates, per norm
    placement and arm, at the focus cell's depth and lr (``focus_cell``): the median over seeds (a vanishing
    lower block shows as a ratio of many orders of magnitude; Xiong et al. 2020, Liu et al. 2020 Admin)."""
    norms, _arms, _depths, _lrs = _axes(classified)
    focus = focus_cell(classified)
    depth, lr = focus["depth"], focus["lr"]
    target = {r["name"]: r for r in classified}
    ratios: dict[tuple[str, str], list[list[float]]] = {}
    steps: dict[tuple[str, str], list[int]] = {}
    for r in runs:
        c = target.get(r.name)
        if not c or c["depth"] != depth or c["lr"] != lr:
            continue
        recs = [d for d in r.diag if any(_BLOCK.match(k) for k in d)][:first]
        per_update = []
        for rec in recs:
            norms_ = [v for k, v in rec.items() if _BLOCK.match(k) and _finite(v)]
            per_update.append(max(norms_) / min(norms_) if norms_ and min(norms_) > 0 else math.inf)
        ratios.setdefault((c["norm"], c["arm"]), []).append(per_update)
        steps.setdefault((c["norm"], c["arm"]), [int(rec["step"]) for rec in recs])
    out: dict[str, Any] = {"depth": depth, "lr": lr, "norms": {}}
    for (norm, arm), rows in ratios.items():
        n = min(len(row) for row in rows)
        out["norms"].setdefault(norm, {})[arm] = {
            "updates": steps[(norm, arm)][:n],
            "median_ratio": [statistics.median(row[i] for row in rows) for i in range(n)],
            "seeds": len(rows),
        }
    out["norms"] = {n: out["norms"][n] for n in norms if n in out["norms"]}
    return out


def _below_text(arm: str, b: dict[str, Any]) -> str:
    gaps = ", ".join(f"{g['depth']}L {_lr_text(g['lr'])}: {'div' if g['gap'] is None else format(g['gap'], '.2f')}"
                     for g in b["gaps"])
    return f"{arm} {len(b['below'])}/{b['cells']} ({gaps})"


def markdown(classified: list[dict[str, Any]], found: dict[str, Any], spread: dict[str, Any] | None = None) -> str:
    """The map as a table (one row per norm, arm, depth; failure rate and mean final loss per lr) + the claims
    (+ the per-block gradient spread of ``grad_spread``)."""
    stats = cell_stats(classified)
    norms, arms, depths, lrs = _axes(classified)
    head = ["norm", "arm", "layers"] + [f"lr {_lr_text(lr)}: fail · loss" for lr in lrs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for norm in norms:
        for arm in arms:
            for d in depths:
                cells = []
                for lr in lrs:
                    s = stats.get((norm, arm, d, lr))
                    loss = "—" if not s or s["final"] is None else f"{s['final']:.3f}"
                    cells.append("" if not s else f"{s['fail']}/{s['runs']} · {loss}")
                if any(cells):  # a slice of the map: no row for a (stack, arm, depth) without runs
                    lines.append("| " + " | ".join([norm, arm, str(d), *cells]) + " |")
    lines.append("")
    lines.append(f"Failure: diverged, final loss above start, or > {found['k']:g} pooled seed std above the best arm of the cell.")
    base = found.get("baseline_arm")
    if base is None:
        lines.append(f"- {NO_BASELINE}")
    for norm, c in found["norms"].items() if base else ():
        ff = ", ".join(f"{d} layers: {_lr_text(lr) if lr else 'none'}" for d, lr in c["no_warmup_first_failing_lr"].items())
        lines.append(
            f"- {norm}: Adam without warmup ({base}) fails (majority of seeds) in {c['no_warmup_fail_cells']}/{c['cells']} "
            f"cells; smallest failing lr per depth: {ff}."
        )
        for res in c["no_warmup_failures_rescued_by"]:
            ok = ", ".join(res["arms_ok"]) or "no arm"
            lines.append(f"  - {res['depth']} layers, lr {_lr_text(res['lr'])}: {ok} fine there.")
    plateau = found.get("plateau") or {}
    if plateau.get("unigram_loss") is not None:
        lines.append(f"\nUnigram plateau (validation targets under training token frequencies): "
                     f"{plateau['unigram_loss']:.3f}. Cells that left it (mean final loss more than "
                     f"{plateau['margin']:g} below) / cells, and plateau − mean final loss per depth × lr:")
        for norm, per_arm in plateau["below_plateau"].items():
            lines.append(f"- {norm}: " + "; ".join(_below_text(arm, b) for arm, b in per_arm.items()))
    if spread and spread["norms"]:
        lines.append(f"\nLargest / smallest per-block gradient norm at the first updates, {spread['depth']} layers, "
                     f"lr {_lr_text(spread['lr'])} (median over seeds):")
        for norm, per_arm in spread["norms"].items():
            for arm, g in per_arm.items():
                at = ", ".join(f"update {u}: {v:.2g}" for u, v in zip(g["updates"], g["median_ratio"], strict=True))
                lines.append(f"- {norm} · {arm}: {at or 'no per-block diagnostics'}")
    return "\n".join(lines) + "\n"


def render_map(runs: list[Any], out: Path, k: float = DEFAULT_K) -> tuple[list[tuple[str, str]], dict[str, Any], str]:
    """Classify the finished ``runs`` (``analysis.StudyRun``), draw the map figures, write map_table.md / map_summary.json.

    Returns (images as (file, caption), the summary, the markdown table).
    """
    import json

    from core.files import atomic_write_text

    runs = [r for r in runs if r.status.get("status") in ("ok", "diverged")]  # finished runs only (a sweep may be running)
    classified = classify(label_settings(run_result(r) for r in runs), k)
    if not classified:
        return [], {}, ""
    found = claims(classified, k)
    corpus = runs[0].config.get("data", {}).get("corpus") if runs else None
    found["plateau"] = plateau_claims(classified, unigram_plateau(corpus) if corpus else None)
    focus = focus_cell(classified)
    images = [
        (draw_map(classified, out, "rate")[0], "Failure rate of each arm per depth × lr (rows: norm placement)"),
        (draw_map(classified, out, "final")[0], "Mean final loss per depth × lr"),
        (draw_grad_layers(runs, classified, out), "Per-block gradient norm in the first updates, with and without warmup"),
    ]
    spread = grad_spread(runs, classified)
    table = markdown(classified, found, spread)
    table += (f"\nPer-arm figures (lr, loss, histograms, adam_variance): {focus['norm']}, {focus['depth']} layers, "
              f"lr {_lr_text(focus['lr'])} ({focus['why']}), with Adam without warmup of the other stacks there.\n")
    summary = {"claims": found, "grad_spread": spread, "focus": focus, "runs": classified}
    atomic_write_text(out / "map_summary.json", json.dumps(summary, indent=1, default=str) + "\n")
    atomic_write_text(out / "map_table.md", table)
    return images, summary, table


def focus_cell(classified: list[dict[str, Any]]) -> dict[str, Any]:
    """The cell the per-arm figures (lr, loss, histograms, Adam variance, per-block gradients) show.

    The first stack (post-LN; of its beta2 settings the first where Adam without warmup fails, else the
    first): the deepest depth where Adam without warmup fails in most seeds and there the smallest such
    lr -- where the question is decided --, else the deepest depth and its largest lr; only cells that
    hold runs (a slice of a map has holes).
    """
    if not classified:
        return {}
    stats = cell_stats(classified)
    norms, _arms, _depths, _lrs = _axes(classified)
    base = baseline_arm(classified)

    def cells(norm: str) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
        ran = sorted((d, lr) for (n, _a, d, lr) in stats if n == norm)  # the cells this setting has runs in (a slice)
        return ran, [(d, lr) for d, lr in ran if stats.get((norm, base, d, lr), {}).get("rate", 0) > 0.5]

    stack = [n for n in norms if n.split(" ")[0] == norms[0].split(" ")[0]]  # "post β2=0.999", "post β2=0.98"
    norm = next((n for n in stack if cells(n)[1]), norms[0])
    ran, failing = cells(norm)
    if failing:
        depth = max(d for d, _ in failing)
        lr = min(lr for d, lr in failing if d == depth)
    else:
        depth = max(d for d, _ in ran)
        lr = max(lr for d, lr in ran if d == depth)
    beta2 = next(r.get("beta2") for r in classified if r["norm"] == norm)
    why = ("smallest lr where Adam without warmup fails" if failing else "no failure of Adam without warmup: largest lr"
           if base else "no arm is Adam without warmup: largest lr")
    return {"norm": norm, "beta2": beta2, "depth": depth, "lr": lr, "why": why}


def focus_runs(runs: list[Any], focus: dict[str, Any] | None = None) -> list[Any]:
    """The runs the per-arm figures draw: every arm of the ``focus`` cell (``focus_cell``; computed from
    ``runs`` when not given) and, for contrast, Adam without warmup of the other stacks (and beta2) at the
    same depth and lr."""
    results = {c["name"]: c for c in classify(label_settings(run_result(r) for r in runs))}
    if not results:
        return runs
    focus = focus or focus_cell(list(results.values()))
    base = baseline_arm(results.values())

    def shown(c: dict[str, Any]) -> bool:
        if c["depth"] != focus["depth"] or c["lr"] != focus["lr"]:
            return False
        return c["norm"] == focus["norm"] or (base is not None and c["arm"] == base)

    return [r for r in runs if r.name in results and shown(results[r.name])]
