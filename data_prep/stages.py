"""The functions Ray runs in its workers: sample reading, the map side (read + clean + tokenize a
chunk of files, route documents to reduce groups) and the reduce side (dedup, build, write shards).

Everything a worker needs arrives in a typed `ctx` (`data_prep.context.JobContext`: configs as
dicts, the tokenizer as its JSON text) so the code runs unchanged on a laptop or a cluster. Output of a shard depends only
on the set of documents routed to it (sorted by content hash), the seed and the shard name, never
on how the work was split into tasks: that is what makes 1 and N workers write identical bytes.
Hot paths work on whole batches (one `encode_batch` per ~4 M characters, token arrays built
with numpy, tar headers built directly) rather than per token or per sample in Python.
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from collections.abc import Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from itertools import accumulate, chain
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from core.records import token_records
from data_prep.bert_pairs import create_pairs, split_sentences
from data_prep.clean import Stats, band_keys, clean_text, doc_hash, minhash_signature
from data_prep.config import CleanConfig, ImageConfig, SourceConfig
from data_prep.context import JobContext
from data_prep.images import BadImage, process_image
from data_prep.packing import pack_windows
from data_prep.shards import commit_shard, load_record, save_record, write_shard_tmp
from data_prep.sources import iter_text_records

TEXT_SCHEMA = pa.schema([("shard", pa.string()), ("hash", pa.string()), ("tokens", pa.binary()), ("sents", pa.binary())])
IMAGE_SCHEMA = pa.schema([("shard", pa.string()), ("hash", pa.string()), ("data", pa.binary()), ("ext", pa.string()), ("label", pa.int64())])
_CHUNK_CHARS = 4_000_000  # characters of text per `encode_batch` call (big batches, bounded memory)

_TOKENIZERS: dict[tuple[str, str | None], Any] = {}


def _tokenizer(ctx: JobContext):
    """The job's tokenizer, built once per worker process and job (a fresh BPE cache per job)."""
    key = (ctx.tokenizer_sha256, ctx.job_id)
    if key not in _TOKENIZERS:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one worker = one core; Ray does the parallelism
        from tokenizers import Tokenizer

        _TOKENIZERS.clear()
        _TOKENIZERS[key] = Tokenizer.from_str(ctx.tokenizer_json)
    return _TOKENIZERS[key]


def route(h: str, ctx: JobContext) -> str:
    """Shard of a document: the split from the first 8 hex digits of its hash, the bucket from the next 8."""
    split = "validation" if int(h[:8], 16) / 0x1_0000_0000 < ctx.validation_fraction else "train"
    return f"{split}-{int(h[8:16], 16) % ctx.buckets[split]:06d}"


def _iter_clean_docs(files: list[dict[str, Any]], ctx: JobContext, stats: Stats) -> Iterator[tuple[str, str]]:
    """(hash, cleaned text) of every document in `files` (entries); bad records go to `stats`."""
    clean_cfg = CleanConfig(**ctx.clean)
    sources = [SourceConfig(**s) for s in ctx.sources]
    for entry in files:
        path = str(entry["path"])
        for text, rule in iter_text_records(path, sources[int(entry["source"])]):
            if text is None:
                stats.bad(path, rule)
                continue
            stats.add("documents_in")
            cleaned = clean_text(text, clean_cfg, stats)
            if cleaned is not None:
                yield doc_hash(cleaned), cleaned


def sample_texts(files: list[dict[str, Any]], ctx: JobContext, estimate: bool = False) -> dict[str, Any]:
    """Read stage of the tokenizer sample: cleaned texts by hash, no tokenization.

    With `estimate` (the tokenizer is already in `ctx`) the texts stay here: the task returns
    only the shard bytes the real sample builder makes from them (to size the shards).
    """
    stats = Stats()
    docs = dict(_iter_clean_docs(files, ctx, stats))
    shard_bytes = estimate_shard_bytes(docs, ctx, _tokenizer(ctx)) if estimate and docs else 0.0
    return {"docs": {} if estimate else docs, "documents": len(docs), "shard_bytes": shard_bytes, "stats": stats.to_dict()}


def tokenize_docs(texts: list[str], tok, dtype: np.dtype, kind: str) -> tuple[list[bytes], list[bytes]]:
    """Token bytes per document, and (BERT) the int32 token count of each of its sentences.

    One `encode_batch_fast` call for the whole list, then one flat numpy array built from all
    ids at once and sliced per document (no per-token Python).
    """
    if kind == "bert_pairs":
        sentences = [split_sentences(t) for t in texts]
        pieces = [s for doc in sentences for s in doc]
        per_doc = np.fromiter((len(doc) for doc in sentences), dtype=np.int64, count=len(sentences))
    else:
        pieces, per_doc = texts, np.ones(len(texts), dtype=np.int64)
    ids = [e.ids for e in tok.encode_batch_fast(pieces, add_special_tokens=False)] if pieces else []
    piece_len = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(chain.from_iterable(ids), dtype=dtype, count=int(piece_len.sum()))
    piece_end = np.concatenate([[0], np.cumsum(piece_len)])
    doc_end = np.concatenate([[0], np.cumsum(per_doc)])
    tok_bounds = piece_end[doc_end].tolist()
    tokens = [flat[a:b].tobytes() for a, b in zip(tok_bounds[:-1], tok_bounds[1:], strict=True)]
    if kind != "bert_pairs":
        return tokens, [b""] * len(tokens)
    lens = piece_len.astype("<i4")
    bounds = doc_end.tolist()
    return tokens, [lens[a:b].tobytes() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def estimate_shard_bytes(docs: dict[str, str], ctx: JobContext, tok) -> float:
    """Tar bytes the real sample builder makes from `docs` (a small sample): sizes the shards."""
    dtype = np.dtype(ctx.token_dtype).newbyteorder("<")
    hashes = sorted(docs)
    tokens, sents = tokenize_docs([docs[h] for h in hashes], tok, dtype, ctx.kind)
    rows = [{"hash": h, "tokens": t, "sents": s} for h, t, s in zip(hashes, tokens, sents, strict=True)]
    counts: dict[str, int] = {"tokens": 0, "nsp_random": 0}
    samples = _bert_samples(rows, ctx, "estimate", counts) if ctx.kind == "bert_pairs" else _packed_samples(rows, ctx, counts)
    return float(sum(512 + -(-len(v) // 512) * 512 for _, members, _ in _records(samples, ctx, "estimate") for v in members.values()))


def _by_group(columns: dict[str, list], schema: pa.Schema, ctx: JobContext) -> list[pa.Table]:
    """One Arrow table per reduce group (`ctx.group_of` maps a shard name to its group)."""
    group_of = ctx.group_of
    rows_of: list[list[int]] = [[] for _ in range(ctx.groups)]
    for i, shard in enumerate(columns["shard"]):
        rows_of[group_of[shard]].append(i)
    return [pa.table({c: [columns[c][i] for i in rows] for c in schema.names}, schema=schema) for rows in rows_of]


def map_text(files: list[dict[str, Any]], ctx: JobContext) -> list[Any]:
    """Map side of the shuffle: read, clean, hash, route and tokenize the documents of `files`.

    Returns `[stats, table for group 0, table for group 1, ...]` (a Ray task with
    `num_returns = groups + 1`). Texts are tokenized in big batches (`_CHUNK_CHARS`).
    """
    tok = _tokenizer(ctx)
    dtype = np.dtype(ctx.token_dtype).newbyteorder("<")
    near_dups = ctx.near_dups
    stats = Stats()
    columns: dict[str, list] = {name: [] for name in TEXT_SCHEMA.names}
    pending: list[tuple[str, str]] = []
    pending_chars = 0

    seconds = {"read_clean": 0.0, "tokenize": 0.0}

    def flush() -> None:
        t0 = time.perf_counter()
        tokens, sents = tokenize_docs([t for _, t in pending], tok, dtype, ctx.kind)
        seconds["tokenize"] += time.perf_counter() - t0
        columns["hash"].extend(h for h, _ in pending)
        columns["shard"].extend(route(h, ctx) for h, _ in pending)
        columns["tokens"].extend(tokens)
        columns["sents"].extend(sents)
        pending.clear()

    t_start = time.perf_counter()
    for h, text in _iter_clean_docs(files, ctx, stats):
        if h in near_dups:
            stats.add("removed.near_duplicate")
            continue
        pending.append((h, text))
        pending_chars += len(text)
        if pending_chars >= _CHUNK_CHARS:
            flush()
            pending_chars = 0
    if pending:
        flush()
    seconds["read_clean"] = time.perf_counter() - t_start - seconds["tokenize"]
    return [{**stats.to_dict(), "seconds": seconds}, *_by_group(columns, TEXT_SCHEMA, ctx)]


def map_images(files: list[dict[str, Any]], ctx: JobContext) -> list[Any]:
    """Map side for images: read, decode, resize and re-encode; unreadable ones are counted per file."""
    cfg = ImageConfig(**ctx.images)
    stats = Stats()
    columns: dict[str, list] = {name: [] for name in IMAGE_SCHEMA.names}
    for entry in files:
        path = str(entry["path"])
        try:
            raw = Path(path).read_bytes()
            data, ext, _, _ = process_image(raw, cfg)
        except (OSError, BadImage):
            stats.bad(path, "unreadable_image")
            continue
        stats.add("documents_in")
        h = hashlib.sha256(raw).hexdigest()
        for name, value in zip(IMAGE_SCHEMA.names, (route(h, ctx), h, data, ext, int(entry["label"])), strict=True):
            columns[name].append(value)
    return [stats.to_dict(), *_by_group(columns, IMAGE_SCHEMA, ctx)]


# ------------------------------------------------------------------------------------------
# Near-duplicate candidates: MinHash per document, LSH bands grouped by the Ray shuffle
# ------------------------------------------------------------------------------------------


def minhash_bands(batch: dict[str, np.ndarray], ctx: JobContext) -> Iterator[pa.Table]:
    c = ctx.clean
    rows: dict[str, list] = {"band": [], "hash": [], "sig": []}
    seen: set[str] = set()
    files = [{"path": str(p), "source": int(s)} for p, s in zip(batch["path"], batch["source"], strict=True)]
    for h, text in _iter_clean_docs(files, ctx, Stats()):
        if h in seen:
            continue
        seen.add(h)
        sig = minhash_signature(text, c["minhash_perms"], c["shingle_words"])
        for key in band_keys(sig, *ctx.lsh):
            rows["band"].append(key)
            rows["hash"].append(h)
            rows["sig"].append(sig)
    yield pa.table(rows, schema=pa.schema([("band", pa.string()), ("hash", pa.string()), ("sig", pa.binary())]))


def near_dup_group(group: dict[str, np.ndarray], ctx: JobContext) -> dict[str, list]:
    """Documents of one LSH bucket similar to the bucket's smallest hash (which is kept)."""
    docs = dict(sorted({str(h): bytes(s) for h, s in zip(group["hash"], group["sig"], strict=True)}.items()))
    if len(docs) < 2:
        return {"hash": []}
    (keep_hash, keep_sig), *others = docs.items()
    ref = np.frombuffer(keep_sig, dtype="<u8")
    threshold = ctx.clean["near_dedup_threshold"]
    return {"hash": [h for h, s in others if float(np.mean(np.frombuffer(s, dtype="<u8") == ref)) >= threshold]}


# ------------------------------------------------------------------------------------------
# One shard per group
# ------------------------------------------------------------------------------------------


def _rng(ctx: JobContext, name: str) -> random.Random:
    return random.Random(int(hashlib.sha256(f"{ctx.seed}:{name}".encode()).hexdigest()[:16], 16))


def _bert_samples(rows: list[dict[str, Any]], ctx: JobContext, name: str, counts: dict[str, int]):
    """`(input_ids, len_a, len_b, next_sentence_label)` per NSP pair of the shard's documents."""
    dtype = np.dtype(ctx.token_dtype).newbyteorder("<")
    docs = []
    for r in rows:  # sentences as Python lists: the pair builder works on lists of ints
        tokens = np.frombuffer(r["tokens"], dtype=dtype).tolist()
        bounds = list(accumulate(np.frombuffer(r["sents"], dtype="<i4").tolist(), initial=0))
        docs.append([tokens[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
    rng = _rng(ctx, name)
    sp = ctx.special
    for _ in range(ctx.dupe_factor):
        for k in range(len(rows)):
            pairs = create_pairs(
                docs, k, max_seq_len=ctx.seq_len, cls_id=sp["cls"], sep_id=sp["sep"], rng=rng,
                short_seq_prob=ctx.short_seq_prob, random_next_prob=ctx.nsp_random_prob, dtype=dtype,
            )
            for pair in pairs:
                counts["tokens"] += len(pair[0])
                counts["nsp_random"] += pair[3]
                yield pair


def _packed_samples(rows: list[dict[str, Any]], ctx: JobContext, counts: dict[str, int]):
    """The shard's packed windows (arrays of seq_len + 1 tokens)."""
    dtype = np.dtype(ctx.token_dtype).newbyteorder("<")
    docs = [np.frombuffer(r["tokens"], dtype=dtype) for r in rows]
    windows, kept = pack_windows(docs, ctx.special["eos"], ctx.seq_len)
    for _, window in windows:
        counts["tokens"] += len(window)
        yield window
    counts["stream_tokens"] = kept["total"]
    counts["stream_tokens_kept"] = kept["kept"]


def _records(samples, ctx: JobContext, name: str):
    """Format-2 records of a shard's token samples (see `core.records`)."""
    dtype = np.dtype(ctx.token_dtype).newbyteorder("<")
    return token_records(ctx.kind, samples, name, seq_len=ctx.seq_len, token_dtype=dtype)


def _image_samples(rows: list[dict[str, Any]], counts: dict[str, int]):
    for r in rows:
        yield f"{r['hash'][:16]}-000000", {r["ext"]: r["data"], "cls": str(r["label"]).encode()}


def reduce_group(ctx: JobContext, names: list[str], *parts: pa.Table) -> list[dict[str, Any]]:
    """Reduce side of the shuffle: the shards `names` from their tables of every map task.

    Rows are sorted by (shard, hash), so exact duplicates (same content hash) are adjacent and a
    shard's documents are in hash order whatever map task they came from. Each finished shard
    is fsynced, renamed and recorded in a background thread while the next one is built.
    """
    t0 = time.perf_counter()
    tables = [t for t in parts if t.num_rows]
    if not tables:
        return []
    table = pa.concat_tables(tables).sort_by([("shard", "ascending"), ("hash", "ascending")])
    shuffle_s = time.perf_counter() - t0
    del tables, parts
    shard_col = table.column("shard").to_pylist()
    futures = []
    with ThreadPoolExecutor(max_workers=1) as committer:
        begin = 0
        for end in range(1, len(shard_col) + 1):
            if end == len(shard_col) or shard_col[end] != shard_col[begin]:
                futures.append(build_shard(shard_col[begin], table.slice(begin, end - begin), ctx, committer))
                begin = end
        records = [f.result() for f in futures]
    if records:  # per-task timing rides on the first record (the summary sums them; never in the manifest)
        records[0] = {**records[0], "seconds": {"shuffle": shuffle_s, "build_write": time.perf_counter() - t0 - shuffle_s}}
    return records


def build_shard(name: str, group: pa.Table, ctx: JobContext, committer: Executor) -> Future:
    """Dedup one shard's documents (sorted by hash: exact duplicates are adjacent) and write it.

    Returns a future of the shard's record; `committer` makes the shard final and saves the record.
    """
    stats = Stats()
    rows: list[dict[str, Any]] = []
    dedup = ctx.clean["dedup"]
    for row in group.drop_columns(["shard"]).to_pylist():
        if dedup and rows and rows[-1]["hash"] == row["hash"]:
            stats.add("removed.exact_duplicate")
            continue
        rows.append(row)
    fingerprint = hashlib.sha256((ctx.fingerprint + name + "".join(r["hash"] for r in rows)).encode()).hexdigest()
    out_dir = ctx.output
    record = load_record(out_dir, f"{name}.tar", fingerprint)
    if record is not None:
        return committer.submit(lambda: record)
    counts: dict[str, int] = {"tokens": 0, "nsp_random": 0}
    if ctx.kind == "bert_pairs":
        samples = _records(_bert_samples(rows, ctx, name, counts), ctx, name)
    elif ctx.kind == "packed_lm":
        samples = _records(_packed_samples(rows, ctx, counts), ctx, name)
    else:
        samples = _image_samples(rows, counts)
    path = Path(out_dir) / f"{name}.tar"
    tmp, info = write_shard_tmp(path, samples)
    for key in ("nsp_random", "stream_tokens", "stream_tokens_kept"):
        if key in counts:
            stats.add(key, counts[key])
    stats.add("documents_kept", len(rows))
    record = {"name": f"{name}.tar", "fingerprint": fingerprint, "tokens": counts["tokens"], "stats": stats.to_dict(), **info}

    def commit() -> dict[str, Any]:
        if info["samples"] == 0:  # every document was too short to make a sample: no empty shard
            tmp.unlink()
            record.pop("index_rows", None)
        else:
            commit_shard(tmp, path, record)
        save_record(out_dir, f"{name}.tar", record)
        return record

    return committer.submit(commit)
