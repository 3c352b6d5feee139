"""The study's summary table (markdown, printed by `pretrain report`) and its HTML page."""

from __future__ import annotations

import html
from typing import Any

__all__ = ["TABLE_HEAD", "table_rows", "markdown_table", "study_html"]


def _f(value: Any, digits: int = 4) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _pm(mean: float | None, std: float | None) -> str:
    return "—" if mean is None else f"{mean:.3f} ± {std or 0:.3f}"


TABLE_HEAD = (
    "arm",
    "runs (ok / diverged)",
    "final train loss",
    "best val loss",
    "steps to target",
    "divergence events",
    "wall time / run (s)",
)


def table_rows(summary: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = []
    for a in summary["arms"]:
        steps = (
            "—" if a["steps_to_target"] is None else f"{a['steps_to_target']:.0f} ({a['reached_target']}/{a['runs']})"
        )
        rows.append(
            (
                a["arm"],
                f"{a['runs']} ({a['ok']} / {a['diverged']})"
                + (f" + {a['unfinished']} unfinished, not counted" if a.get("unfinished") else ""),
                _pm(a["final_loss"], a["final_loss_std"]),
                _pm(a["best_val_loss"], a["best_val_loss_std"]),
                steps,
                str(a["divergence_events"]),
                _f(a["wall_time_s"], 3),
            )
        )
    return rows


def markdown_table(summary: dict[str, Any]) -> str:
    rows = [TABLE_HEAD, *table_rows(summary)]
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    lines.insert(1, "|" + "---|" * len(TABLE_HEAD))
    return "\n".join(lines) + "\n"


_CSS = """body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1150px; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.88em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; } th { background: #f3f3f3; }
figure { margin: 1.5em 0; } img { max-width: 100%; border: 1px solid #eee; } .muted { color: #777; font-size: 0.85em; }"""


def study_html(title: str, summary: dict[str, Any], images: list[tuple[str, str]]) -> str:
    esc = html.escape

    def table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
        return (
            "<table><tr>"
            + "".join(f"<th>{esc(h)}</th>" for h in head)
            + "</tr>"
            + "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows)
            + "</table>"
        )

    run_head = ("run", "status", "steps", "final train loss", "best val loss", "steps to target", "events", "wall (s)")
    run_rows = [
        (
            p["name"],
            p["status"],
            str(p["steps"]),
            _f(p["final_loss"]),
            _f(p["best_val_loss"]),
            _f(p["steps_to_target"]),
            str(p["divergence_events"]),
            _f(p["wall_time_s"], 3),
        )
        for p in summary["runs"]
    ]
    figs = "".join(
        f'<figure><img src="{esc(n)}" alt="{esc(c)}"><figcaption>{esc(c)}</figcaption></figure>' for n, c in images
    )
    target = _f(summary["target_loss"])
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
        f"<style>{_CSS}</style></head><body><h1>Optimizer × warmup study: {esc(title)}</h1>"
        f"<h2>Summary</h2>{table(TABLE_HEAD, table_rows(summary))}"
        f'<p class="muted">Final train loss: mean of the last 3 logged values (diverged runs excluded); steps to target: '
        f"first logged step whose 3-point trailing mean of the train loss is ≤ {esc(target)} (runs that reached it); "
        f"divergence events: runs stopped on NaN/Inf plus nan_skip/loss_spike events.</p>"
        f"<h2>Figures</h2>{figs}<h2>Runs</h2>{table(run_head, run_rows)}</body></html>\n"
    )
