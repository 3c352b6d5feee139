"""What the warmup map (``pipelines.study.warmup_map``) reads from one run of a sweep, and how runs get their map labels.

A run's *arm* and the labels of its grid axes are the sweep's own: ``optimizer-warmup`` from the run's
entry in ``sweep.json`` (two warmup arms with the same ``schedule.warmup`` but other settings, e.g.
``lin10`` and ``lin30``, stay two arms), its ``norm`` label from the sweep's ``norm`` axis (else from its
config: post, pre or tfixup), its depth and lr from its config. ``label_settings`` adds to the row
label (the ``norm`` field) what else tells runs apart: β₂ when the sweep has several (``post β2=0.999``),
then every other axis whose labels differ inside one (row, depth, lr) cell (``post width=w64``), so a
cell never pools two models. Whether a run is the baseline, Adam without warmup, is read from its resolved
config (``is_no_warmup_adam``), never from its labels: ``none``, ``no_warmup`` or ``constant`` name the same arm.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

__all__ = ["ADAM_NAMES", "MAP_AXES", "is_no_warmup_adam", "run_result", "label_settings"]

ADAM_NAMES = ("adam", "adamw")  # the optimizers whose runs without warmup are the map's baseline
MAP_AXES = ("optimizer", "warmup", "norm")  # the labels that are the arm and the row; depth and lr are numbers


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _norm_of(cfg: dict[str, Any]) -> str:
    over = cfg.get("model", {}).get("overrides", {}) or {}
    if over.get("init") == "t-fixup":
        return "tfixup"
    return str(over.get("norm_placement", "post"))


def _depth_of(cfg: dict[str, Any]) -> int:
    model = cfg.get("model", {})
    over = model.get("overrides", {}) or {}
    if "num_layers" in over:
        return int(over["num_layers"])
    try:
        from models.registry import get_config

        return int(get_config(model.get("name", "bert-tiny")).num_layers)
    except Exception:  # noqa: BLE001 - an unknown model name only loses the depth label
        return 0


def is_no_warmup_adam(cfg: dict[str, Any], first: int = 100) -> bool:
    """Whether the resolved run config ``cfg`` is Adam (or AdamW) whose learning rate is not warmed up: the
    warmup factor of ``schedule`` is 1 at each of the first ``first`` updates (``warmup: none``, or a linear
    warmup of 0 or 1 steps). A warmup this process has not registered counts only under the name ``none``."""
    from pipelines.engine.schedules import WARMUPS, ScheduleContext

    opt, sched = cfg.get("optim") or {}, cfg.get("schedule") or {}
    if str(opt.get("name", "")).lower() not in ADAM_NAMES:
        return False
    name = str(sched.get("warmup", "linear"))  # ScheduleConfig's default
    if name not in WARMUPS:
        return name == "none"
    betas = opt.get("betas") or [0.9, 0.999]
    ctx = ScheduleContext(base_lr=float(opt.get("lr") or 1.0), total_steps=max(first, 1),
                          warmup_steps=int(sched.get("warmup_steps") or 0), beta2=float(betas[1]),
                          d_model=int(sched.get("d_model") or 0) or 1)
    try:
        return all(WARMUPS.lookup(name).factor(t, ctx) == 1.0 for t in range(1, first + 1))
    except (ArithmeticError, ValueError):  # e.g. an exponential warmup of 0 steps, which training refuses
        return False


def run_result(r: Any) -> dict[str, Any]:
    """The numbers ``classify`` needs from one ``analysis.StudyRun``: arm, norm, depth, lr, seed, start, final,
    ``baseline`` (``is_no_warmup_adam`` of its config: the arm label only names it) and ``axes``: the labels of the sweep's other axes (``StudyRun.labels``; a run without labels gets its arm
    from its config, ``optim.name-schedule.warmup``, as before labels were read)."""
    cfg = r.config
    opt = cfg.get("optim", {})
    labels = dict(getattr(r, "labels", None) or {})
    if "optimizer" in labels and "warmup" in labels:
        arm = f"{labels['optimizer']}-{labels['warmup']}"
    else:
        arm = f"{opt.get('name', '?')}-{cfg.get('schedule', {}).get('warmup', '?')}"
    train = [v for _, v in r.run.get("train", "loss")]
    evals = r.run.get("eval", "loss")
    last_step = r.run.get("train", "loss")[-1][0] if train else None
    stopped = r.status.get("status") == "diverged" or any(e.get("event") == "nan_stop" for e in r.run.events)
    if evals and evals[-1][0] == last_step:
        final = evals[-1][1]
    else:
        tail = train[-3:]
        final = statistics.fmean(tail) if tail and all(_finite(v) for v in tail) else float("nan")
    betas = opt.get("betas") or [0.9, 0.999]
    return {
        "name": r.name,
        "arm": arm,
        "baseline": is_no_warmup_adam(cfg),
        "norm": str(labels.get("norm") or _norm_of(cfg)),
        "beta2": float(betas[1]),
        "depth": _depth_of(cfg),
        "lr": float(opt.get("lr", float("nan"))),
        "axes": {k: str(v) for k, v in labels.items() if k not in MAP_AXES},
        "seed": r.seed,
        "start": train[0] if train else float("nan"),
        "final": float("nan") if stopped else final,
        "wall_time_s": r.status.get("wall_time_s"),
    }


def label_settings(results: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``results`` whose ``norm`` label also names beta2 (``post β2=0.999``) when the sweep mixes
    several beta2 values, then each other axis (``axes``, in the sweep's order) whose labels differ among
    runs of one (row, depth, lr) cell (``post width=w64``): a cell (and a map panel) is one model setting,
    never a blend of two. An axis the cell already tells apart (``depth``, a ``beta2`` axis) adds nothing."""
    out = [dict(r) for r in results]
    if len({r.get("beta2") for r in out}) > 1:
        for r in out:
            r["norm"] = f"{r['norm']} β2={r['beta2']:g}"
    for axis in dict.fromkeys(a for r in out for a in r.get("axes") or {}):
        seen: dict[tuple[str, int, float], set[str | None]] = {}
        for r in out:
            seen.setdefault((r["norm"], r["depth"], r["lr"]), set()).add((r.get("axes") or {}).get(axis))
        if any(len(labels) > 1 for labels in seen.values()):
            for r in out:
                r["norm"] = f"{r['norm']} {axis}={(r.get('axes') or {}).get(axis, '?')}"
    return out
