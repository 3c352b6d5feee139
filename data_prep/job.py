"""The data-preparation job: plan on the driver, do the work in Ray, finish with a manifest.

Stages (Ray tasks, see `tasks.py`): list inputs -> tokenizer sample (read + clean a
deterministic subset in Ray; train the tokenizer on it, or, for a reused tokenizer, only
estimate the shard bytes of a small sample inside the tasks) -> optional MinHash near-dedup
(Ray Data groupby) -> map tasks read + clean + tokenize balanced chunks of files (big files cut
into record-aligned ranges, `data_prep.ranges`) and route each
document by content hash to its shard's reduce group -> reduce tasks (a hash-partitioned
shuffle through Ray's object store, which co-locates exact duplicates) dedup and write their
shards -> the driver collects the small per-shard records and writes `manifest.json` last.
The driver never holds documents, only the tokenizer sample (when training) and summaries.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from core.config import to_dict
from core.corpus import SCHEMA_VERSION, SHARD_FILE_RE, write_manifest
from core.corpus_kinds import corpus_kind
from core.errors import Terminated
from data_prep.allocator import find_worker_malloc, worker_runtime_env
from data_prep.clean import Stats, lsh_params
from data_prep.config import PrepConfig, manifest_config
from data_prep.context import JobContext
from data_prep.errors import PrepError
from data_prep.output_guard import check_reused_tokenizer, claimed_corpus
from data_prep.ranges import range_bytes_for, split_entries
from data_prep.shards import STATE_DIR
from data_prep.sources import describe_where, resolve_inputs
from data_prep.summary import build_summary, classes_missing, format_summary, missing_classes_warning
from data_prep.task_pool import chunk_entries, run_limited

__all__ = ["run_prepare", "format_summary"]

FORMAT_VERSION = "3"  # bump when the bytes a config produces change, so stale shards are rebuilt
# 3: images stored at the release processor's geometry (raw: its eval view; resize_shorter bilinear)
_SHARD_FILE = SHARD_FILE_RE
_SIZING_SAMPLE_BYTES = 256_000  # input bytes read to size the shards when the tokenizer is reused
_SIZING_CHUNKS = 4  # Ray tasks of that estimate (fixed: the estimate must not depend on the workers)
_SIZING_RANGE_BYTES = _SIZING_SAMPLE_BYTES // _SIZING_CHUNKS  # big sample files are cut so (fixed, as above)
_MAP_INPUT_BYTES = 128_000_000  # input bytes per map task at most (more tasks on big corpora)
_REDUCE_INPUT_BYTES = 512_000_000  # input bytes behind one reduce task at most (bounds its memory)


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
def _sigterm_unwinds():
    """SIGTERM raises ``Terminated`` here: the job unwinds (Ray shut down, the CLI's one line, exit 143)
    instead of Ray's driver handler dumping its C++ stack; a rerun resumes from the finished shards."""
    def stop(signum: int, _frame: Any) -> None:
        raise Terminated(signum)

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


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


def _task(fn, cfg: PrepConfig):
    """`fn` as a one-CPU Ray task whose worker processes run with the configured allocator (`data_prep.allocator`)."""
    import ray

    return ray.remote(num_cpus=1, runtime_env=worker_runtime_env(cfg.worker_malloc))(fn)


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


def _base_ctx(cfg: PrepConfig) -> JobContext:
    d = to_dict(cfg)
    return JobContext(
        kind=cfg.kind, sources=d["sources"], clean=d["clean"], images=d["images"], seed=cfg.seed,
        seq_len=cfg.seq_len, short_seq_prob=cfg.short_seq_prob, nsp_random_prob=cfg.nsp_random_prob,
        dupe_factor=cfg.dupe_factor, validation_fraction=cfg.validation_fraction, output=str(Path(cfg.output).resolve()),
        job_id=uuid.uuid4().hex,
    )


def _sample_files(cfg: PrepConfig, entries, limit: int) -> tuple[list[dict[str, Any]], int]:
    """A deterministic sample of input files (seeded hash order) of at least `limit` bytes."""
    chosen, size = [], 0
    for e in _stable_order(entries, cfg.seed):
        if size >= limit:
            break
        chosen.append(e)
        size += e["size"]
    return chosen, size


def _read_sample(cfg: PrepConfig, chunks, ctx: JobContext, workers: int, estimate: bool,
                 where: str = "the tokenizer sample") -> tuple[Stats, dict[str, str], int, float]:
    """Run `sample_texts` over `chunks` in Ray: (stats, texts by hash, documents, estimated shard bytes);
    `where` names the sample in an error (the tokenizer's, or the one that sizes the shards)."""
    import ray

    from data_prep import stages

    remote = _task(stages.sample_texts, cfg)
    ctx_ref = ray.put(ctx)
    stats, docs, n_docs, out_bytes = Stats(), {}, 0, 0.0
    for ref in run_limited(remote, [(files, ctx_ref, estimate) for files in chunks], workers):
        part = ray.get(ref)
        stats.merge(Stats.from_dict(part["stats"]))
        docs.update(part["docs"])
        n_docs += part["documents"]
        out_bytes += part["shard_bytes"]
        del part
    _check_bad_share(stats, cfg, where=where)
    if not n_docs:
        raise PrepError(
            f"No document survived reading and cleaning in {[p for s in cfg.sources for p in s.paths]} "
            f"(counts: {dict(stats.counts)}). Check the source type/text_field, or lower clean.min_chars."
        )
    return stats, docs, n_docs, out_bytes


def _reuse_tokenizer(cfg: PrepConfig, out: Path, entries, ctx: JobContext, workers: int) -> tuple[dict[str, Any], float, JobContext]:
    """Install the configured tokenizer; size the shards from a small sample, estimated in Ray tasks.

    The sample (the leading ranges of fixed size of the seeded file order, so one big file is not
    read whole) is cut into a fixed number of chunks (not one per worker) so the estimate, hence
    the shard count and the bytes, do not depend on the number of workers or `input_range_mb`.
    """
    from data_prep.tokenizer import install_tokenizer, load_tokenizer_dir

    tok, ttype = load_tokenizer_dir(cfg.tokenizer.path)
    install_tokenizer(cfg.tokenizer.path, out / "tokenizer")
    tok_info, ctx = _tokenizer_ctx(cfg, out, tok, ttype, ctx)
    limit = min(cfg.tokenizer.sample_bytes, _SIZING_SAMPLE_BYTES)
    chosen, size = _leading_bytes(split_entries(_sample_files(cfg, entries, limit)[0], cfg.sources, _SIZING_RANGE_BYTES), limit)
    _, _, _, out_bytes = _read_sample(cfg, chunk_entries(chosen, _SIZING_CHUNKS), ctx, workers, estimate=True,
                                      where=f"the first {size} bytes read to size the shards")
    return tok_info, out_bytes / max(1, size), ctx


def _leading_bytes(pieces: list[dict[str, Any]], limit: int) -> tuple[list[dict[str, Any]], int]:
    """The first `pieces` (files or ranges, in order) that hold at least `limit` bytes: a big file is not read whole."""
    chosen, size = [], 0
    for p in pieces:
        if size >= limit:
            break
        chosen.append(p)
        size += p["size"]
    return chosen, size


def _train_tokenizer(cfg: PrepConfig, out: Path, entries, ctx: JobContext, workers: int) -> tuple[dict[str, Any], float, JobContext]:
    """Train the tokenizer on a deterministic sample read in Ray; size the shards from that sample."""
    from data_prep.tokenizer import save_tokenizer, train_tokenizer

    chosen, size = _sample_files(cfg, entries, cfg.tokenizer.sample_bytes)
    _, docs, _, _ = _read_sample(cfg, chunk_entries(_ranges(cfg, chosen, workers), 2 * workers), ctx, workers, estimate=False)
    texts, budget = [], cfg.tokenizer.sample_bytes
    for h in sorted(docs):
        texts.append(docs[h])
        budget -= len(docs[h])
        if budget <= 0:
            break
    tok = train_tokenizer(texts, cfg.tokenizer)
    del texts
    save_tokenizer(tok, out / "tokenizer", cfg.tokenizer.type, model_max_length=cfg.seq_len, lowercase=cfg.tokenizer.lowercase)
    tok_info, ctx = _tokenizer_ctx(cfg, out, tok, cfg.tokenizer.type, ctx)
    return tok_info, _out_bytes_per_input_byte(docs, size, ctx, tok), ctx


def _tokenizer_ctx(cfg: PrepConfig, out: Path, tok, ttype: str, ctx: JobContext) -> tuple[dict[str, Any], JobContext]:
    """Check the corpus tokenizer fits the kind; return its manifest entry and `ctx` with what workers need of it."""
    from data_prep.tokenizer import missing_separator_error, tokenizer_info

    tok_info = tokenizer_info(out, ttype, tok)
    specials = {n.removesuffix("_token"): i for n, i in tok_info["special_tokens"].items()}
    if cfg.kind == "bert_pairs" and not {"cls", "sep"} <= specials.keys():
        raise PrepError(f"The tokenizer {cfg.tokenizer.path or out / 'tokenizer'} has no [CLS]/[SEP] tokens; bert_pairs "
                        f"needs a WordPiece (BERT) tokenizer.")
    if cfg.kind == "packed_lm" and "eos" not in specials:
        if "sep" not in specials:  # never token 0 (often <pad>): the model would never see its end of text
            raise missing_separator_error(cfg.tokenizer.path or out / "tokenizer")
        specials["eos"] = specials["sep"]
    ctx = ctx.with_(tokenizer_json=tok.to_str(), tokenizer_sha256=tok_info["sha256"], special=specials,
                    token_dtype="uint16" if tok_info["vocab_size"] <= 65535 else "uint32")
    return tok_info, ctx


def _out_bytes_per_input_byte(docs: dict[str, str], sample_file_bytes: int, ctx: JobContext, tok) -> float:
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
    est = total * out_per_in if corpus_kind(cfg.kind).tokenized else total + 1536 * len(entries)
    target = cfg.shard_target_mb * 1e6
    val = cfg.validation_fraction
    return {"train": max(1, round(est * (1 - val) / target)), "validation": max(1, round(est * val / target))}


def _near_dups(cfg: PrepConfig, entries, ctx: JobContext, workers: int) -> frozenset[str]:
    from data_prep import stages

    bands, rows = lsh_params(cfg.clean.minhash_perms, cfg.clean.near_dedup_threshold)
    ctx = ctx.with_(lsh=(bands, rows))
    ds = _dataset(entries, workers).map_batches(stages.minhash_bands, batch_size=None, batch_format="numpy", fn_kwargs={"ctx": ctx}, compute=_pool(workers))
    out = ds.groupby("band").map_groups(stages.near_dup_group, batch_format="numpy", fn_kwargs={"ctx": ctx}).take_all()
    return frozenset(r["hash"] for r in out)


def _shuffle_and_write(cfg: PrepConfig, ctx: JobContext, entries, workers: int, stats: Stats,
                       stage_s: dict[str, float], task_s: dict[str, float]) -> list[dict[str, Any]]:
    """Map tasks (read, clean, tokenize, route) -> reduce tasks (dedup, build, write shards).

    Shards are dealt round-robin to `groups` reduce tasks; every map task returns one table per
    group, so each reduce task receives exactly its documents. Returns the non-empty shard records;
    fills `stage_s` (driver wall time per phase) and `task_s` (summed task time per step).
    """
    import ray

    t0 = time.perf_counter()

    from data_prep import stages

    names = sorted(f"{split}-{i:06d}" for split, n in ctx.buckets.items() for i in range(n))
    total_in = sum(e["size"] for e in entries)
    groups = min(len(names), max(4 * workers, math.ceil(total_in / _REDUCE_INPUT_BYTES)))
    ctx = ctx.with_(groups=groups, group_of={name: i % groups for i, name in enumerate(names)})
    ctx_ref = ray.put(ctx)
    chunks = chunk_entries(_ranges(cfg, entries, workers), max(4 * workers, math.ceil(total_in / _MAP_INPUT_BYTES)))
    mapper = _task(stages.map_text if corpus_kind(cfg.kind).tokenized else stages.map_images, cfg)
    verb = "tokenize" if corpus_kind(cfg.kind).tokenized else "decode"
    show = f"read + {verb}" if cfg.progress else ""
    mapped = run_limited(mapper, [(files, ctx_ref) for files in chunks], workers, num_returns=groups + 1, progress=show)
    for refs in mapped:
        part = ray.get(refs[0])
        _add_seconds(task_s, part.pop("seconds", {}))
        stats.merge(Stats.from_dict(part))
    stage_s["map: read, clean, tokenize, route" if verb == "tokenize" else "map: read, decode, route"] = time.perf_counter() - t0
    t0 = time.perf_counter()

    reducer = _task(stages.reduce_group, cfg)
    calls = [(ctx_ref, names[g::groups], *[refs[g + 1] for refs in mapped]) for g in range(groups)]

    def release(g: int) -> None:  # a group's tables leave the object store once its shards are written
        calls[g] = ()
        for refs in mapped:
            refs[g + 1] = None

    done = run_limited(reducer, calls, workers, progress="write shards" if cfg.progress else "", on_done=release)
    records = []
    for ref in done:
        for rec in ray.get(ref):
            _add_seconds(task_s, rec.pop("seconds", {}))
            stats.merge(Stats.from_dict(rec["stats"]))
            if rec.get("samples"):
                records.append(rec)
    stage_s["reduce: shuffle, build, write"] = time.perf_counter() - t0
    return records


def _ranges(cfg: PrepConfig, entries, workers: int) -> list[dict[str, Any]]:
    """`entries` with big files split into ranges (`data_prep.ranges`): the documents, hence the bytes, stay the same."""
    if not corpus_kind(cfg.kind).tokenized:
        return list(entries)
    return split_entries(entries, cfg.sources, range_bytes_for(cfg.input_range_mb, sum(e["size"] for e in entries), workers))


def _add_seconds(total: dict[str, float], part: dict[str, float]) -> None:
    for k, v in part.items():
        total[k] = total.get(k, 0.0) + float(v)


def _check_bad_share(stats: Stats, cfg: PrepConfig, where: str) -> None:
    bad, good = stats.bad_records, stats.counts.get("documents_in", 0)
    if bad and bad / (bad + good) > cfg.max_bad_fraction:
        worst = sorted(stats.bad_by_file.items(), key=lambda kv: -sum(kv[1].values()))[:5]
        listing = "; ".join(f"{p}: {dict(r)}{_first_bad(stats, p)}" for p, r in worst)
        fields = sorted({s.text_field for s in cfg.sources if s.type != "text"})  # missing_field: likely the config's
        field = (f"missing_field: no string under text_field={'/'.join(fields)}; if the records keep their text under "
                 f"another key, set sources[].text_field to it. " if stats.counts.get("bad.missing_field") else "")
        raise PrepError(
            f"{bad} of {bad + good} input records in {where} are bad ({bad / (bad + good):.1%} > max_bad_fraction="
            f"{cfg.max_bad_fraction}). Worst files: {listing}. {field}Fix or remove these files, or raise max_bad_fraction."
        )


def _first_bad(stats: Stats, path: str) -> str:
    where = stats.first_bad.get(path)
    return f" (the first at {describe_where(path, where)})" if where else ""


def _clean_stale(out: Path, keep: set[str]) -> None:
    """Remove temp files of crashed runs and shards (with records) no longer in the manifest."""
    for p in out.iterdir():
        if p.name.startswith(".") and p.name.endswith(".tmp"):
            p.unlink(missing_ok=True)
        elif _SHARD_FILE.match(p.name) and p.name.replace(".idx.npy", ".tar") not in keep:
            p.unlink(missing_ok=True)
            (out / STATE_DIR / f"{p.name}.json").unlink(missing_ok=True)


def run_prepare(cfg: PrepConfig) -> dict[str, Any]:
    """Run the job described by `cfg`; write the corpus directory and return the summary dict."""
    t0 = time.time()
    out = Path(cfg.output)
    find_worker_malloc(cfg.worker_malloc)  # a wrong path fails here, before anything is written
    check_reused_tokenizer(cfg)  # likewise a damaged or unfitting tokenizer.path, named as the user gave it
    # ours (its marker) for this config, or new; never a user's folder; removed again if bad input stops this run
    with claimed_corpus(cfg, out):
        entries, class_map = resolve_inputs(cfg, str(out / STATE_DIR))  # bad inputs fail before a finished corpus is touched
        (out / "manifest.json").unlink(missing_ok=True)  # the manifest marks a finished corpus: written last
        started = _ensure_ray(cfg)
        try:
            with _data_context(cfg), _sigterm_unwinds():
                summary = _run(cfg, out, entries, class_map, t0)
        finally:
            if started:
                import ray

                ray.shutdown()
    print(format_summary(summary), flush=True)
    if warning := missing_classes_warning(summary):
        print(warning, file=sys.stderr, flush=True)
    return summary


def _run(cfg: PrepConfig, out: Path, entries, class_map, t0: float) -> dict[str, Any]:
    workers = _workers(cfg)
    ctx = _base_ctx(cfg)
    _clean_stale(out, keep={p.name for p in out.glob("*.tar")})  # temp files only
    stats = Stats()
    stage_s: dict[str, float] = {"list inputs, start Ray": time.time() - t0}
    task_s: dict[str, float] = {}
    tok_info: dict[str, Any] | None = None
    out_per_in = 1.0
    t1 = time.perf_counter()
    if corpus_kind(cfg.kind).tokenized:
        prepare = _reuse_tokenizer if cfg.tokenizer.path else _train_tokenizer
        tok_info, out_per_in, ctx = prepare(cfg, out, entries, ctx, workers)
        stage_s["tokenizer: sample, " + ("size shards" if cfg.tokenizer.path else "train")] = time.perf_counter() - t1
    buckets = _plan_buckets(cfg, entries, out_per_in)
    ctx = ctx.with_(buckets=buckets, fingerprint=hashlib.sha256(
        json.dumps([FORMAT_VERSION, manifest_config(cfg), tok_info and tok_info["sha256"], buckets, class_map], sort_keys=True).encode()
    ).hexdigest())
    if cfg.clean.near_dedup and corpus_kind(cfg.kind).tokenized:
        t1 = time.perf_counter()
        ctx = ctx.with_(near_dups=_near_dups(cfg, entries, ctx, workers))
        stage_s["near-dedup (MinHash)"] = time.perf_counter() - t1

    records = _shuffle_and_write(cfg, ctx, entries, workers, stats, stage_s, task_s)
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
        entry["shards"].append({k: rec[k] for k in ("name", "samples", "tokens", "bytes", "sha256", "index")})
        entry["samples"] += rec["samples"]
        entry["tokens"] += rec["tokens"]
    _clean_stale(out, keep={rec["name"] for rec in records})
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "kind": cfg.kind,
        "seq_len": cfg.seq_len if corpus_kind(cfg.kind).tokenized else None,
        "tokenizer": tok_info,
        "token_dtype": ctx.token_dtype,
        "class_map": class_map,
        "prep_config": manifest_config(cfg),
        **corpus_kind(cfg.kind).manifest_fields(manifest_config(cfg)),
        "splits": dict(sorted(splits.items())),
        "stats": stats.to_dict(),
    }
    write_manifest(out, manifest)
    summary = build_summary(cfg, manifest, stats, time.time() - t0)
    if class_map and cfg.validation_fraction > 0:
        summary["classes_missing"] = classes_missing(records, class_map)
    summary["stages_s"] = {k: round(v, 2) for k, v in stage_s.items()}
    summary["task_s"] = {k: round(v, 2) for k, v in task_s.items()}
    return summary
