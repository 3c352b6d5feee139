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

__all__ = ["build_summary", "format_summary"]


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
    if cfg.kind == "bert_pairs" and samples:
        summary["nsp_random_share"] = round(c.get("nsp_random", 0) / samples, 4)
    if cfg.kind == "packed_lm" and c.get("stream_tokens"):
        summary["tokens_kept_share"] = round(c.get("stream_tokens_kept", 0) / c["stream_tokens"], 5)
    return summary


def _first_bad_record(stats: Stats) -> str | None:
    """'FILE line N' (or row N) of the first bad record of the file with the most, for the user to look at."""
    worst = max(stats.bad_by_file.items(), key=lambda kv: sum(kv[1].values()), default=None)
    if worst is None or worst[0] not in stats.first_bad:
        return None
    return f"{worst[0]} {describe_where(worst[0], stats.first_bad[worst[0]])}"


def format_summary(s: dict[str, Any]) -> str:
    """The end-of-job table: documents (or images) in, removed per rule, samples, tokens, shards, MB, time."""
    tokenized = corpus_kind(s["kind"]).tokenized
    unit = "documents" if tokenized else "images"
    rows: list[tuple[str, str]] = [("corpus", s["output"]), ("kind", s["kind"]), (f"{unit} in", f"{s['documents_in']:,}")]
    rows += [(f"  removed: {k}", f"{v:,}") for k, v in s["removed"].items()]
    rows += [(f"  bad records: {k}", f"{v:,}") for k, v in s["bad"].items()]
    rows += [("  bad records: first in worst file", s["bad_first"])] if s.get("bad_first") else []
    rows += [(f"{unit} kept", f"{s['documents_kept']:,}")]
    rows += [(f"samples ({k})", f"{v:,}") for k, v in s["samples"].items()]
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
