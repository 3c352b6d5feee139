"""Corpus format 2 and the loader against stock WebDataset, in one run.

1. Size: ``pretrain prepare`` (``run_prepare``) writes ``bert_pairs`` and ``packed_lm`` corpora from
   ``--size-mb`` MB of real text in two shapes: *short* documents (dictionary-style: every line of
   at least 20 characters is its own document; mean < 60 tokens) and *long* ones (one document per
   source file). It
   prints shard bytes (tars + index sidecars) / payload, where payload = token bytes + per-sample
   metadata (bert_pairs: len_a, len_b as uint16 and the NSP label as uint8 = 5 bytes; packed_lm:
   none). Goal <= 1.15.
2. Throughput: on a ``--kind`` corpus of long documents from ``--text-mb`` MB of text (1 GB by
   default), samples/s of ``StreamingSource``
   (``--workers`` workers, micro batch ``--mb``, shuffle buffer 1000) against stock
   ``webdataset.WebDataset(urls).shuffle(1000)`` over the same shards, whose records are split
   into samples by the same ``core.records.decode_record`` and batched by the same task collate,
   in a ``DataLoader`` with the same workers (stock WebDataset gives each worker whole shards, so
   the corpus has several shards per worker). Both read ``--batches`` batches (default: one epoch),
   ``--repeat`` times interleaved, the fastest run of each counting. Goal >= 1.0x.
3. Seek: time to read a 1000-sample window at the end of the largest shard / at its start, each
   with a fresh reader (goal <= 1.5), and the same for the deprecated format 1 (for reference).
4. Resume: time from ``load_state_dict`` at the middle of an epoch to the first batch (goal < 2 s).

The text: ``benchmarks/corpus_text.py`` (the Python docs, the Linux kernel docs and Perl's POD
from Debian's packages, then rewrapped and reordered variants of them until the size is reached).

    python benchmarks/loader_throughput.py [--text-mb 1000] [--size-mb 50] [--kind bert_pairs] [--workers 2] [--shard-mb 16] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.corpus_text import build_text  # noqa: E402


def prepare(kind: str, text: Path, out: Path, short: bool, tokenizer: str, workers: int, shard_mb: float) -> dict:
    from data_prep.config import PrepConfig, SourceConfig, TokenizerConfig
    from data_prep.job import run_prepare

    cfg = PrepConfig(kind=kind, output=str(out), seq_len=128, validation_fraction=0.02, shard_target_mb=shard_mb,
                     progress=False, num_workers=workers,
                     sources=[SourceConfig(type="text", paths=[str(text)], text_mode="paragraphs" if short else "file")],
                     tokenizer=TokenizerConfig(vocab_size=16000, path=tokenizer))
    return run_prepare(cfg)


def size_ratio(corpus: Path) -> dict:
    m = json.loads((corpus / "manifest.json").read_text())
    item = 2 if m["token_dtype"] == "uint16" else 4
    tokens = sum(sp["tokens"] for sp in m["splits"].values())
    samples = sum(sp["samples"] for sp in m["splits"].values())
    shards = [s for sp in m["splits"].values() for s in sp["shards"]]
    disk = sum(s["bytes"] + s["index"]["bytes"] for s in shards)
    payload = tokens * item + (5 * samples if m["kind"] == "bert_pairs" else 0)
    return {"samples": samples, "tokens": tokens, "mean_tokens": round(tokens / max(1, samples), 1), "shards": len(shards),
            "disk_mb": round(disk / 1e6, 2), "payload_mb": round(payload / 1e6, 2), "ratio": round(disk / payload, 4)}


def _task(m):
    from pipelines.engine import objectives as tasks
    from pipelines.engine.config import RunConfig

    cfg = RunConfig()
    cfg.train.task = "mlm_nsp" if m.kind == "bert_pairs" else "causal_lm"
    return tasks.build_task(cfg, m)


def ours(m, batches: int, workers: int, mb: int) -> float:
    from pipelines.loading.loader import StreamingSource

    src = StreamingSource(m, "train", _task(m).collate, micro_batch_size=mb, rank=0, world=1, num_workers=workers,
                          shuffle_buffer=1000, seed=0)
    t0 = time.perf_counter()
    n = sum(len(b["keys"]) for b in src.batches(limit=batches))
    return n / (time.perf_counter() - t0)


class _Expand:
    """Stock-WebDataset pipeline stage: records -> samples (a module-level class: workers pickle it)."""

    def __init__(self, kind: str):
        self.kind = kind

    def __call__(self, records):
        from core.records import decode_record

        for r in records:
            yield from decode_record(self.kind, r["__key__"], {k: v for k, v in r.items() if not k.startswith("__")})


class _Collate:
    def __init__(self, collate):
        self.collate = collate

    def __call__(self, samples):
        return self.collate(samples, epoch=0, train=True)


def stock(m, batches: int, workers: int, mb: int) -> float:
    import webdataset as wds
    from torch.utils.data import DataLoader

    urls = [str(m.root / s.name) for s in m.shards("train")]
    ds = (wds.WebDataset(urls, shardshuffle=False, empty_check=False).shuffle(1000).compose(_Expand(m.kind))
          .batched(mb, collation_fn=_Collate(_task(m).collate), partial=False))
    loader = DataLoader(ds, batch_size=None, num_workers=workers, **({"multiprocessing_context": "forkserver"} if workers else {}))
    t0 = time.perf_counter()
    n = 0
    for b in loader:
        n += len(b["keys"])
        if n >= batches * mb:
            break
    return n / (time.perf_counter() - t0)


def window_times(m, version: int) -> tuple[float, float]:
    from pipelines.loading.shard_io import ShardReader, read_samples

    shard = max(m.shards("train"), key=lambda s: s.samples)
    times = []
    for start in (0, shard.samples - 1000):
        best = float("inf")
        for _ in range(3):
            reader = ShardReader(m)
            t0 = time.perf_counter()
            got = list(read_samples(m, [shard], start, 1000, reader))
            best = min(best, time.perf_counter() - t0)
            reader.close()
            assert len(got) == 1000 and not any(isinstance(p, str) for _, _, p in got)
        times.append(best)
    return times[0], times[1]


def as_format_1(m, out: Path) -> Path:
    """The largest train shard's samples in the deprecated format 1 (two members per sample), for the seek reference."""
    from core.corpus import read_shard
    from data_prep.shards import write_shard

    out.mkdir(parents=True, exist_ok=True)
    largest = max(m.shards("train"), key=lambda s: s.samples).name
    raw = json.loads(json.dumps(m.raw)) | {"schema_version": "1.0"}  # a deep copy
    raw["splits"] = {"train": dict(raw["splits"]["train"], shards=[s for s in raw["splits"]["train"]["shards"] if s["name"] == largest])}
    shutil.copytree(m.root / "tokenizer", out / "tokenizer", dirs_exist_ok=True)
    for split in raw["splits"].values():
        for s in split["shards"]:
            info = write_shard(out / s["name"], read_shard(m.root / s["name"]))
            s.update(bytes=info["bytes"], sha256=info["sha256"])
            s.pop("index")
            (out / info["index"]["name"]).unlink()
    (out / "manifest.json").write_text(json.dumps(raw))
    return out


def resume_time(m, workers: int, mb: int) -> float:
    from pipelines.loading.loader import StreamingSource

    def make():
        return StreamingSource(m, "train", _task(m).collate, micro_batch_size=mb, rank=0, world=1, num_workers=workers,
                               shuffle_buffer=1000, seed=0)

    src = make()
    total = sum(sh.samples for sh in m.shards("train"))
    state = {**src.state_dict(), "position": total + total // 2 // mb * mb}  # the middle of epoch 1
    resumed = make()
    t0 = time.perf_counter()
    resumed.load_state_dict(state)
    next(iter(resumed.batches(limit=1)))
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text-mb", type=float, default=1000.0, help="text behind the throughput corpus")
    p.add_argument("--size-mb", type=float, default=50.0, help="text behind each of the four size corpora")
    p.add_argument("--kind", default="packed_lm", choices=["packed_lm", "bert_pairs"])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mb", type=int, default=32)
    p.add_argument("--batches", type=int, default=0, help="batches to time (default: one epoch)")
    p.add_argument("--shard-mb", type=float, default=16.0, help="prep shard_target_mb (several shards per worker)")
    p.add_argument("--repeat", type=int, default=3, help="throughput runs of each, interleaved; the fastest counts")
    p.add_argument("--work", default="", help="keep corpora here (reused when present)")
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from core.corpus import load_manifest

    work = Path(args.work or tempfile.mkdtemp(prefix="loader-bench-"))
    text = {shape: work / f"text-{shape}" for shape in ("short", "long", "big")}
    for shape, path in text.items():
        if not path.exists():
            build_text(path, args.text_mb if shape == "big" else args.size_mb, file_per_document=True, short=shape == "short")
        print(f"text {shape}: {sum(f.stat().st_size for f in path.iterdir()) / 1e6:.1f} MB in {path}", flush=True)
    tokenizer = ""
    corpora = {}
    for kind, shape in [(k, s) for k in ("bert_pairs", "packed_lm") for s in ("short", "long")] + [(args.kind, "big")]:
        out = work / f"{kind}-{shape}"
        if not (out / "manifest.json").is_file():
            t0 = time.perf_counter()
            prepare(kind, text[shape], out, shape == "short", tokenizer, args.workers, args.shard_mb)
            print(f"prepared {out.name} in {time.perf_counter() - t0:.0f} s", flush=True)
        tokenizer = tokenizer or str(out / "tokenizer")
        corpora[(kind, shape)] = out
    print("\n1. size: shard bytes (tar + index) / payload (token bytes + 5 B/sample for bert_pairs), goal <= 1.15")
    for (kind, shape), out in corpora.items():
        if shape != "big":
            print(f"  {kind:<10} {shape:<5} {json.dumps(size_ratio(out))}")

    m = load_manifest(corpora[(args.kind, "big")])
    total = sum(s.samples for s in m.shards("train"))
    batches = args.batches or total // args.mb
    print(f"\n2. throughput on {m.root.name}: {total:,} train samples, {len(m.shards('train'))} shards, "
          f"{batches} batches of {args.mb}, {args.workers} workers", flush=True)
    ours(m, min(batches, 20), args.workers, args.mb)  # warm the page cache and the forkserver for both
    runs: dict[str, list[float]] = {"ours": [], "stock": []}
    for _ in range(args.repeat):
        runs["ours"].append(ours(m, batches, args.workers, args.mb))
        runs["stock"].append(stock(m, batches, args.workers, args.mb))
    a, b = max(runs["ours"]), max(runs["stock"])
    print(f"  runs: {json.dumps({k: [round(x) for x in v] for k, v in runs.items()})}")
    print(f"  ours {a:,.0f} samples/s   stock WebDataset(urls).shuffle(1000) {b:,.0f} samples/s   ratio {a / b:.2f}x "
          f"(fastest of {args.repeat}; goal >= 1.0)")

    print("\n3. 1000-sample window at the end / at the start of the largest shard (fresh reader, best of 3), goal <= 1.5")
    s0, s1 = window_times(m, 2)
    print(f"  format 2: start {s0 * 1e3:.1f} ms  end {s1 * 1e3:.1f} ms  ratio {s1 / s0:.2f}")
    m1 = load_manifest(as_format_1(m, work / f"{m.root.name}-v1"))
    v0, v1 = window_times(m1, 1)
    print(f"  format 1 (deprecated, scanned once per reader): start {v0 * 1e3:.1f} ms  end {v1 * 1e3:.1f} ms  ratio {v1 / v0:.2f}")

    r = resume_time(m, args.workers, args.mb)
    print(f"\n4. resume at the middle of epoch 1 -> first batch: {r:.2f} s (goal < 2 s)")


if __name__ == "__main__":
    main()
