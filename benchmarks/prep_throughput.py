"""Throughput of the Ray data-preparation jobs against a `datasets.map` baseline, in one run.

On the same real corpus (`corpus_text.py`: the Python docs, the Linux kernel docs and Perl's POD
that Debian ships, repeated as rewrapped, reordered variants up to `--mb` MB) and with the same
fast tokenizer, this times:
  * ours: `run_prepare` for packed_lm (GPT) and bert_pairs, 2 Ray workers (and 1 for scaling), with the
    config's default `worker_malloc: auto` (`--worker-malloc system` runs ours on glibc's malloc);
  * baseline: `datasets.load_dataset("text") .map(batched=True, num_proc=2)`: our default cleaning
    (`clean_text`, so both sides do the same work and drop the same short documents; `--raw-baseline`
    skips it) and tokenization, plus the equivalent grouping (GPT: concatenate + cut seq_len+1
    windows; BERT: the same NSP pair builder applied per map batch), written to the datasets cache
    as usual;
and prints tokens/s of each and the ratios. From `ray.timeline()` it reports, per run of ours,
how many Ray worker processes ran tasks, the most tasks running at once (must equal the configured
`num_workers`) and the workers' busy share. It also runs the packed_lm job on 1x and 4x the
corpus in fresh driver processes and reports their peak driver RSS.

Each contender runs `--repeat` times, interleaved, and its fastest run counts (the same rule
for ours and the baseline: on a shared machine the fastest run is the least disturbed one); the
ratios of the medians are printed too, as a check that the fastest runs are not flukes.

With `--single-file-mb 40` it also prepares ONE text file of that size (issue #34) with 2 and 1
workers, the file cut into ranges (the default `input_range_mb`), and with 2 workers reading it as
one task (`input_range_mb=0`), and prints the whole-job and map-stage ratios.

    python benchmarks/prep_throughput.py [--mb 1000] [--kinds packed_lm,bert_pairs] [--seq-len 128] [--repeat 3]
    python benchmarks/prep_throughput.py --only-single-file --single-file-mb 40 --kinds bert_pairs --repeat 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.corpus_text import build_text, documents, text_mb  # noqa: E402


def ours(kind: str, corpus: Path, out: Path, tokenizer: str, seq_len: int, workers: int, shard_mb: float = 1.0,
         worker_malloc: str = "auto", range_mb: float | None = None) -> dict:
    """One job; `tokenizer` "" trains one in the job (16k, on a 2 MB sample); `range_mb` None = the config's default."""
    from data_prep.config import PrepConfig, SourceConfig, TokenizerConfig
    from data_prep.job import run_prepare

    cfg = PrepConfig(
        kind=kind, output=str(out), seq_len=seq_len, num_workers=workers, progress=False, validation_fraction=0.0,
        shard_target_mb=shard_mb, sources=[SourceConfig(type="text", paths=[str(corpus / "*.txt")], text_mode="paragraphs")],
        tokenizer=TokenizerConfig(path=tokenizer, type="wordpiece" if kind == "bert_pairs" else "bpe", sample_bytes=2_000_000,
                                  vocab_size=16000),
        worker_malloc=worker_malloc,
    )
    if range_mb is not None:
        cfg.input_range_mb = range_mb
    cfg.clean.dedup = False  # the baseline does not dedup either
    cpu0 = time.process_time() + ray_workers_cpu_s()
    t0, start = time.perf_counter(), time.time()
    s = run_prepare(cfg)
    seconds = time.perf_counter() - t0
    return {"tokens": s["tokens"], "seconds": seconds, "window": (start, time.time()), "cpu_s": time.process_time() + ray_workers_cpu_s() - cpu0,
            "worker_malloc": s["worker_malloc"], "task_s": s["task_s"], "stages_s": s["stages_s"]}


def ray_workers_cpu_s() -> float:
    """CPU seconds used so far by this machine's Ray worker processes (`ray::...`, agents excluded)."""
    import psutil

    total = 0.0
    for proc in psutil.process_iter(["cmdline", "cpu_times"]):
        cmd = proc.info["cmdline"] or []
        if cmd and cmd[0].startswith("ray::") and "Agent" not in cmd[0] and proc.info["cpu_times"]:
            total += proc.info["cpu_times"].user + proc.info["cpu_times"].system
    return total


def _self_and_children_cpu_s() -> float:
    import resource

    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


def task_concurrency(timeline: list[dict], window: tuple[float, float]) -> dict:
    """From `ray.timeline()`: Ray worker processes that ran tasks in `window`, most tasks at once, busy share.

    Checks that `num_workers` really is the parallelism (1 -> one task at a time) and that the
    workers, not the driver, do the work (busy = task seconds / (wall x workers)).
    """
    lo, hi = window[0] * 1e6, window[1] * 1e6
    spans = [(e["ts"], e["ts"] + e["dur"], e["tid"]) for e in timeline
             if e.get("ph") == "X" and e.get("name") == "task:execute" and lo <= e["ts"] <= hi]
    edges = sorted([(a, 1) for a, _, _ in spans] + [(b, -1) for _, b, _ in spans])
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    workers = len({t for *_, t in spans})
    busy = sum(b - a for a, b, _ in spans) / max(1.0, (hi - lo) * max(1, peak))
    return {"worker_processes": workers, "max_concurrent_tasks": peak, "busy_share": round(busy, 2)}


def baseline(kind: str, corpus: Path, cache: Path, tokenizer: str, seq_len: int, clean: bool = True) -> dict:
    """`clean`: the documents go through our default cleaning first (`clean_text`: NFC, control characters,
    whitespace, the length filter), so both sides do the same work and keep the same tokens."""
    import datasets
    import pyarrow.compute as pc
    from tokenizers import Tokenizer

    from data_prep.clean import Stats, clean_text
    from data_prep.config import CleanConfig

    clean_cfg = CleanConfig()

    def cleaned(texts: list[str]) -> list[str]:
        if not clean:
            return texts
        stats = Stats()
        return [t for t in (clean_text(x, clean_cfg, stats) for x in texts) if t is not None]

    from data_prep.bert_pairs import create_pairs, split_sentences

    datasets.disable_progress_bars()
    tok_file = str(Path(tokenizer) / "tokenizer.json")
    cpu0 = _self_and_children_cpu_s()  # the map workers are child processes, reaped when map ends
    t0 = time.perf_counter()
    ds = datasets.load_dataset("text", data_files=sorted(str(p) for p in corpus.glob("*.txt")), sample_by="paragraph",
                               split="train", cache_dir=str(cache))
    tok = Tokenizer.from_file(tok_file)
    if kind == "packed_lm":
        eos = tok.token_to_id("<|endoftext|>")

        def tokenize(batch):
            return {"ids": [e.ids + [eos] for e in tok.encode_batch_fast(cleaned(batch["text"]), add_special_tokens=False)]}

        def group(batch):  # the classic `group_texts` of the HF examples, windows of seq_len + 1
            flat = [t for ids in batch["ids"] for t in ids]
            n = (len(flat) // (seq_len + 1)) * (seq_len + 1)
            return {"input_ids": [flat[i : i + seq_len + 1] for i in range(0, n, seq_len + 1)]}
    else:
        cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")

        def tokenize(batch):
            sents = [split_sentences(t) for t in cleaned(batch["text"])]
            flat = [e.ids for e in tok.encode_batch_fast([s for d in sents for s in d], add_special_tokens=False)]
            out, k = [], 0
            for d in sents:
                out.append(flat[k : k + len(d)])
                k += len(d)
            return {"ids": out}

        def group(batch):
            import numpy as np

            docs = [[np.asarray(s) for s in d if s] for d in batch["ids"]]
            rng = random.Random(0)
            pairs = [p[0].tolist() for k in range(len(docs)) for p in create_pairs(docs, k, max_seq_len=seq_len, cls_id=cls_id, sep_id=sep_id, rng=rng)]
            return {"input_ids": pairs}

    ds = ds.map(tokenize, batched=True, num_proc=2, remove_columns=["text"])
    ds = ds.map(group, batched=True, num_proc=2, remove_columns=["ids"])
    tokens = sum(pc.sum(pc.list_value_length(b.column("input_ids"))).as_py() for b in ds.with_format("arrow").iter(100_000))
    return {"tokens": tokens, "seconds": time.perf_counter() - t0, "cpu_s": _self_and_children_cpu_s() - cpu0}


def peak_rss(kind: str, corpus: Path, out: Path, tokenizer: str, seq_len: int, address: str, shard_mb: float) -> float:
    code = (
        f"import resource, sys; sys.path.insert(0, {str(REPO)!r}); from benchmarks.prep_throughput import ours; "
        f"ours({kind!r}, __import__('pathlib').Path({str(corpus)!r}), __import__('pathlib').Path({str(out)!r}), "
        f"{tokenizer!r}, {seq_len:d}, 2, {shard_mb!r}); print('RSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    env = {**os.environ, "RAY_ADDRESS": address, "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=REPO)
    line = [x for x in res.stdout.splitlines() if x.startswith("RSS")]
    if not line:
        raise RuntimeError(res.stderr[-3000:])
    return int(line[-1].split()[1]) / 1024  # MiB (ru_maxrss is KiB on Linux)


_MAP_STAGE = "map: read, clean, tokenize, route"


def single_file_case(args, work: Path, toks: dict[str, str]) -> dict:
    """One text file of `--single-file-mb` MB (issue #34): 2 vs 1 workers with range splitting (the default
    `input_range_mb`), and 2 workers reading it as one task (`input_range_mb=0`, the behaviour before), interleaved.

    Ratios of the fastest runs: whole job and map stage (read, clean, tokenize, route: the job summary's
    stage time). With `--single-file-train` the jobs train their tokenizer (on 2 MB, on the driver), else
    they reuse the shared one."""
    folder = build_text(work / "single", args.single_file_mb, bundle_mb=2 * args.single_file_mb)
    (big,) = folder.glob("*.txt")
    out: dict = {"file_mb": round(big.stat().st_size / 1e6, 2), "tokenizer": "trained in the job" if args.single_file_train else "reused"}
    for kind in args.kinds.split(","):
        tok = "" if args.single_file_train else toks[kind]
        runs: dict[str, list[dict]] = {"split_2w": [], "split_1w": [], "whole_2w": []}
        for rep in range(args.repeat):
            for name, workers, range_mb in (("split_2w", 2, None), ("split_1w", 1, None), ("whole_2w", 2, 0.0)):
                dest = work / f"single-{name}-{kind}-{rep}"
                runs[name].append(ours(kind, folder, dest, tok, args.seq_len, workers, args.shard_mb, args.worker_malloc, range_mb))
                shutil.rmtree(dest, ignore_errors=True)
        job = {name: min(x["seconds"] for x in xs) for name, xs in runs.items()}
        stage = {name: min(x["stages_s"][_MAP_STAGE] for x in xs) for name, xs in runs.items()}
        out[kind] = {
            "job_s": {k: round(v, 2) for k, v in job.items()}, "map_stage_s": {k: round(v, 2) for k, v in stage.items()},
            "job_1_to_2_workers": round(job["split_1w"] / job["split_2w"], 2),
            "map_1_to_2_workers": round(stage["split_1w"] / stage["split_2w"], 2),
            "job_split_vs_whole_2w": round(job["whole_2w"] / job["split_2w"], 2),
            "map_split_vs_whole_2w": round(stage["whole_2w"] / stage["split_2w"], 2),
            # driver + Ray worker CPU-s: the same work on 1 or 2 workers, so a 1 -> 2 ratio far below 2 with equal
            # CPU-s means the machine had no second core to give (a busy machine), not that the work stayed serial
            "cpu_s": {name: round(min(x["cpu_s"] for x in xs), 1) for name, xs in runs.items()},
            "task_s_split_2w": min(runs["split_2w"], key=lambda x: x["seconds"])["task_s"],
            "task_s_split_1w": min(runs["split_1w"], key=lambda x: x["seconds"])["task_s"],
            "stages_s_split_2w": min(runs["split_2w"], key=lambda x: x["seconds"])["stages_s"],
            "stages_s_split_1w": min(runs["split_1w"], key=lambda x: x["seconds"])["stages_s"],
            "seconds_all_runs": {name: [round(x["seconds"], 2) for x in xs] for name, xs in runs.items()},
        }
        print("single file", kind, json.dumps(out[kind]), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=3.0, help="corpus size in MB")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--kinds", default="packed_lm,bert_pairs")
    parser.add_argument("--shard-mb", type=float, default=1.0, help="our shard_target_mb")
    parser.add_argument("--tokenizer-mb", type=float, default=50.0, help="train the shared tokenizers on the first N MB")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-1-worker", action="store_true", help="skip our 1-worker runs (no 1 -> 2 scaling figure)")
    parser.add_argument("--raw-baseline", action="store_true", help="baseline without our cleaning (less work than ours)")
    parser.add_argument("--worker-malloc", default="auto", help="our prep config's worker_malloc (auto | system | path)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each contender (interleaved); the fastest counts")
    parser.add_argument("--single-file-mb", type=float, default=0.0,
                        help="also run the single-large-file case on one text file of this many MB (issue #34: 40); 0 = skip")
    parser.add_argument("--single-file-train", action="store_true", help="single-file case: the jobs train their tokenizer")
    parser.add_argument("--only-single-file", action="store_true", help="run only the single-file case (no baseline, no RSS)")
    args = parser.parse_args()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker on both sides

    import ray

    from data_prep.config import TokenizerConfig
    from data_prep.tokenizer import save_tokenizer, train_tokenizer

    work = Path(tempfile.mkdtemp(prefix="prep_bench_"))
    try:
        corpus = build_text(work / "corpus", args.mb)
        print(f"corpus: {text_mb(corpus):.1f} MB in {len(list(corpus.glob('*.txt')))} files", flush=True)
        texts = [text for _, text in documents(min(args.mb, args.tokenizer_mb))]
        toks = {}
        for kind, ttype in (("packed_lm", "bpe"), ("bert_pairs", "wordpiece")):
            toks[kind] = str(work / f"tok-{ttype}" / "tokenizer")
            tok = train_tokenizer(texts, TokenizerConfig(type=ttype, vocab_size=16000))
            save_tokenizer(tok, toks[kind], ttype, model_max_length=args.seq_len, lowercase=True)
        ctx = ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
        address = ctx.address_info["gcs_address"]
        results: dict = {"corpus_mb": round(text_mb(corpus), 2)}
        for kind in args.kinds.split(","):
            ours(kind, build_text(work / "warm", 2), work / f"warm-{kind}", toks[kind], args.seq_len, 2, 1.0, args.worker_malloc)  # warm the workers
            if args.only_single_file:
                continue
            runs: dict[str, list[dict]] = {"ours_2w": [], "ours_1w": [], "baseline": []}
            for rep in range(args.repeat):  # interleaved; fresh output and cache dirs every time
                runs["ours_2w"].append(ours(kind, corpus, work / f"ours2-{kind}-{rep}", toks[kind], args.seq_len, 2, args.shard_mb,
                                            args.worker_malloc))
                if not args.skip_1_worker:
                    runs["ours_1w"].append(ours(kind, corpus, work / f"ours1-{kind}-{rep}", toks[kind], args.seq_len, 1, args.shard_mb,
                                                args.worker_malloc))
                runs["baseline"].append(baseline(kind, corpus, work / f"cache-{kind}-{rep}", toks[kind], args.seq_len,
                                                 clean=not args.raw_baseline))
                for out in (f"ours2-{kind}-{rep}", f"ours1-{kind}-{rep}", f"cache-{kind}-{rep}"):  # ~1 GB each at scale
                    shutil.rmtree(work / out, ignore_errors=True)
            if not runs["ours_1w"]:
                del runs["ours_1w"]
            best = {name: min(xs, key=lambda x: x["seconds"]) for name, xs in runs.items()}
            o2, b = best["ours_2w"], best["baseline"]
            r = {name: round(x["tokens"] / x["seconds"]) for name, x in best.items()}
            med = {name: statistics.median(x["seconds"] for x in xs) for name, xs in runs.items()}
            r.update(ratio_vs_baseline=round(r["ours_2w"] / r["baseline"], 2),
                     median_ratio_vs_baseline=round((o2["tokens"] / med["ours_2w"]) / (b["tokens"] / med["baseline"]), 2),
                     tokens_ours=o2["tokens"], tokens_baseline=b["tokens"], baseline_cleans=not args.raw_baseline,
                     our_worker_malloc=o2["worker_malloc"], our_task_s=o2["task_s"],
                     seconds_all_runs={name: [round(x["seconds"], 2) for x in xs] for name, xs in runs.items()})
            if "ours_1w" in best:
                r.update(speedup_1_to_2=round(r["ours_2w"] / r["ours_1w"], 2),
                         median_speedup_1_to_2=round(med["ours_1w"] / med["ours_2w"], 2))
            # CPU cost per token (min over runs): far less sensitive to other load than wall time
            cpu = {name: min(x["cpu_s"] for x in xs) for name, xs in runs.items()}
            r["tokens_per_cpu_s"] = {name: round((b if name == "baseline" else o2)["tokens"] / c) for name, c in cpu.items()}
            r["cpu_efficiency_vs_baseline"] = round((o2["tokens"] / cpu["ours_2w"]) / (b["tokens"] / cpu["baseline"]), 2)
            timeline = ray.timeline()
            r["ray_tasks"] = {name: task_concurrency(timeline, best[name]["window"]) for name in best if name != "baseline"}
            results[kind] = r
            print(kind, json.dumps(r), flush=True)
        if args.single_file_mb > 0:
            results["single_file"] = single_file_case(args, work, toks)
        if not args.skip_memory and not args.only_single_file:
            big = build_text(work / "corpus4x", 4 * args.mb)
            results["peak_driver_rss_mib"] = {
                "1x": round(peak_rss("packed_lm", corpus, work / "m1", toks["packed_lm"], args.seq_len, address, args.shard_mb)),
                "4x": round(peak_rss("packed_lm", big, work / "m4", toks["packed_lm"], args.seq_len, address, args.shard_mb)),
            }
        print(json.dumps(results, indent=2))
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
