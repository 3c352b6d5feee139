"""The functions Ray runs in its workers: read+clean+tokenize per file, and build one shard per group.

Everything a worker needs arrives in a plain `ctx` dict (configs as dicts, the tokenizer as its
JSON text) so the code runs unchanged on a laptop or a cluster. Output of a shard depends only
on the set of documents routed to it (sorted by content hash), the seed and the shard name, never
on how Ray split the work: that is what makes 1 and N workers write identical bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from data_prep.bert_pairs import create_pairs, split_sentences
from data_prep.clean import Stats, band_keys, clean_text, doc_hash, minhash_signature
from data_prep.config import CleanConfig, ImageConfig, SourceConfig
from data_prep.images import BadImage, process_image
from data_prep.packing import pack_windows
from data_prep.shards import load_record, save_record, write_shard
from data_prep.sources import iter_text_records

TEXT_SCHEMA = pa.schema([("shard", pa.string()), ("hash", pa.string()), ("tokens", pa.binary()), ("sents", pa.binary()), ("stats", pa.string())])
IMAGE_SCHEMA = pa.schema([("shard", pa.string()), ("hash", pa.string()), ("data", pa.binary()), ("ext", pa.string()), ("label", pa.int64()), ("stats", pa.string())])
_CHUNK = 1000  # documents per output batch of the read stage

_TOKENIZERS: dict[str, Any] = {}


def _tokenizer(ctx: dict[str, Any]):
    """The job's tokenizer, built once per worker process (keyed by its sha256)."""
    key = ctx["tokenizer_sha256"]
    if key not in _TOKENIZERS:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one worker = one core; Ray does the parallelism
        from tokenizers import Tokenizer

        _TOKENIZERS.clear()
        _TOKENIZERS[key] = Tokenizer.from_str(ctx["tokenizer_json"])
    return _TOKENIZERS[key]


def route(h: str, ctx: dict[str, Any]) -> str:
    """Shard of a document: the split from the first 8 hex digits of its hash, the bucket from the next 8."""
    split = "validation" if int(h[:8], 16) / 0x1_0000_0000 < ctx["validation_fraction"] else "train"
    return f"{split}-{int(h[8:16], 16) % ctx['buckets'][split]:06d}"


def _iter_clean_docs(batch: dict[str, np.ndarray], ctx: dict[str, Any], stats: Stats) -> Iterator[tuple[str, str]]:
    """(hash, cleaned text) of every document in the batch's files; bad records go to `stats`."""
    clean_cfg = CleanConfig(**ctx["clean"])
    sources = [SourceConfig(**s) for s in ctx["sources"]]
    for path, src_idx in zip(batch["path"], batch["source"]):
        path = str(path)
        for text, rule in iter_text_records(path, sources[int(src_idx)]):
            if text is None:
                stats.bad(path, rule)
                continue
            stats.add("documents_in")
            cleaned = clean_text(text, clean_cfg, stats)
            if cleaned is not None:
                yield doc_hash(cleaned), cleaned


def _stats_table(schema: pa.Schema, stats: Stats) -> pa.Table:
    row = {f.name: [""] if pa.types.is_string(f.type) else [b""] if pa.types.is_binary(f.type) else [0] for f in schema}
    row["stats"] = [json.dumps(stats.to_dict(), sort_keys=True)]
    return pa.table(row, schema=schema)


def sample_docs(batch: dict[str, np.ndarray], ctx: dict[str, Any]) -> Iterator[pa.Table]:
    """Read stage of the tokenizer sample: cleaned texts, no tokenization."""
    schema = pa.schema([("hash", pa.string()), ("text", pa.string()), ("stats", pa.string())])
    stats = Stats()
    rows = list(_iter_clean_docs(batch, ctx, stats))
    yield pa.table({"hash": [h for h, _ in rows], "text": [t for _, t in rows], "stats": [""] * len(rows)}, schema=schema)
    yield pa.table({"hash": [""], "text": [""], "stats": [json.dumps(stats.to_dict())]}, schema=schema)


def tokenize_docs(texts: list[str], tok, dtype: np.dtype, kind: str) -> tuple[list[bytes], list[bytes]]:
    """Token bytes per document, and (BERT) the int32 token count of each of its sentences."""
    if kind != "bert_pairs":
        ids = [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]
        return [np.asarray(i, dtype=dtype).tobytes() for i in ids], [b""] * len(ids)
    sentences = [split_sentences(t) for t in texts]
    flat = [s for doc in sentences for s in doc]
    ids = [e.ids for e in tok.encode_batch_fast(flat, add_special_tokens=False)] if flat else []
    tokens, sents, k = [], [], 0
    for doc in sentences:
        doc_ids = ids[k : k + len(doc)]
        k += len(doc)
        tokens.append(np.fromiter((t for s in doc_ids for t in s), dtype=dtype).tobytes())
        sents.append(np.array([len(s) for s in doc_ids], dtype="<i4").tobytes())
    return tokens, sents


def estimate_shard_bytes(docs: dict[str, str], ctx: dict[str, Any], tok) -> float:
    """Tar bytes the real sample builder makes from `docs` (a small sample): sizes the shards."""
    dtype = np.dtype(ctx["token_dtype"]).newbyteorder("<")
    hashes = sorted(docs)
    tokens, sents = tokenize_docs([docs[h] for h in hashes], tok, dtype, ctx["kind"])
    rows = [{"hash": h, "tokens": t, "sents": s} for h, t, s in zip(hashes, tokens, sents)]
    counts: dict[str, int] = {"tokens": 0, "nsp_random": 0}
    samples = _bert_samples(rows, ctx, "estimate", counts) if ctx["kind"] == "bert_pairs" else _packed_samples(rows, ctx, counts)
    return float(sum(512 + -(-len(v) // 512) * 512 for _, members in samples for v in members.values()))


def prepare_text(batch: dict[str, np.ndarray], ctx: dict[str, Any]) -> Iterator[pa.Table]:
    """Read, clean, hash, route and tokenize documents (sentence by sentence for BERT pairs)."""
    tok = _tokenizer(ctx)
    dtype = np.dtype(ctx["token_dtype"]).newbyteorder("<")
    near_dups = ctx.get("near_dups") or ()
    stats = Stats()
    pending: list[tuple[str, str]] = []

    def flush() -> pa.Table:
        hashes = [h for h, _ in pending]
        tokens, sents = tokenize_docs([t for _, t in pending], tok, dtype, ctx["kind"])
        pending.clear()
        return pa.table(
            {"shard": [route(h, ctx) for h in hashes], "hash": hashes, "tokens": tokens, "sents": sents, "stats": [""] * len(hashes)},
            schema=TEXT_SCHEMA,
        )

    for h, text in _iter_clean_docs(batch, ctx, stats):
        if h in near_dups:
            stats.add("removed.near_duplicate")
            continue
        pending.append((h, text))
        if len(pending) >= _CHUNK:
            yield flush()
    if pending:
        yield flush()
    yield _stats_table(TEXT_SCHEMA, stats)


def prepare_images(batch: dict[str, np.ndarray], ctx: dict[str, Any]) -> Iterator[pa.Table]:
    """Read, decode, resize and re-encode images; unreadable ones are counted per file."""
    cfg = ImageConfig(**ctx["images"])
    stats = Stats()
    rows: dict[str, list] = {name: [] for name in IMAGE_SCHEMA.names}
    for path, label in zip(batch["path"], batch["label"]):
        path = str(path)
        try:
            raw = Path(path).read_bytes()
            data, ext, _, _ = process_image(raw, cfg)
        except (OSError, BadImage):
            stats.bad(path, "unreadable_image")
            continue
        stats.add("documents_in")
        h = hashlib.sha256(raw).hexdigest()
        for name, value in zip(IMAGE_SCHEMA.names, (route(h, ctx), h, data, ext, int(label), "")):
            rows[name].append(value)
    yield pa.table(rows, schema=IMAGE_SCHEMA)
    yield _stats_table(IMAGE_SCHEMA, stats)


# ------------------------------------------------------------------------------------------
# Near-duplicate candidates: MinHash per document, LSH bands grouped by the Ray shuffle
# ------------------------------------------------------------------------------------------


def minhash_bands(batch: dict[str, np.ndarray], ctx: dict[str, Any]) -> Iterator[pa.Table]:
    c = ctx["clean"]
    rows: dict[str, list] = {"band": [], "hash": [], "sig": []}
    seen: set[str] = set()
    for h, text in _iter_clean_docs(batch, ctx, Stats()):
        if h in seen:
            continue
        seen.add(h)
        sig = minhash_signature(text, c["minhash_perms"], c["shingle_words"])
        for key in band_keys(sig, *ctx["lsh"]):
            rows["band"].append(key)
            rows["hash"].append(h)
            rows["sig"].append(sig)
    yield pa.table(rows, schema=pa.schema([("band", pa.string()), ("hash", pa.string()), ("sig", pa.binary())]))


def near_dup_group(group: dict[str, np.ndarray], ctx: dict[str, Any]) -> dict[str, list]:
    """Documents of one LSH bucket similar to the bucket's smallest hash (which is kept)."""
    docs = dict(sorted({str(h): bytes(s) for h, s in zip(group["hash"], group["sig"])}.items()))
    if len(docs) < 2:
        return {"hash": []}
    (keep_hash, keep_sig), *others = docs.items()
    ref = np.frombuffer(keep_sig, dtype="<u8")
    threshold = ctx["clean"]["near_dedup_threshold"]
    return {"hash": [h for h, s in others if float(np.mean(np.frombuffer(s, dtype="<u8") == ref)) >= threshold]}


# ------------------------------------------------------------------------------------------
# One shard per group
# ------------------------------------------------------------------------------------------


def _rng(ctx: dict[str, Any], name: str) -> random.Random:
    return random.Random(int(hashlib.sha256(f"{ctx['seed']}:{name}".encode()).hexdigest()[:16], 16))


def _bert_samples(rows: list[dict[str, Any]], ctx: dict[str, Any], name: str, counts: dict[str, int]):
    dtype = np.dtype(ctx["token_dtype"]).newbyteorder("<")
    ext = "input_ids.u16" if dtype.itemsize == 2 else "input_ids.u32"
    docs = []
    for r in rows:
        tokens = np.frombuffer(r["tokens"], dtype=dtype)
        bounds = np.cumsum(np.frombuffer(r["sents"], dtype="<i4"))[:-1]
        docs.append(np.split(tokens, bounds) if len(tokens) else [])
    rng = _rng(ctx, name)
    sp = ctx["special"]
    for _ in range(ctx["dupe_factor"]):
        for k, r in enumerate(rows):
            pairs = create_pairs(
                docs, k, max_seq_len=ctx["seq_len"], cls_id=sp["cls"], sep_id=sp["sep"], rng=rng,
                short_seq_prob=ctx["short_seq_prob"], random_next_prob=ctx["nsp_random_prob"],
            )
            for ids, len_a, len_b, label in pairs:
                key = f"{r['hash'][:16]}-{counts.setdefault(r['hash'], 0):06d}"
                counts[r["hash"]] += 1
                counts["tokens"] += len(ids)
                counts["nsp_random"] += label
                meta = json.dumps({"len_a": len_a, "len_b": len_b, "next_sentence_label": label}, sort_keys=True)
                yield key, {ext: ids.astype(dtype).tobytes(), "meta.json": meta.encode()}


def _packed_samples(rows: list[dict[str, Any]], ctx: dict[str, Any], counts: dict[str, int]):
    dtype = np.dtype(ctx["token_dtype"]).newbyteorder("<")
    ext = "input_ids.u16" if dtype.itemsize == 2 else "input_ids.u32"
    docs = [np.frombuffer(r["tokens"], dtype=dtype) for r in rows]
    windows, kept = pack_windows(docs, ctx["special"]["eos"], ctx["seq_len"])
    for w, (doc_index, window) in enumerate(windows):
        counts["tokens"] += len(window)
        yield f"{rows[doc_index]['hash'][:16]}-{w:06d}", {ext: window.astype(dtype).tobytes()}
    counts["stream_tokens"] = kept["total"]
    counts["stream_tokens_kept"] = kept["kept"]


def _image_samples(rows: list[dict[str, Any]], counts: dict[str, int]):
    for r in rows:
        yield f"{r['hash'][:16]}-000000", {r["ext"]: r["data"], "cls": str(r["label"]).encode()}


def build_shard(group: dict[str, np.ndarray], ctx: dict[str, Any]) -> dict[str, list]:
    """Dedup one group (exact duplicates share a hash, hence a group) and write its shard."""
    name = str(group["shard"][0])
    if name == "":  # the group of per-batch statistics rows
        total = Stats()
        for s in group["stats"]:
            if s:
                total.merge(Stats.from_dict(json.loads(s)))
        return {"shard": [""], "result": [json.dumps(total.to_dict())]}
    columns = [c for c in group if c not in ("shard", "stats")]
    order = np.argsort(np.asarray(group["hash"], dtype=str), kind="stable")
    rows: list[dict[str, Any]] = []
    stats = Stats()
    for i in order:
        row = {c: group[c][i] for c in columns}
        row["hash"] = str(row["hash"])
        if rows and rows[-1]["hash"] == row["hash"] and ctx["clean"]["dedup"]:
            stats.add("removed.exact_duplicate")
            continue
        rows.append(row)
    fingerprint = hashlib.sha256((ctx["fingerprint"] + name + "".join(r["hash"] for r in rows)).encode()).hexdigest()
    out_dir = ctx["output"]
    record = load_record(out_dir, f"{name}.tar", fingerprint)
    if record is None:
        counts: dict[str, int] = {"tokens": 0, "nsp_random": 0}
        if ctx["kind"] == "bert_pairs":
            samples = _bert_samples(rows, ctx, name, counts)
        elif ctx["kind"] == "packed_lm":
            samples = _packed_samples(rows, ctx, counts)
        else:
            samples = _image_samples(rows, counts)
        info = write_shard(Path(out_dir) / f"{name}.tar", samples)
        if info["samples"] == 0:  # every document was too short to make a sample: no empty shard
            (Path(out_dir) / f"{name}.tar").unlink()
        if ctx.get("slow_shards_s"):  # test hook: widen the window in which a kill lands mid-job
            import time

            time.sleep(ctx["slow_shards_s"])
        for key in ("nsp_random", "stream_tokens", "stream_tokens_kept"):
            if key in counts:
                stats.add(key, counts[key])
        stats.add("documents_kept", len(rows))
        record = {"name": f"{name}.tar", "fingerprint": fingerprint, "tokens": counts["tokens"], "stats": stats.to_dict(), **info}
        save_record(out_dir, f"{name}.tar", record)
    return {"shard": [name], "result": [json.dumps(record, sort_keys=True)]}
