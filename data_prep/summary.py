"""The end-of-job summary of `prepare`: the dict `run_prepare` returns and the table it prints.

An image corpus counts images, not documents or tokens: its table says so instead of printing "tokens 0".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.corpus_kinds import corpus_kind
from data_prep.allocator import find_worker_malloc
from data_prep.clean import Stats
from data_prep.config import PrepConfig
from data_prep.sources import describe_where

__all__ = ["build_summary", "classes_missing", "format_summary", "missing_classes_warning"]


def build_summary(cfg: PrepConfig, manifest: dict[str, Any], stats: Stats, wall: float) -> dict[str, Any]:
    c = stats.counts
    splits = manifest["splits"]
    shards = [s for sp in splits.values() for s in sp["shards"]]
    tokens = sum(sp["tokens"] for sp in splits.values())
    samples = sum(sp["samples"] for sp in splits.values())
    summary: dict[str, Any] = {
        "output": str(cfg.output),
        "kind": cfg.kind,
        "documents_in": int(c.get("documents_in", 0)),
        "removed": {k.removeprefix("removed."): int(v) for k, v in sorted(c.items()) if k.startswith("removed.")},
        "bad": {k.removeprefix("bad."): int(v) for k, v in sorted(c.items()) if k.startswith("bad.")},
        "documents_kept": int(c.get("documents_kept", 0)),
        "samples": {name: sp["samples"] for name, sp in splits.items()},
        "tokens": tokens,
        "shards": len(shards),
        "bytes": sum(s["bytes"] for s in shards),
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1) if wall > 0 else 0.0,
        "worker_malloc": find_worker_malloc(cfg.worker_malloc) or "system",
        "manifest": str(Path(cfg.output) / "manifest.json"),
    }
    if where := _first_bad_record(stats):
        summary["bad_first"] = where
    elif stats.bad_by_file:  # images: the file is the record
        summary["bad_files"] = sorted(stats.bad_by_file)
    if cfg.kind == "bert_pairs" and samples:
        summary["nsp_random_share"] = round(c.get("nsp_random", 0) / samples, 4)
    if cfg.kind == "packed_lm" and c.get("stream_tokens"):
        summary["tokens_kept_share"] = round(c.get("stream_tokens_kept", 0) / c["stream_tokens"], 5)
    return summary


def classes_missing(records: list[dict[str, Any]], class_map: dict[str, int]) -> dict[str, list[str]]:
    """Per split, the classes (by name) with no image in it: a split routes each image by its hash, so a class of a
    few images can land in one split only (a class of one always does), and its evaluation then never scores it.
    Shards recorded by an older prepare have no per-class counts: nothing is claimed then."""
    if any("class_counts" not in r for r in records):
        return {}
    seen: dict[str, set[int]] = {"train": set(), "validation": set()}
    for rec in records:
        seen.setdefault(rec["name"].split("-")[0], set()).update(int(k) for k in rec["class_counts"])
    return {split: names for split, labels in seen.items()
            if (names := [name for name, k in class_map.items() if k not in labels])}


def missing_classes_warning(s: dict[str, Any]) -> str | None:
    """One line for the user when a split lacks a class (``classes_missing``), with the fix."""
    missing = s.get("classes_missing", {})
    if not missing:
        return None
    parts = "; ".join(f"no {split} image of {len(names)} class(es): {_names(names)}" for split, names in missing.items())
    return (f"warning: {s['output']}: {parts}. Images are split by their hash, so a class of a few images can land in "
            f"one split only (training never sees a class train lacks; evaluation never scores one validation lacks). "
            f"Add images to those class folders, or raise validation_fraction.")


def _first_bad_record(stats: Stats) -> str | None:
    """'FILE line N' (or row N) of the first bad record of the file with the most, for the user to look at."""
    worst = max(stats.bad_by_file.items(), key=lambda kv: sum(kv[1].values()), default=None)
    if worst is None or worst[0] not in stats.first_bad:
        return None
    return f"{worst[0]} {describe_where(worst[0], stats.first_bad[worst[0]])}"


def _names(names: list[str], shown: int = 8) -> str:
    more = f", ... ({len(names)} in all)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def format_summary(s: dict[str, Any]) -> str:
    """The end-of-job table: documents (or images) in, removed per rule, samples, tokens, shards, MB, time."""
    tokenized = corpus_kind(s["kind"]).tokenized
    unit = "documents" if tokenized else "images"
    rows: list[tuple[str, str]] = [("corpus", s["output"]), ("kind", s["kind"]), (f"{unit} in", f"{s['documents_in']:,}")]
    rows += [(f"  removed: {k}", f"{v:,}") for k, v in s["removed"].items()]
    rows += [(f"  bad records: {k}", f"{v:,}") for k, v in s["bad"].items()]
    rows += [("  bad records: first in worst file", s["bad_first"])] if s.get("bad_first") else []
    rows += [("  bad records: files", _names(s["bad_files"], shown=5))] if s.get("bad_files") else []
    rows += [(f"{unit} kept", f"{s['documents_kept']:,}")]
    rows += [(f"samples ({k})", f"{v:,}") for k, v in s["samples"].items()]
    rows += [(f"  classes with no {split} image", _names(names)) for split, names in s.get("classes_missing", {}).items()]
    rows += [("tokens", f"{s['tokens']:,}")] if tokenized else []
    rows += [("shards", str(s["shards"])), ("size", f"{s['bytes'] / 1e6:,.1f} MB")]
    if "nsp_random_share" in s:
        rows.append(("NotNext share", f"{s['nsp_random_share']:.1%}"))
    if "tokens_kept_share" in s:
        rows.append(("tokens kept by packing", f"{s['tokens_kept_share']:.2%}"))
    images_s = sum(s["samples"].values()) / s["wall_s"] if s["wall_s"] > 0 else 0.0
    rate = ("tokens/s", f"{s['tokens_per_s']:,.0f}") if tokenized else ("images/s", f"{images_s:,.0f}")
    rows += [("wall time", f"{s['wall_s']:.1f} s"), rate]
    rows += [("workers' malloc", s["worker_malloc"])] if "worker_malloc" in s else []
    rows += [(f"  stage: {k}", f"{v:.1f} s") for k, v in s.get("stages_s", {}).items()]
    rows += [(f"  in tasks: {k}", f"{v:.1f} s") for k, v in s.get("task_s", {}).items()]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 2 + max(len(v) for _, v in rows))
    return "\n".join([line, *(f"{k.ljust(width)}  {v}" for k, v in rows), line])
