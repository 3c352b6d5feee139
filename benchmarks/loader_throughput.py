"""Corpus format 2 and the loader against stock WebDataset, in one run.

1. Size: ``pretrain prepare`` (``run_prepare``) writes ``bert_pairs`` and ``packed_lm`` corpora from
   ``--size-mb`` MB of real text in two shapes: *short* documents (dictionary-style: every line of
   at least 20 characters is its own document; mean < 60 tokens) and *long* ones (one document per
   source file). It
   prints shard bytes (tars + index sidecars) / payload, where payload = token bytes + per-sample
   metadata (bert_pairs: len_a, len_b as uint16 and the NSP label as uint8 = 5 bytes; packed_lm:
   none). Goal <= 1.15.
2. Throughput and CPU cost (``measure``): on each case — the small corpora (``--small-mb`` MB of
   short documents, dictionary-style, prepared into a few shards of ``--small-shard-mb``, packed_lm
   AND bert_pairs) and a ``--kind`` corpus of long documents from ``--text-mb`` MB of text (1 GB by
   default; 0 skips it) — ``StreamingSource`` (``--workers`` workers, micro batch ``--mb``, shuffle
   buffer 1000) against stock ``webdataset.WebDataset(urls).shuffle(1000)`` over the same shards,
   whose records are split into samples by the same ``core.records.decode_record`` and batched by the
   same task collate, in a ``DataLoader`` with the same workers and the same (warm) forkserver, which
   has both sides' modules imported. Both deliver the same collated batches (same keys, dtypes and
   batch size; checked). Per run: samples/s, CPU-seconds per delivered sample of every loader process
   (the main process and its DataLoader workers, from ``/proc/PID/stat`` utime+stime+cutime+cstime of
   the process tree before and after the run, the workers joined: the OS's accounting, not wall time)
   and the time from making the loader to its first batch; ours also from ``load_state_dict`` at the
   middle of an epoch to the first batch (resume). ``--repeat`` runs of each, interleaved, first with
   no load of ours beside them (*no hog*) and then with ``--hogs`` busy-looping processes beside both
   (*hog*; their CPU is not counted). samples/s: the fastest run; CPU and first batch: the median.
   Goals: CPU/sample <= stock, samples/s >= 1.0x stock, first batch <= stock + 0.2 s.
3. Seek: time to read a 1000-sample window at the end of the largest shard / at its start, each
   with a fresh reader (goal <= 1.5), and the same for the deprecated format 1 (for reference).
4. Resume: time from ``load_state_dict`` at the middle of an epoch to the first batch (goal < 2 s).

Sections 3 and 4 use the big corpus (the small packed_lm one with ``--text-mb 0``).

The text: ``benchmarks/corpus_text.py`` (the Python docs, the Linux kernel docs and Perl's POD
from Debian's packages, then rewrapped and reordered variants of them until the size is reached).

    python benchmarks/loader_throughput.py [--text-mb 1000] [--size-mb 50] [--small-mb 40] [--kind bert_pairs]
        [--workers 2] [--shard-mb 16] [--repeat 3] [--hogs 2] [--batches N] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
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


def process_tree_cpu(root: int, exclude: set[int] = frozenset()) -> float:
    """CPU-seconds (user + system) of process ``root`` and its descendants, including the children they
    have reaped (cutime/cstime: a joined DataLoader worker is counted by the process that waited for it,
    the forkserver), from ``/proc/PID/stat``; subtrees rooted at ``exclude`` are left out."""
    stats: dict[int, tuple[int, float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                rest = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # exited meanwhile
            stats[int(entry)] = (int(rest[1]), sum(int(x) for x in rest[11:15]) / tick)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in exclude or pid not in stats:
            continue
        total += stats[pid][1]
        todo += children.get(pid, [])
    return total


class Run:
    """One timed loader run: samples delivered, wall seconds, CPU-seconds of the loader's processes, first batch."""

    def __init__(self, exclude: set[int]):
        self.exclude, self.samples, self.first, self.shapes = exclude, 0, float("nan"), {}
        self.cpu0, self.t0 = process_tree_cpu(os.getpid(), exclude), time.perf_counter()

    def batch(self, b: dict) -> None:
        if not self.samples:
            self.first = time.perf_counter() - self.t0
            self.shapes = {k: (tuple(v.shape), str(v.dtype)) for k, v in b.items() if hasattr(v, "dtype")}
        self.samples += len(b["keys"])

    def done(self) -> dict:
        wall = time.perf_counter() - self.t0
        cpu = process_tree_cpu(os.getpid(), self.exclude) - self.cpu0
        return {"rate": self.samples / wall, "cpu_ms": 1e3 * cpu / max(1, self.samples), "first": self.first,
                "samples": self.samples, "shapes": self.shapes}


def _source(m, workers: int, mb: int):
    from pipelines.loading.loader import StreamingSource

    return StreamingSource(m, "train", _task(m).collate, micro_batch_size=mb, rank=0, world=1, num_workers=workers,
                           shuffle_buffer=1000, seed=0)


def ours(m, batches: int, workers: int, mb: int, exclude: set[int] = frozenset()) -> dict:
    run = Run(exclude)
    for b in _source(m, workers, mb).batches(limit=batches):
        run.batch(b)
    return run.done()


def ours_resumed(m, workers: int, mb: int) -> float:
    """Seconds from ``load_state_dict`` at the middle of epoch 1 to the first batch."""
    src = _source(m, workers, mb)
    total = sum(sh.samples for sh in m.shards("train"))
    state = {**src.state_dict(), "position": total + total // 2 // mb * mb}
    resumed = _source(m, workers, mb)
    t0 = time.perf_counter()
    resumed.load_state_dict(state)
    next(iter(resumed.batches(limit=1)))
    return time.perf_counter() - t0


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


def stock(m, batches: int, workers: int, mb: int, exclude: set[int] = frozenset()) -> dict:
    import webdataset as wds
    from torch.utils.data import DataLoader

    run = Run(exclude)
    urls = [str(m.root / s.name) for s in m.shards("train")]
    ds = (wds.WebDataset(urls, shardshuffle=False, empty_check=False).shuffle(1000).compose(_Expand(m.kind))
          .batched(mb, collation_fn=_Collate(_task(m).collate), partial=False))
    loader = DataLoader(ds, batch_size=None, num_workers=workers, **({"multiprocessing_context": "forkserver"} if workers else {}))
    it = iter(loader)
    for b in it:
        run.batch(b)
        if run.samples >= batches * mb:
            break
    getattr(it, "_shutdown_workers", lambda: None)()  # join the workers before their CPU time is read
    del it
    return run.done()


def warm_forkserver() -> None:
    """Start the forkserver both sides' workers fork from, with both sides' modules imported (as a
    trainer's data modules would be), so neither pays imports per worker."""
    import multiprocessing

    from pipelines.loading import workers

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([*workers._PRELOAD, "webdataset", "benchmarks.loader_throughput"])
    multiprocessing.forkserver.ensure_running()


def _hogs(n: int) -> list:
    import subprocess

    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def measure(name: str, m, batches: int, args, hogs: int) -> dict:
    """``--repeat`` interleaved runs of ours, ours resumed and stock on one corpus, with ``hogs`` busy loops beside."""
    procs = _hogs(hogs)
    exclude = {p.pid for p in procs}
    runs: dict[str, list[dict]] = {"ours": [], "stock": []}
    resumes = []
    try:
        time.sleep(1.0 if procs else 0.0)
        load = os.getloadavg()[0]
        for _ in range(args.repeat):
            runs["ours"].append(ours(m, batches, args.workers, args.mb, exclude))
            resumes.append(ours_resumed(m, args.workers, args.mb))
            runs["stock"].append(stock(m, batches, args.workers, args.mb, exclude))
        load = (load + os.getloadavg()[0]) / 2
    finally:
        for p in procs:
            p.kill()
            p.wait()
    a, b = runs["ours"][0]["shapes"], runs["stock"][0]["shapes"]
    same = a.keys() == b.keys() and all(a[k][1] == b[k][1] and a[k][0][0] == b[k][0][0] and len(a[k][0]) == len(b[k][0]) for k in a)
    if not same:
        raise SystemExit(f"{name}: the two loaders deliver different batches: ours {a}, stock {b}")

    def med(side: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[side])

    row = {"case": name, "load": round(load, 1), "hogs": hogs,
           "ours_rate": max(r["rate"] for r in runs["ours"]), "stock_rate": max(r["rate"] for r in runs["stock"]),
           "ours_cpu_ms": med("ours", "cpu_ms"), "stock_cpu_ms": med("stock", "cpu_ms"),
           "ours_first": med("ours", "first"), "ours_resume": statistics.median(resumes), "stock_first": med("stock", "first"),
           "runs": {k: [[round(r["rate"]), round(r["cpu_ms"], 4), round(r["first"], 2)] for r in v] for k, v in runs.items()},
           "resumes": [round(x, 2) for x in resumes], "batch": {k: v[0] for k, v in a.items()}}
    print(f"  {name:<22} {'hog x' + str(hogs) if hogs else 'no hog':<7} load {row['load']:>5.1f}  "
          f"samples/s {row['ours_rate']:>7,.0f} / {row['stock_rate']:>7,.0f} = {row['ours_rate'] / row['stock_rate']:.2f}x   "
          f"CPU ms/sample {row['ours_cpu_ms']:.4f} / {row['stock_cpu_ms']:.4f} = {row['ours_cpu_ms'] / row['stock_cpu_ms']:.2f}   "
          f"first batch {row['ours_first']:.2f} s (resume {row['ours_resume']:.2f} s) / {row['stock_first']:.2f} s", flush=True)
    print(f"    runs [samples/s, CPU ms/sample, first batch s]: {json.dumps(row['runs'])}, resumes {row['resumes']}", flush=True)
    return row


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text-mb", type=float, default=1000.0, help="text behind the big corpus (0: none)")
    p.add_argument("--size-mb", type=float, default=50.0, help="text behind each of the four size corpora (0: skip section 1)")
    p.add_argument("--small-mb", type=float, default=40.0, help="short-document text behind the small corpora (0: none)")
    p.add_argument("--small-shard-mb", type=float, default=4.0, help="prep shard_target_mb of the small corpora")
    p.add_argument("--kind", default="packed_lm", choices=["packed_lm", "bert_pairs"], help="kind of the big corpus")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mb", type=int, default=32)
    p.add_argument("--batches", type=int, default=0, help="batches per run (default: one epoch of the corpus)")
    p.add_argument("--shard-mb", type=float, default=16.0, help="prep shard_target_mb (several shards per worker)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each, interleaved")
    p.add_argument("--hogs", type=int, default=2, help="busy-looping processes beside both in the busy case (0: skip it)")
    p.add_argument("--work", default="", help="keep corpora here (reused when present)")
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from core.corpus import load_manifest

    work = Path(args.work or tempfile.mkdtemp(prefix="loader-bench-"))
    wanted = {"short": args.size_mb, "long": args.size_mb, "big": args.text_mb, "small": args.small_mb}
    text = {shape: work / f"text-{shape}" for shape, mb in wanted.items() if mb > 0}
    for shape, path in text.items():
        if not path.exists():
            build_text(path, wanted[shape], file_per_document=True, short=shape in ("short", "small"))
        print(f"text {shape}: {sum(f.stat().st_size for f in path.iterdir()) / 1e6:.1f} MB in {path}", flush=True)
    tokenizer = ""
    corpora = {}
    plan = [(k, s) for s in ("short", "long", "small") for k in ("bert_pairs", "packed_lm")] + [(args.kind, "big")]
    for kind, shape in [(k, s) for k, s in plan if s in text]:
        out = work / f"{kind}-{shape}"
        if not (out / "manifest.json").is_file():
            t0 = time.perf_counter()
            prepare(kind, text[shape], out, shape in ("short", "small"), tokenizer, args.workers,
                    args.small_shard_mb if shape == "small" else args.shard_mb)
            print(f"prepared {out.name} in {time.perf_counter() - t0:.0f} s", flush=True)
        tokenizer = tokenizer or str(out / "tokenizer")
        corpora[(kind, shape)] = out
    if args.size_mb > 0:
        print("\n1. size: shard bytes (tar + index) / payload (token bytes + 5 B/sample for bert_pairs), goal <= 1.15")
        for (kind, shape), out in corpora.items():
            if shape in ("short", "long"):
                print(f"  {kind:<10} {shape:<5} {json.dumps(size_ratio(out))}")

    cases = [(f"{k} {s}", load_manifest(out)) for (k, s), out in corpora.items() if s in ("small", "big")]
    print(f"\n2. ours / stock WebDataset(urls).shuffle(1000): {args.workers} workers, micro batch {args.mb}, "
          f"{args.repeat} interleaved runs each; samples/s fastest, CPU ms/sample (all loader processes) and first "
          f"batch median. Goals: >= 1.0x, CPU <= 1.0, first batch <= stock + 0.2 s. 2-core load average at start: "
          f"{os.getloadavg()}", flush=True)
    warm_forkserver()
    rows = []
    for name, m in cases:
        total = sum(s.samples for s in m.shards("train"))
        batches = args.batches or total // args.mb
        print(f"  {name}: {total:,} train samples in {len(m.shards('train'))} shards, {batches} batches per run", flush=True)
        ours(m, min(batches, 20), args.workers, args.mb)  # the page cache
        for hogs in sorted({0, args.hogs}):
            rows.append(measure(name, m, batches, args, hogs))
    print(f"  rows: {json.dumps(rows)}")

    m = cases[-1][1] if cases else None
    if m is None:
        return
    print(f"\n3. 1000-sample window at the end / at the start of the largest shard of {m.root.name} (fresh reader, best of 3), goal <= 1.5")
    s0, s1 = window_times(m, 2)
    print(f"  format 2: start {s0 * 1e3:.1f} ms  end {s1 * 1e3:.1f} ms  ratio {s1 / s0:.2f}")
    m1 = load_manifest(as_format_1(m, work / f"{m.root.name}-v1"))
    v0, v1 = window_times(m1, 1)
    print(f"  format 1 (deprecated, scanned once per reader): start {v0 * 1e3:.1f} ms  end {v1 * 1e3:.1f} ms  ratio {v1 / v0:.2f}")

    r = ours_resumed(m, args.workers, args.mb)
    print(f"\n4. resume at the middle of epoch 1 -> first batch: {r:.2f} s (goal < 2 s)")


if __name__ == "__main__":
    main()
