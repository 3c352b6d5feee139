"""The data-preparation job: plan on the driver, do the work in Ray, finish with a manifest.

Stages (Ray Data, streaming): list inputs -> tokenizer sample (read + clean a deterministic
subset, train or load the tokenizer, measure tokens per input byte to size the shards) ->
optional MinHash near-dedup -> read + clean + tokenize every file in parallel -> group by shard
(the Ray shuffle co-locates exact duplicates, which share a content hash) -> each group writes
one shard -> the driver collects the small per-shard records and writes `manifest.json` last.
The driver never holds documents, only the tokenizer sample and per-shard summaries.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from data_prep.clean import Stats, lsh_params
from data_prep.config import PrepConfig, manifest_config
from data_prep.errors import PrepError
from data_prep.shards import SCHEMA_VERSION, STATE_DIR, write_manifest
from data_prep.sources import resolve_inputs
from pipelines.config import to_dict

__all__ = ["run_prepare", "format_summary"]

FORMAT_VERSION = "1"  # bump when the bytes a config produces change, so stale shards are rebuilt
_SHARD_FILE = re.compile(r"^(train|validation)-\d{6}\.tar$")


def _ensure_ray(cfg: PrepConfig) -> bool:
    """Connect to `RAY_ADDRESS` or start a local Ray; True when we started it (and must stop it)."""
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": "WARNING"}
    if not os.environ.get("RAY_ADDRESS"):
        kwargs["num_cpus"] = cfg.num_workers or None
    ray.init(**kwargs)
    return True


@contextlib.contextmanager
def _data_context(cfg: PrepConfig):
    """Sort-based shuffle (no actor start-up, fast on small clusters) and progress bars on/off."""
    from ray.data import DataContext
    from ray.data.context import ShuffleStrategy

    ctx = DataContext.get_current()
    saved = (ctx.shuffle_strategy, ctx.enable_progress_bars, ctx.enable_auto_log_stats)
    ctx.shuffle_strategy = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
    ctx.enable_progress_bars = cfg.progress
    ctx.enable_auto_log_stats = False
    try:
        yield
    finally:
        ctx.shuffle_strategy, ctx.enable_progress_bars, ctx.enable_auto_log_stats = saved


def _workers(cfg: PrepConfig) -> int:
    import ray

    return cfg.num_workers or max(1, int(ray.cluster_resources().get("CPU", 1)))


def _pool(workers: int):
    from ray.data import TaskPoolStrategy

    return TaskPoolStrategy(size=workers)


def _dataset(entries: list[dict[str, Any]], workers: int):
    import ray

    return ray.data.from_items(entries, override_num_blocks=max(1, min(len(entries), workers * 8)))


def _stable_order(entries: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """Input files in a seeded order that does not depend on where the corpus lives."""
    root = os.path.commonpath([os.path.abspath(e["path"]) for e in entries]) if len(entries) > 1 else ""
    key = lambda e: hashlib.sha256(f"{seed}:{os.path.relpath(os.path.abspath(e['path']), root or '/')}".encode()).hexdigest()  # noqa: E731
    return sorted(entries, key=key)


def _base_ctx(cfg: PrepConfig) -> dict[str, Any]:
    d = to_dict(cfg)
    return {
        "kind": cfg.kind, "sources": d["sources"], "clean": d["clean"], "images": d["images"], "seed": cfg.seed,
        "seq_len": cfg.seq_len, "short_seq_prob": cfg.short_seq_prob, "nsp_random_prob": cfg.nsp_random_prob,
        "dupe_factor": cfg.dupe_factor, "validation_fraction": cfg.validation_fraction, "output": str(Path(cfg.output).resolve()),
        "slow_shards_s": float(os.environ.get("DATA_PREP_SLOW_SHARDS_S", "0") or 0),
    }


def _prepare_tokenizer(cfg: PrepConfig, entries, ctx, workers: int) -> tuple[Any, str, dict[str, str], int]:
    """Train (or load) the tokenizer on a deterministic sample; also measure tokens per input byte."""
    from data_prep import stages
    from data_prep.tokenizer import install_tokenizer, load_tokenizer_dir, save_tokenizer, train_tokenizer

    chosen, size = [], 0
    for e in _stable_order(entries, cfg.seed):
        if size >= cfg.tokenizer.sample_bytes:
            break
        chosen.append(e)
        size += e["size"]
    rows = _dataset(chosen, workers).map_batches(
        stages.sample_docs, batch_size=None, batch_format="numpy", fn_kwargs={"ctx": ctx}, compute=_pool(workers)
    ).take_all()
    stats = Stats()
    docs: dict[str, str] = {}
    for r in rows:
        if r["stats"]:
            stats.merge(Stats.from_dict(json.loads(r["stats"])))
        else:
            docs[r["hash"]] = r["text"]
    _check_bad_share(stats, cfg, where="the tokenizer sample")
    if not docs:
        raise PrepError(
            f"No document survived reading and cleaning in {[p for s in cfg.sources for p in s.paths]} "
            f"(counts: {dict(stats.counts)}). Check the source type/text_field, or lower clean.min_chars."
        )
    texts, budget = [], cfg.tokenizer.sample_bytes
    for h in sorted(docs):
        texts.append(docs[h])
        budget -= len(docs[h])
        if budget <= 0:
            break
    tdir = Path(cfg.output) / "tokenizer"
    if cfg.tokenizer.path:
        tok, ttype = load_tokenizer_dir(cfg.tokenizer.path)
        install_tokenizer(cfg.tokenizer.path, tdir)
    else:
        ttype = cfg.tokenizer.type
        tok = train_tokenizer(texts, cfg.tokenizer)
        save_tokenizer(tok, tdir, ttype, model_max_length=cfg.seq_len, lowercase=cfg.tokenizer.lowercase)
    return tok, ttype, docs, size


def _out_bytes_per_input_byte(docs: dict[str, str], sample_file_bytes: int, ctx, tok) -> float:
    """Shard bytes per byte of input file, measured by building samples from ~0.5 MB of the sample."""
    from data_prep.stages import estimate_shard_bytes

    subset, text_bytes = {}, 0
    for h in sorted(docs):
        subset[h] = docs[h]
        text_bytes += len(docs[h].encode())
        if text_bytes > 500_000:
            break
    cleaned_share = sum(len(t.encode()) for t in docs.values()) / max(1, sample_file_bytes)
    return estimate_shard_bytes(subset, ctx, tok) / max(1, text_bytes) * cleaned_share


def _plan_buckets(cfg: PrepConfig, entries, out_per_in: float) -> dict[str, int]:
    """Shards per split so that each is about `shard_target_mb` (estimated from input size)."""
    total = sum(e["size"] for e in entries)
    est = total + 1536 * len(entries) if cfg.kind == "images" else total * out_per_in
    target = cfg.shard_target_mb * 1e6
    val = cfg.validation_fraction
    return {"train": max(1, round(est * (1 - val) / target)), "validation": max(1, round(est * val / target))}


def _near_dups(cfg: PrepConfig, entries, ctx, workers: int) -> frozenset[str]:
    from data_prep import stages

    bands, rows = lsh_params(cfg.clean.minhash_perms, cfg.clean.near_dedup_threshold)
    ctx = {**ctx, "lsh": (bands, rows)}
    ds = _dataset(entries, workers).map_batches(stages.minhash_bands, batch_size=None, batch_format="numpy", fn_kwargs={"ctx": ctx}, compute=_pool(workers))
    out = ds.groupby("band").map_groups(stages.near_dup_group, batch_format="numpy", fn_kwargs={"ctx": ctx}).take_all()
    return frozenset(r["hash"] for r in out)


def _check_bad_share(stats: Stats, cfg: PrepConfig, where: str) -> None:
    bad, good = stats.bad_records, stats.counts.get("documents_in", 0)
    if bad and bad / (bad + good) > cfg.max_bad_fraction:
        worst = sorted(stats.bad_by_file.items(), key=lambda kv: -sum(kv[1].values()))[:5]
        listing = "; ".join(f"{p}: {dict(r)}" for p, r in worst)
        raise PrepError(
            f"{bad} of {bad + good} input records in {where} are bad ({bad / (bad + good):.1%} > max_bad_fraction="
            f"{cfg.max_bad_fraction}). Worst files: {listing}. Fix or remove these files, or raise max_bad_fraction."
        )


def _clean_stale(out: Path, keep: set[str]) -> None:
    """Remove temp files of crashed runs and shards (with records) no longer in the manifest."""
    for p in out.iterdir():
        if p.name.startswith(".") and p.name.endswith(".tmp"):
            p.unlink(missing_ok=True)
        elif _SHARD_FILE.match(p.name) and p.name not in keep:
            p.unlink(missing_ok=True)
            (out / STATE_DIR / f"{p.name}.json").unlink(missing_ok=True)


def run_prepare(cfg: PrepConfig) -> dict[str, Any]:
    """Run the job described by `cfg`; write the corpus directory and return the summary dict."""
    t0 = time.time()
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)  # the manifest marks a finished corpus: written last
    entries, class_map = resolve_inputs(cfg, str(out / STATE_DIR))
    started = _ensure_ray(cfg)
    try:
        with _data_context(cfg):
            summary = _run(cfg, out, entries, class_map, t0)
    finally:
        if started:
            import ray

            ray.shutdown()
    print(format_summary(summary), file=sys.stderr if os.environ.get("DATA_PREP_SUMMARY_STDERR") else sys.stdout, flush=True)
    return summary


def _run(cfg: PrepConfig, out: Path, entries, class_map, t0: float) -> dict[str, Any]:
    from data_prep import stages
    from data_prep.tokenizer import tokenizer_info

    workers = _workers(cfg)
    ctx = _base_ctx(cfg)
    _clean_stale(out, keep={p.name for p in out.glob("*.tar")})  # temp files only
    stats = Stats()
    tok_info: dict[str, Any] | None = None
    out_per_in = 1.0
    if cfg.kind != "images":
        tok, ttype, sample_docs, sample_bytes = _prepare_tokenizer(cfg, entries, ctx, workers)
        tok_info = tokenizer_info(out, ttype)
        vocab = tok_info["vocab_size"]
        itemsize = 2 if vocab <= 65535 else 4
        specials = {n.removesuffix("_token"): i for n, i in tok_info["special_tokens"].items()}
        if cfg.kind == "bert_pairs" and not {"cls", "sep"} <= specials.keys():
            raise PrepError(f"The tokenizer in {out / 'tokenizer'} has no [CLS]/[SEP] tokens; bert_pairs needs a WordPiece (BERT) tokenizer.")
        if cfg.kind == "packed_lm" and "eos" not in specials:
            specials["eos"] = specials.get("sep", 0)
        ctx.update(tokenizer_json=tok.to_str(), tokenizer_sha256=tok_info["sha256"], special=specials,
                   token_dtype="uint16" if itemsize == 2 else "uint32")
        out_per_in = _out_bytes_per_input_byte(sample_docs, sample_bytes, ctx, tok)
        del sample_docs
    ctx["buckets"] = _plan_buckets(cfg, entries, out_per_in)
    ctx["fingerprint"] = hashlib.sha256(
        json.dumps([FORMAT_VERSION, manifest_config(cfg), tok_info and tok_info["sha256"], ctx["buckets"], class_map], sort_keys=True).encode()
    ).hexdigest()
    if cfg.clean.near_dedup and cfg.kind != "images":
        ctx["near_dups"] = _near_dups(cfg, entries, ctx, workers)

    prepare = stages.prepare_images if cfg.kind == "images" else stages.prepare_text
    ds = _dataset(entries, workers).map_batches(prepare, batch_size=None, batch_format="numpy", fn_kwargs={"ctx": ctx}, compute=_pool(workers))
    rows = ds.groupby("shard").map_groups(stages.build_shard, batch_format="numpy", fn_kwargs={"ctx": ctx}, compute=_pool(workers)).take_all()

    records = []
    for r in rows:
        result = json.loads(r["result"])
        if r["shard"] == "":
            stats.merge(Stats.from_dict(result))
        else:
            stats.merge(Stats.from_dict(result["stats"]))
            if result.get("samples"):
                records.append(result)
    _check_bad_share(stats, cfg, where=f"the sources {[p for s in cfg.sources for p in s.paths]}")
    if not records:
        raise PrepError(
            f"The job produced no samples from {[p for s in cfg.sources for p in s.paths]} (counts: {dict(stats.counts)}). "
            f"The documents may be too short for seq_len={cfg.seq_len} or all removed by cleaning; check the inputs and `clean`."
        )
    splits: dict[str, Any] = {}
    for rec in sorted(records, key=lambda r: r["name"]):
        split = rec["name"].split("-")[0]
        entry = splits.setdefault(split, {"shards": [], "samples": 0, "tokens": 0})
        entry["shards"].append({k: rec[k] for k in ("name", "samples", "tokens", "bytes", "sha256")})
        entry["samples"] += rec["samples"]
        entry["tokens"] += rec["tokens"]
    _clean_stale(out, keep={rec["name"] for rec in records})
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "kind": cfg.kind,
        "seq_len": cfg.seq_len if cfg.kind != "images" else None,
        "tokenizer": tok_info,
        "token_dtype": ctx.get("token_dtype"),
        "class_map": class_map,
        "prep_config": manifest_config(cfg),
        "splits": dict(sorted(splits.items())),
        "stats": stats.to_dict(),
    }
    write_manifest(out, manifest)
    return _summary(cfg, manifest, stats, time.time() - t0)


def _summary(cfg: PrepConfig, manifest: dict[str, Any], stats: Stats, wall: float) -> dict[str, Any]:
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
        "manifest": str(Path(cfg.output) / "manifest.json"),
    }
    if cfg.kind == "bert_pairs" and samples:
        summary["nsp_random_share"] = round(c.get("nsp_random", 0) / samples, 4)
    if cfg.kind == "packed_lm" and c.get("stream_tokens"):
        summary["tokens_kept_share"] = round(c.get("stream_tokens_kept", 0) / c["stream_tokens"], 5)
    return summary


def format_summary(s: dict[str, Any]) -> str:
    """The end-of-job table: documents in, removed per rule, samples, tokens, shards, MB, time."""
    rows: list[tuple[str, str]] = [("corpus", s["output"]), ("kind", s["kind"]), ("documents in", f"{s['documents_in']:,}")]
    rows += [(f"  removed: {k}", f"{v:,}") for k, v in s["removed"].items()]
    rows += [(f"  bad records: {k}", f"{v:,}") for k, v in s["bad"].items()]
    rows += [("documents kept", f"{s['documents_kept']:,}")]
    rows += [(f"samples ({k})", f"{v:,}") for k, v in s["samples"].items()]
    rows += [("tokens", f"{s['tokens']:,}"), ("shards", str(s["shards"])), ("size", f"{s['bytes'] / 1e6:,.1f} MB")]
    if "nsp_random_share" in s:
        rows.append(("NotNext share", f"{s['nsp_random_share']:.1%}"))
    if "tokens_kept_share" in s:
        rows.append(("tokens kept by packing", f"{s['tokens_kept_share']:.2%}"))
    rows += [("wall time", f"{s['wall_s']:.1f} s"), ("tokens/s", f"{s['tokens_per_s']:,.0f}")]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 2 + max(len(v) for _, v in rows))
    return "\n".join([line, *(f"{k.ljust(width)}  {v}" for k, v in rows), line])
