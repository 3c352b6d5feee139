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
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from itertools import accumulate, chain, pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from core.corpus_kinds import corpus_kind
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
    """Shard of a document: the split from the first 8 hex digits of its hash, the bucket from the next 8.

    The rule stated per document; the map tasks apply it to a whole batch with `route_codes`."""
    split = "validation" if int(h[:8], 16) / 0x1_0000_0000 < ctx.validation_fraction else "train"
    return f"{split}-{int(h[8:16], 16) % ctx.buckets[split]:06d}"


def _iter_clean_docs(files: list[dict[str, Any]], ctx: JobContext, stats: Stats) -> Iterator[tuple[str, str]]:
    """(hash, cleaned text) of every document in `files` (entries, or ranges of files); bad records go to `stats`."""
    clean_cfg = CleanConfig(**ctx.clean)
    sources = [SourceConfig(**s) for s in ctx.sources]
    for entry in files:
        path = str(entry["path"])
        for text, rule, at in iter_text_records(path, sources[int(entry["source"])], entry.get("span")):
            if text is None:
                stats.bad(path, rule, at=at)
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


def tokenize_flat(texts: list[str], tok, dtype: np.dtype, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """All documents' tokens in one flat array, with per-document bounds (no per-token Python).

    Returns ``(tokens, token_bounds, sentence_lengths, sentence_bounds)``: document ``i`` is
    ``tokens[token_bounds[i]:token_bounds[i + 1]]``; for ``bert_pairs`` its sentences' token counts
    (int32) are ``sentence_lengths[sentence_bounds[i]:sentence_bounds[i + 1]]`` (empty otherwise).
    One `encode_batch_fast` call for the whole list.
    """
    sentence_wise = corpus_kind(kind).sentences
    if sentence_wise:
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
    if not sentence_wise:
        return flat, piece_end[doc_end], np.zeros(0, dtype="<i4"), np.zeros(len(texts) + 1, dtype=np.int64)
    return flat, piece_end[doc_end], piece_len.astype("<i4"), doc_end


def tokenize_docs(texts: list[str], tok, dtype: np.dtype, kind: str) -> tuple[list[bytes], list[bytes]]:
    """Token bytes per document, and (BERT) the int32 token count of each of its sentences."""
    flat, bounds, lens, sent_bounds = tokenize_flat(texts, tok, dtype, kind)
    tokens = [flat[a:b].tobytes() for a, b in pairwise(bounds.tolist())]
    if not corpus_kind(kind).sentences:
        return tokens, [b""] * len(tokens)
    return tokens, [lens[a:b].tobytes() for a, b in pairwise(sent_bounds.tolist())]


def estimate_shard_bytes(docs: dict[str, str], ctx: JobContext, tok) -> float:
    """Tar bytes the real sample builder makes from `docs` (a small sample): sizes the shards."""
    dtype = np.dtype(ctx.token_dtype).newbyteorder("<")
    hashes = sorted(docs)
    tokens, sents = tokenize_docs([docs[h] for h in hashes], tok, dtype, ctx.kind)
    rows = [{"hash": h, "tokens": t, "sents": s} for h, t, s in zip(hashes, tokens, sents, strict=True)]
    counts: dict[str, int] = {"tokens": 0, "nsp_random": 0}
    samples = _shard_samples(rows, ctx, "estimate", counts)
    return float(sum(512 + -(-len(v) // 512) * 512 for _, members, _ in samples for v in members.values()))


_HEX_VALUE = np.zeros(256, dtype=np.uint64)
_HEX_VALUE[np.frombuffer(b"0123456789abcdef", dtype=np.uint8)] = np.arange(16, dtype=np.uint64)
_HEX_WEIGHT = np.uint64(16) ** np.arange(7, -1, -1, dtype=np.uint64)


def route_codes(hashes: list[str], ctx: JobContext) -> tuple[np.ndarray, list[str]]:
    """`route` for many hashes at once: (index of each document's shard in `names`, `names`).

    The same rule as `route` (split from hex digits 0-8, bucket from 8-16), on a numpy view of the
    hashes instead of two `int(.., 16)` and a format per document.
    """
    names = [f"{split}-{b:06d}" for split in ("train", "validation") for b in range(ctx.buckets.get(split, 0))]
    if not hashes:
        return np.zeros(0, dtype=np.int64), names
    digits = _HEX_VALUE[np.frombuffer("".join(h[:16] for h in hashes).encode("ascii"), dtype=np.uint8).reshape(-1, 16)]
    split_key, bucket_key = digits[:, :8] @ _HEX_WEIGHT, digits[:, 8:] @ _HEX_WEIGHT
    validation = split_key / 0x1_0000_0000 < ctx.validation_fraction
    train_n, val_n = ctx.buckets.get("train", 0), ctx.buckets.get("validation", 0)
    codes = np.where(validation, train_n + bucket_key % max(val_n, 1), bucket_key % max(train_n, 1)).astype(np.int64)
    if (validation & (val_n == 0)).any() or (~validation & (train_n == 0)).any():
        raise KeyError("a document routes to a split without shards")  # as `route` would, via ctx.buckets[split]
    return codes, names


def _binary_array(flat: np.ndarray, bounds: np.ndarray) -> pa.Array:
    """Arrow (large) binary array whose item i is ``flat[bounds[i]:bounds[i + 1]]``'s bytes, without copying per item."""
    offsets = (bounds * flat.dtype.itemsize).astype(np.int64)
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(bounds) - 1,
                                            [None, pa.py_buffer(offsets), pa.py_buffer(np.ascontiguousarray(flat).view(np.uint8))])


def _group_tables(hashes: list[str], columns: dict[str, pa.Array], schema: pa.Schema, ctx: JobContext) -> list[pa.Table]:
    """One `schema` table per reduce group (`ctx.group_of`), rows in document order, built column-wise:
    the `shard` and `hash` columns come from `hashes` (`route_codes`), the others from `columns`."""
    codes, names = route_codes(hashes, ctx)
    group_of = np.array([ctx.group_of[n] for n in names], dtype=np.int64)
    groups = group_of[codes] if len(codes) else np.zeros(0, dtype=np.int64)
    order = np.argsort(groups, kind="stable")
    starts = np.searchsorted(groups[order], np.arange(ctx.groups + 1))
    columns = {"shard": pa.array(names, pa.string()).take(pa.array(codes)), "hash": pa.array(hashes, pa.string()), **columns}
    tables = []
    for g in range(ctx.groups):
        rows = pa.array(order[starts[g]: starts[g + 1]])
        tables.append(pa.table({c: columns[c].take(rows).cast(schema.field(c).type) for c in schema.names}, schema=schema))
    return tables


def map_text(files: list[dict[str, Any]], ctx: JobContext) -> list[Any]:
    """Map side of the shuffle: read, clean, hash, route and tokenize the documents of `files`.

    Returns `[stats, table for group 0, table for group 1, ...]` (a Ray task with
    `num_returns = groups + 1`). Texts are tokenized in big batches (`_CHUNK_CHARS`).
    """
    tok = _tokenizer(ctx)
    dtype = np.dtype(ctx.token_dtype).newbyteorder("<")
    near_dups = ctx.near_dups
    stats = Stats()
    hashes: list[str] = []
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    pending: list[str] = []
    pending_chars = 0

    seconds = {"read_clean": 0.0, "tokenize": 0.0}

    def flush() -> None:
        t0 = time.perf_counter()
        parts.append(tokenize_flat(pending, tok, dtype, ctx.kind))
        seconds["tokenize"] += time.perf_counter() - t0
        pending.clear()

    t_start = time.perf_counter()
    for h, text in _iter_clean_docs(files, ctx, stats):
        if h in near_dups:
            stats.add("removed.near_duplicate")
            continue
        hashes.append(h)
        pending.append(text)
        pending_chars += len(text)
        if pending_chars >= _CHUNK_CHARS:
            flush()
            pending_chars = 0
    if pending:
        flush()
    seconds["read_clean"] = time.perf_counter() - t_start - seconds["tokenize"]
    tokens = _binary_array(*_concat_bounds([(p[0], p[1]) for p in parts], dtype))
    sents = _binary_array(*_concat_bounds([(p[2], p[3]) for p in parts], np.dtype("<i4")))
    return [{**stats.to_dict(), "seconds": seconds}, *_group_tables(hashes, {"tokens": tokens, "sents": sents}, TEXT_SCHEMA, ctx)]


def _concat_bounds(parts: list[tuple[np.ndarray, np.ndarray]], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Join (flat, bounds) pieces into one flat array and one bounds array (bounds shifted by the pieces before)."""
    if not parts:
        return np.zeros(0, dtype=dtype), np.zeros(1, dtype=np.int64)
    shifts = np.cumsum([0] + [len(flat) for flat, _ in parts[:-1]])
    bounds = np.concatenate([parts[0][1][:1]] + [b[1:] + shift for (_, b), shift in zip(parts, shifts, strict=True)])
    return np.concatenate([flat for flat, _ in parts]).astype(dtype, copy=False), bounds


def map_images(files: list[dict[str, Any]], ctx: JobContext) -> list[Any]:
    """Map side for images: read, decode, resize and re-encode; unreadable ones are counted per file."""
    cfg = ImageConfig(**ctx.images)
    stats = Stats()
    hashes: list[str] = []
    columns: dict[str, list] = {"data": [], "ext": [], "label": []}
    for entry in files:
        path = str(entry["path"])
        try:
            raw = Path(path).read_bytes()
            data, ext, _, _ = process_image(raw, cfg)
        except (OSError, BadImage) as exc:
            stats.bad(path, getattr(exc, "rule", "unreadable_image"))
            continue
        stats.add("documents_in")
        hashes.append(hashlib.sha256(raw).hexdigest())
        for name, value in zip(columns, (data, ext, int(entry["label"])), strict=True):
            columns[name].append(value)
    arrays = {name: pa.array(values, IMAGE_SCHEMA.field(name).type) for name, values in columns.items()}
    return [stats.to_dict(), *_group_tables(hashes, arrays, IMAGE_SCHEMA, ctx)]


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


def _packed_samples(rows: list[dict[str, Any]], ctx: JobContext, name: str, counts: dict[str, int]):
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


def _image_samples(rows: list[dict[str, Any]], ctx: JobContext, name: str, counts: dict[str, int]):
    """One record per image: its encoded bytes and its class (``core.corpus_kinds.Images``)."""
    for r in rows:
        yield f"{r['hash'][:16]}-000000", {r["ext"]: r["data"], "cls": str(r["label"]).encode()}


#: corpus kind -> the builder of a shard's samples from its rows (the kind's class in ``core.corpus_kinds``
#: says how they are stored: token kinds in format-2 records, images one record each).
SAMPLE_BUILDERS = {"bert_pairs": _bert_samples, "packed_lm": _packed_samples, "images": _image_samples}


def _shard_samples(rows: list[dict[str, Any]], ctx: JobContext, name: str, counts: dict[str, int]):
    """The ``(key, members, samples)`` records of one shard, built and grouped as ``ctx.kind`` says."""
    if ctx.kind not in SAMPLE_BUILDERS:
        raise ValueError(f"data_prep has no sample builder for corpus kind {ctx.kind!r} (known: {', '.join(SAMPLE_BUILDERS)}).")
    samples = SAMPLE_BUILDERS[ctx.kind](rows, ctx, name, counts)
    return _records(samples, ctx, name) if corpus_kind(ctx.kind).tokenized else samples


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
    samples = _shard_samples(rows, ctx, name, counts)
    path = Path(out_dir) / f"{name}.tar"
    tmp, info = write_shard_tmp(path, samples)
    for key in ("nsp_random", "stream_tokens", "stream_tokens_kept"):
        if key in counts:
            stats.add(key, counts[key])
    stats.add("documents_kept", len(rows))
    record = {"name": f"{name}.tar", "fingerprint": fingerprint, "tokens": counts["tokens"], "stats": stats.to_dict(), **info}
    if not corpus_kind(ctx.kind).tokenized:  # images per class: the summary names a class a split lacks
        record["class_counts"] = {str(k): v for k, v in sorted(Counter(int(r["label"]) for r in rows).items())}

    def commit() -> dict[str, Any]:
        if info["samples"] == 0:  # every document was too short to make a sample: no empty shard
            tmp.unlink()
            record.pop("index_rows", None)
        else:
            commit_shard(tmp, path, record)
        save_record(out_dir, f"{name}.tar", record)
        return record

    return committer.submit(commit)
