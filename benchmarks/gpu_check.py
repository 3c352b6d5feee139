"""The GPU recipes as a user runs them, in one table: throughput, MFU, data wait and peak memory per engine.

Issue #30's check, meant to run the moment a GPU is at hand (``benchmarks/gpu_check.sh`` wraps it on a
machine without this repo's environment). Two steps, because Ray (``pretrain prepare``) is not on the
GPU machines:

    python benchmarks/gpu_check.py prepare [--out .gpu_check]     # here, on the CPU: corpora with our own prepare
    python benchmarks/gpu_check.py run [--corpora .gpu_check]     # there, on the GPU

``prepare`` writes a synthetic text (Zipf-distributed pseudo-words, so a 50,257-token BPE and a 30,522-token
WordPiece are fully trained: the recipes' vocabularies, hence their LM-head FLOPs) and synthetic photos-like
images (smooth colour fields, shapes and noise, 256 px), and runs ``pretrain prepare`` on them with the
shipped data configs: ``gpt_packed.yaml`` at seq_len 1024, ``demo_bert.yaml`` at 128, ``digits_images.yaml``
with ``format=raw size=224`` (how the ViT recipe recommends storing images: uint8 pixels at the model's size,
cropped, flipped and normalised on the device; benchmarks/image_decode.py gives the CPU cost of each form).
The corpora are small enough to travel with the device tool (~45 MB, 256 raw images of 150 kB): the runs
loop over them for as many epochs as they need.

``run`` trains each recipe of ``configs/train/gpu/`` (GPT-2 small, BERT-base phase 1, ViT-B/16) with its
own micro batch, precision and compile setting, one micro-batch per optimizer step (``train.global_batch_size``
set to it: each GPU's step on the GPUs the recipe is written for; BERT-base's 256 is one GPU's micro-batch),
once under DeepSpeed ZeRO-2 (the recipe as shipped) and
once with ``distributed.engine=ddp``, each as ``torchrun --nproc_per_node 1 -m pipelines.pretrain CONFIG
data.corpus=C ...``; the figures are the run's own (``metrics.jsonl``'s last train record: tokens or
images/s, MFU, data-wait share and peak device memory, averaged by ``ThroughputMeter`` over the last 20
steps, the first 20 of 40 with compilation and the loader's start-up left out), beside the peak memory
``pretrain plan`` gives the run's resolved config (its memory model checked on every GPU run). The bare step (``model_step.py``: forward, backward, fused AdamW on one batch kept on the device,
compiled where the recipe compiles) gives each recipe's ceiling; the same process also times issue #30's
baseline, the model as a plain PyTorch loop writes it (``benchmarks/plain_gpt.py``, ``plain_bert.py``,
``plain_vit.py``), as the row "plain loop", and for GPT-2 the bare step with the recipes' clipping ("bare + clip") and with the trainer's two host reads per step
added ("bare + clip + 2 reads"): what those reads cost on the device's side, apart from the engine. Evaluation (``data.eval_split=none``) and
periodic checkpoints are off (not per-step costs; a compiled model would also recompile for eval mode);
the run's final checkpoint comes after the timed steps and counts in the wall time only. Under each row the log
repeats what torch said of the run's compiled graphs (CUDA graphs skipped and why, recompiles, graph breaks).
Before each recipe's rows, ``attention_backends.py`` prints which attention kernel SDPA picks for the recipe's
attention on this device and what cuDNN's, flash's and the cutlass kernel cost on it.

``--cpu-smoke`` runs the same pipeline end to end on the CPU with the tiny CPU configs, tiny corpora and
a few steps (fp32): it proves the script, not a speed.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
PROFILE_ROWS = 25
RECIPES = ("gpt", "bert", "vit")
ENGINES = ("deepspeed", "ddp")  # the default rows; --engines also takes any other ENGINE_OVERRIDES name
ENGINE_OVERRIDES = {"deepspeed": [], "ddp": ["distributed.engine=ddp"], "zero0": ["distributed.zero_stage=0"],
                    "zero1": ["distributed.zero_stage=1"], "zero3": ["distributed.zero_stage=3", "model.compile=false"],
                    # ZeRO-2 without the one-rank fast path (pipelines/engine/one_rank.py): its before/after in one run
                    "zero2-stock": ["distributed.one_rank_fast_path=false"],
                    # every step's values read at once (as before reading them a step late): that change's before/after
                    "zero2-read-now": ["train.read_late=false"], "ddp-read-now": ["distributed.engine=ddp", "train.read_late=false"],
                    # BERT batches as long as their longest pair, masked rows as drawn (before data.fixed_shapes)
                    "ddp-dynamic": ["distributed.engine=ddp", "data.fixed_shapes=false"],
                    "zero2-dynamic": ["data.fixed_shapes=false"],
                    # torch.compile replaying CUDA graphs: the host's launches per step go, if the engine allows it
                    "ddp-cudagraphs": ["distributed.engine=ddp", "model.compile_mode=reduce-overhead"],
                    "zero2-cudagraphs": ["model.compile_mode=reduce-overhead"],
                    # inductor launching the kernels from C++ instead of Python: less host time per kernel, no graphs
                    "ddp-cppwrapper": ["distributed.engine=ddp", "model.compile_options={cpp_wrapper: true}"],
                    "zero2-cppwrapper": ["model.compile_options={cpp_wrapper: true}"],
                    # inductor's Triton matmul templates, autotuned, with the pointwise work after a matmul fused into it
                    # (GELU, bias, dropout + residual: one pass fewer over their outputs; minutes of autotuning first)
                    "zero2-autotune": ["model.compile_mode=max-autotune-no-cudagraphs"],
                    # DeepSpeed's throughput timer as it ships (on, a device synchronize per forward and per step)
                    "zero2-synced-timer": ["distributed.deepspeed_config={work}/timer_on.json"],
                    # the attention kernel SDPA tries first (attention_backends.py's table, printed before each recipe's
                    # rows, says which one torch picks and what the others cost on the recipe's shape)
                    "zero2-cudnn": ["model.attention_backend=cudnn"], "zero2-flash": ["model.attention_backend=flash"],
                    # one compiled graph per transformer block, as ZeRO-1/2 compile on several GPUs (model.compile_regions
                    # auto): what the split costs on one GPU, where auto keeps the one graph
                    "zero2-blocks": ["model.compile_regions=blocks"]}
TIMER_ON = {"timers": {"throughput": {"enabled": True, "synchronized": True}}}  # DeepSpeed's defaults

# recipe -> train config, data config, prepare overrides, text or images; the tiny CPU stand-ins for --cpu-smoke
GPU = {
    "gpt": ("configs/train/gpu/gpt2_small.yaml", "configs/data/gpt_packed.yaml", ["seq_len=1024", "tokenizer.vocab_size=50257"]),
    "bert": ("configs/train/gpu/bert_base_phase1.yaml", "configs/data/demo_bert.yaml", ["seq_len=128", "tokenizer.vocab_size=30522"]),
    "vit": ("configs/train/gpu/vit_b16.yaml", "configs/data/digits_images.yaml", ["images.format=raw", "images.size=224"]),
}
CPU = {
    "gpt": ("configs/train/gpt_tiny_cpu.yaml", "configs/data/gpt_packed.yaml", ["seq_len=64", "tokenizer.vocab_size=2000"]),
    "bert": ("configs/train/bert_tiny_cpu.yaml", "configs/data/demo_bert.yaml", ["seq_len=64", "tokenizer.vocab_size=2000"]),
    "vit": ("configs/train/vit_tiny_cpu.yaml", "configs/data/digits_images.yaml", ["images.format=raw", "images.size=32"]),
}
# (text MB, images, image px) per mode
SIZES = {"gpu": (3.0, 256, 256), "cpu": (0.3, 96, 48)}
BARE = {  # recipe -> model_step.py arguments of the recipe's model and batch (filled from the run config)
    "gpt": ["--seq-len", "1024"], "bert": ["--seq-len", "128"], "vit": [],
}


# ------------------------------------------------------------------------------------------- prepare
def write_text(out: Path, megabytes: float, seed: int = 0) -> None:
    """Documents of sentences of pseudo-words drawn from a Zipf law over 80,000 words (blank line between
    documents), split over 16 files: every vocabulary size the recipes use gets fully trained."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    freq = 1.0 / np.arange(1, 27) ** 0.9
    lengths = rng.integers(2, 11, 80_000)
    words = ["".join(rng.choice(letters, n, p=freq / freq.sum())) for n in lengths]
    ranks = 1.0 / np.arange(1, len(words) + 1) ** 1.07
    p = ranks / ranks.sum()
    out.mkdir(parents=True, exist_ok=True)
    per_file = int(megabytes * 1e6 / 16)
    for f in range(16):
        docs, size = [], 0
        while size < per_file:
            sentences = []
            for _ in range(int(rng.integers(6, 25))):
                w = rng.choice(len(words), int(rng.integers(5, 21)), p=p)
                sentences.append(" ".join(words[i] for i in w).capitalize() + ".")
            doc = " ".join(sentences)
            docs.append(doc)
            size += len(doc) + 2
        (out / f"part-{f:02d}.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")


def write_images(out: Path, count: int, size: int, classes: int = 10, seed: int = 0) -> None:
    """``count`` RGB PNGs in ``classes`` folders: a smooth colour field, a few ellipses, sensor-like noise
    (so JPEG sizes and decode times are those of photos, not of flat test patterns)."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size] / size
    for i in range(count):
        label = i % classes
        base = np.stack([np.sin(xx * rng.uniform(1, 6) + rng.uniform(0, 6)) * 0.5 + 0.5 for _ in range(3)], -1)
        base[..., label % 3] = base[..., label % 3] * 0.5 + 0.5  # the class tints one channel
        img = Image.fromarray((base * 255).astype(np.uint8))
        draw = ImageDraw.Draw(img)
        for _ in range(int(rng.integers(3, 8))):
            x0, y0 = rng.integers(0, size, 2)
            w, h = rng.integers(size // 8, size // 2, 2)
            draw.ellipse([int(x0), int(y0), int(x0 + w), int(y0 + h)], fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
        pixels = np.asarray(img).astype(np.int16) + rng.normal(0, 8, (size, size, 3)).astype(np.int16)
        folder = out / f"class_{label:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(folder / f"{i:05d}.png")


def _prepared(corpus: Path) -> bool:
    """The corpus is there and trains: not raw pixels of an older prepare (resized twice; training refuses them,
    and re-running prepare on the directory rewrites them)."""
    if not (corpus / "manifest.json").is_file():
        return False
    images = json.loads((corpus / "manifest.json").read_text()).get("images") or {}
    return images.get("format") != "raw" or "crop" in images


def prepare(args: argparse.Namespace) -> int:
    mode = "cpu" if args.cpu_smoke else "gpu"
    table, (text_mb, n_images, px) = (CPU if args.cpu_smoke else GPU), SIZES[mode]
    out = Path(args.out).resolve()
    src = out / "sources"
    todo = [name for name in args.recipes.split(",") if not _prepared(out / name)]
    for name in sorted(set(args.recipes.split(",")) - set(todo)):
        print(f"{out / name}: prepared already", flush=True)
    if todo and not (src / "text").is_dir():  # the synthetic sources only where a corpus is still to make
        write_text(src / "text", text_mb)
    if todo and not (src / "images").is_dir():
        write_images(src / "images", n_images, px)
    for name in todo:
        _, data_cfg, extra = table[name]
        target = out / name
        source = ("[{type: image_folder, paths: [" + str(src / "images") + "]}]" if name == "vit"
                  else "[{type: text, paths: [" + str(src / "text") + "/*.txt], text_mode: " +
                  ("paragraphs" if name == "bert" else "file") + "}]")
        cmd = [sys.executable, "-m", "pipelines.cli", "prepare", data_cfg, f"output={target}", f"sources={source}",
               "shard_target_mb=16", *extra]
        print("$ " + " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=REPO, check=True)
        print(f"{name}: prepared in {time.perf_counter() - t0:.0f} s", flush=True)
    shutil.rmtree(src, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{out}: {size / 2**20:.1f} MiB", flush=True)
    return 0


# ----------------------------------------------------------------------------------------------- run
def recipe_config(config: str, args: argparse.Namespace):
    """The recipe's run config with the overrides every run of this check gets (``--set``)."""
    from core.config import load_config
    from pipelines.engine.config import RunConfig

    return load_config(REPO / config, list(args.set), cls=RunConfig)


def run_command(name: str, engine: str, corpus: Path, work: Path, args: argparse.Namespace, micro: int) -> list[str]:
    """The command line of one row's run: the recipe as a user runs it, at micro batch ``micro`` (the recipe's)."""
    config = (CPU if args.cpu_smoke else GPU)[name][0]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--standalone",
           "-m", "pipelines.pretrain", config, f"data.corpus={corpus}", f"train.run_dir={work / f'{name}-{engine}'}",
           f"train.max_steps={args.steps}", f"train.log_every={args.steps // 2}", "train.eval_every=0",
           "data.eval_split=none", "train.checkpoint_every=0", "distributed.world_free_checkpoints=false",
           "logging.tensorboard=false", "train.resume=never", "train.overwrite=true"]
    # one micro-batch per optimizer step: each GPU's step of the recipe on the GPUs it is written for (one GPU alone
    # accumulates the rest of the recipe's train.global_batch_size, which amortizes the update further)
    cmd += [f"train.global_batch_size={micro}"]
    cmd += [o.replace("{work}", str(work)) for o in ENGINE_OVERRIDES[engine]] + list(args.set)
    if args.profile:  # three steps after compilation, before the timed half (steps // 2 + 1 ..): the figures stay unprofiled
        first = max(3, args.steps // 2 - 4)
        cmd += [f"logging.profile_steps={first}-{first + 2}"]
    if args.cpu_smoke:
        cmd += ["data.num_workers=1", "data.micro_batch_size=8"]
    return cmd


def micro_batch(name: str, args: argparse.Namespace) -> int:
    """The micro batch of a recipe's rows: the recipe's own (after ``--set``); 8 in a CPU smoke run."""
    return 8 if args.cpu_smoke else recipe_config(GPU[name][0], args).data.micro_batch_size


def write_row_files(work: Path) -> None:
    """The files rows point at (``{work}`` in ENGINE_OVERRIDES): DeepSpeed's timer as it ships, for ``zero2-synced-timer``."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "timer_on.json").write_text(json.dumps(TIMER_ON))


def check_rows(args: argparse.Namespace, corpora: Path, work: Path) -> list[str]:
    """Every row's run config loaded and checked as ``pretrain`` checks it on one GPU, before the first run: a
    misspelt row or ``--set`` costs seconds, not the minutes of the rows before it (a lease is short)."""
    from core.config import ConfigError
    from pipelines.engine.check import check
    from pipelines.engine.config import load_run_config

    errors = []
    for name in args.recipes.split(","):
        if name not in RECIPES:
            errors.append(f"--recipes {name}: no such recipe (one of {', '.join(RECIPES)})")
            continue
        for engine in args.engines.split(","):
            if engine not in ENGINE_OVERRIDES:
                near = difflib.get_close_matches(engine, ENGINE_OVERRIDES, n=1)
                errors.append(f"--engines {engine}: no such row{f' (did you mean {near[0]}?)' if near else ''}; "
                              f"the rows are {', '.join(ENGINE_OVERRIDES)}")
                continue
            try:
                cmd = run_command(name, engine, corpora / name, work, args, micro_batch(name, args))
                at = cmd.index("pipelines.pretrain") + 1
                check(load_run_config(REPO / cmd[at], cmd[at + 1:]), world_size=1)
            except ConfigError as exc:
                errors.append(f"{name} {engine}: {exc}")
    return list(dict.fromkeys(errors))  # a misspelt row once, not once per recipe


def train_once(name: str, engine: str, corpus: Path, work: Path, args: argparse.Namespace, micro: int) -> dict:
    """One recipe run as a user runs it, at micro batch ``micro`` (the recipe's); the run's own last train record (+ wall time)."""
    run_dir = work / f"{name}-{engine}"
    cmd = run_command(name, engine, corpus, work, args, micro)
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    # torch logs recompiles and graph breaks only when asked (compile time only: the timed steps are unaffected)
    env = {**os.environ, "TORCH_LOGS": os.environ.get("TORCH_LOGS", "recompiles,graph_breaks")}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        print(proc.stdout[-3000:] + proc.stderr[-6000:], flush=True)
        return {"error": f"rc {proc.returncode}", "wall_s": wall}
    for line in compile_notes(proc.stdout + proc.stderr):
        print(f"  {line}", flush=True)
    if args.profile and (run_dir / "profile/rank-00000.txt").is_file():  # the operator table into the log
        print("\n".join((run_dir / "profile/rank-00000.txt").read_text().splitlines()[:PROFILE_ROWS + 5]), flush=True)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if r.get("split") == "train" and "tokens_per_s" in r][-1]
    return {**last, "wall_s": wall, "plan_gib": planned_gib(run_dir)}


#: torch's log lines on a run's compiled graphs that a throughput figure depends on: CUDA graphs skipped (and why:
#: inductor warns "skipping cudagraphs due to ..." once per graph), recompiles, graph breaks, the recompile limit
COMPILE_NOTES = re.compile(r"\[__(?:cudagraphs|recompiles|graph_breaks)\]|skipping cudagraphs|recompile_limit")


def compile_notes(output: str, limit: int = 12) -> list[str]:
    """The lines of a run's output that say how torch compiled it (``COMPILE_NOTES``), each once, at most ``limit``."""
    seen = dict.fromkeys(re.sub(r"^.*?\.py:\d+\] ", "", line.strip())  # without the logger's rank/time/file prefix
                         for line in output.splitlines() if COMPILE_NOTES.search(line))
    return list(seen)[:limit]


def planned_gib(run_dir: Path) -> float | None:
    """What ``pretrain plan`` says the run needs per GPU (its resolved config, its corpus, one GPU), in GiB: each
    run checks the plan's memory model against the peak the run measured."""
    from pipelines.engine.config import load_run_config
    from pipelines.ops import plan

    try:
        made = plan.make_plan(load_run_config(run_dir / "config.yaml"), plan.PlanOptions(gpus=1, gpus_per_node=1, fs_gbps=10))
    except Exception as exc:  # a figure for the table, never a reason to lose the row
        print(f"plan of {run_dir}: {exc}", flush=True)
        return None
    return made.run_row.total / 2**30


def bare_step(name: str, args: argparse.Namespace, work: Path, corpus: Path) -> dict:
    cfg = recipe_config((CPU if args.cpu_smoke else GPU)[name][0], args)
    out = work / f"bare-{name}.json"
    cmd = [sys.executable, "benchmarks/model_step.py", "--model", cfg.model.name, "--batch", str(cfg.data.micro_batch_size),
           "--no-hf", "--json", str(out), *_vocab(corpus), "--steps", str(max(3, args.steps // 3)), "--warmup", "3" if not args.cpu_smoke else "1",
           "--attention-backend", cfg.model.attention_backend]
    cmd.append("--plain")  # issue #30's baseline, the model as a plain PyTorch loop writes it, in the same process
    if name == "gpt":
        cmd.append("--trainer-reads")  # the bare step with clipping, and with the trainer's two host reads
    if args.cpu_smoke:
        ov = _scalar_overrides(cfg)
        if name == "vit":
            ov["image_size"] = cfg.data.image_size
        cmd += ["--device", "cpu", "--precision", "fp32", "--seq-len", "64"] + (["--overrides", ",".join(f"{k}={v}" for k, v in ov.items())] if ov else [])
        cmd += ["--batch", "8"]
    else:
        cmd += ["--precision", "bf16", *BARE[name]] + (["--compile"] if cfg.model.compile else [])
        # the recipe's model as its run builds it: its overrides (dropout), image size, padded vocabulary
        ov = _scalar_overrides(cfg)
        if name == "vit":
            ov["image_size"] = cfg.data.image_size
        if name != "vit" and cfg.model.pad_vocab_multiple != 1:
            ov["pad_vocab_multiple"] = cfg.model.pad_vocab_multiple
        if ov:
            cmd += ["--overrides", ",".join(f"{k}={v}" for k, v in ov.items())]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-2000:] + proc.stderr[-4000:], flush=True)
        return {"error": f"rc {proc.returncode}", "wall_s": time.perf_counter() - t0}
    rows = {r["model"]: r for r in json.loads(out.read_text())["rows"]}
    ours = rows["ours, compiled" if "ours, compiled" in rows else "ours"]  # the compiled row where the recipe compiles
    extra = {"plain loop": rows.get("plain, compiled", rows.get("plain")), "bare + clip": rows.get("ours, clipped"),
             "bare + clip + 2 reads": rows.get("ours, clipped + 2 reads")}
    return {**ours, "wall_s": time.perf_counter() - t0, "extra": {k: v for k, v in extra.items() if v}}


ATTENTION_TABLE_S = 120


def attention_kernels(name: str, args: argparse.Namespace) -> None:
    """Print which SDPA kernel the recipe's attention gets on this device and what the others cost on its shape
    (``attention_backends.py``; a few seconds): whether a ``zero2-cudnn`` / ``zero2-flash`` row is worth its run."""
    cmd = [sys.executable, "benchmarks/attention_backends.py", "--recipes", name, *(f"--set={kv}" for kv in args.set)]
    if args.cpu_smoke:
        cmd += ["--device", "cpu", "--precision", "fp32", "--batch", "2", "--steps", "2", "--warmup", "1"]
    try:  # a few seconds; a hang must not take the call's budget from the recipe's rows
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=ATTENTION_TABLE_S)
    except subprocess.TimeoutExpired:
        print(f"attention_backends.py: stopped after {ATTENTION_TABLE_S} s", flush=True)
        return
    print(proc.stdout if proc.returncode == 0 else f"attention_backends.py: rc {proc.returncode}\n{proc.stderr[-2000:]}",
          flush=True)


def _scalar_overrides(cfg) -> dict:
    """The recipe's model overrides that ``model_step.py --overrides`` takes: sizes, rates and switches."""
    return {k: str(v).lower() if isinstance(v, bool) else v for k, v in cfg.model.overrides.items() if isinstance(v, (int, float))}


def _vocab(corpus: Path) -> list[str]:
    """The model's vocabulary as the run builds it: the corpus tokenizer's size (images: none)."""
    tok = json.loads((corpus / "manifest.json").read_text()).get("tokenizer") or {}
    return ["--vocab-size", str(tok["vocab_size"])] if tok.get("vocab_size") else []


def run(args: argparse.Namespace) -> int:
    import torch

    corpora = Path(args.corpora).resolve()
    missing = [n for n in args.recipes.split(",") if not (corpora / n / "manifest.json").is_file()]
    if missing:
        print(f"error: {corpora} has no prepared corpus for {', '.join(missing)}. Run `python benchmarks/gpu_check.py "
              f"prepare --out {args.corpora}{' --cpu-smoke' if args.cpu_smoke else ''}` first (on a machine with Ray).",
              file=sys.stderr)
        return 2
    work = Path(args.work).resolve()
    write_row_files(work)
    errors = check_rows(args, corpora, work)
    if errors:
        print("error: no run started; fix these rows first:\n" + "\n".join(f"- {e}" for e in errors), file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results: list[tuple[str, str, int, dict]] = []
    for name in args.recipes.split(","):
        batch = micro_batch(name, args)
        attention_kernels(name, args)
        for engine in args.engines.split(","):
            results.append((name, engine, batch, train_once(name, engine, corpora / name, work, args, batch)))
            _print_table(results, device, started)
        if not args.no_bare:
            results.append((name, "bare step", batch, bare_step(name, args, work, corpora / name)))
            for label, row in results[-1][3].get("extra", {}).items():  # timed in the bare step's process
                results.append((name, label, batch, {**row, "wall_s": 0.0}))
            _print_table(results, device, started)
    if args.json:
        Path(args.json).write_text(json.dumps([{"recipe": n, "engine": e, "batch": b, **r} for n, e, b, r in results], indent=1))
    return 1 if any("error" in r for *_, r in results) else 0


def _print_table(results: list, device: str, started: str) -> None:
    """The whole table so far (a run stopped at its time limit still leaves the finished rows)."""
    print(f"\n## gpu_check: {device}, torch {__import__('torch').__version__}, {started}\n")
    print("| recipe | engine | micro batch | tokens or images/s | MFU | data wait | peak mem GiB (plan) | step ms | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, engine, batch, r in results:
        if "error" in r:
            print(f"| {name} | {engine} | {batch} | {r['error']} | | | | | {r['wall_s']:.0f} |")
            continue
        if "ms_per_step" in r:  # a model_step.py row: the bare step, the plain loop, clip / reads
            rate, unit, mfu = r["rate"], r["unit"], r.get("mfu")
            wait, mem, ms = "-", "-", r["ms_per_step"]
        else:
            unit = "images/s" if name == "vit" else "tokens/s"
            rate = r["samples_per_s"] if name == "vit" else r["tokens_per_s"]
            mfu, wait, ms = r.get("mfu"), f"{r['data_wait_share']:.1%}", r["step_time"] * 1e3
            mem = f"{r['mem_peak_mb'] / 1024:.1f}" if "mem_peak_mb" in r else "-"
            mem += f" ({r['plan_gib']:.1f})" if r.get("plan_gib") is not None else ""
        mfu_s = f"{mfu:.1%}" if mfu is not None else "-"
        print(f"| {name} | {engine} | {batch} | {rate:,.0f} {unit} | {mfu_s} | {wait} | {mem} | {ms:.1f} | {r['wall_s']:.0f} |")
    sys.stdout.flush()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="write the corpora (CPU, needs Ray)")
    pp.add_argument("--out", default=".gpu_check")
    pr = sub.add_parser("run", help="train each recipe under each engine, print the table")
    pr.add_argument("--corpora", default=".gpu_check")
    pr.add_argument("--work", default="/tmp/gpu_check_runs")
    pr.add_argument("--steps", type=int, default=40, help="steps per run; figures average the last 20 (>= 22)")
    pr.add_argument("--engines", default=",".join(ENGINES))
    pr.add_argument("--no-bare", action="store_true")
    pr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an override for every training run, e.g. --set model.compile=true (repeatable)")
    pr.add_argument("--json", default="")
    pr.add_argument("--profile", action="store_true",
                    help="torch.profiler over 3 steps of each run before its timed half (logging.profile_steps); "
                         f"the top {PROFILE_ROWS} operators by device time printed after the run")
    for q in (pp, pr):
        q.add_argument("--recipes", default=",".join(RECIPES))
        q.add_argument("--cpu-smoke", action="store_true", help="tiny CPU configs and corpora: proves the script")
    return p


def main() -> int:
    args = build_parser().parse_args()
    os.environ.setdefault("PYTHONPATH", str(REPO))
    return prepare(args) if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    sys.exit(main())
