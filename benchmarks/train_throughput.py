"""Training throughput: our engine vs the Hugging Face ``Trainer`` on the same model, data, batch, precision.

For each model (``bert`` -> ``BertForPreTraining``, ``gpt`` -> ``GPT2LMHeadModel``, ``vit`` ->
``ViTForImageClassification``) this script, in one run:

* writes a synthetic corpus in the documented shard format (``tests/pipelines/corpus_fixtures.py``);
* **ours**: ``python -m pipelines.pretrain`` (1 process, DeepSpeed ZeRO-2, ``--precision``,
  ``--workers`` loader workers) for ``--steps`` steps;
* **HF**: a child process running ``transformers.Trainer`` on the equivalent transformers model
  (built from ours with ``models.hf.hf_config``, so sizes match exactly), fed the same decoded
  samples through the same collator (same masking / crops) with the same batch, optimizer (torch
  AdamW with the run config's LR, betas, eps, weight decay and clipping), precision and
  ``dataloader_num_workers``.

``--device cpu`` (the default) trains the tiny CPU configs (``configs/train/*_cpu.yaml``), by default in fp32.
``--device cuda --precision bf16`` trains the GPU recipes on one GPU: GPT-2 small at 1024 tokens
(``configs/train/gpu/gpt2_small.yaml``), BERT-base phase 1 at 128 (``bert_base_phase1.yaml``) and
ViT-B/16 at 224 px (``vit_b16.yaml``), with the models' real vocabularies (the synthetic
tokenizer is padded to them), and micro batches sized for one large GPU (``--batch`` overrides).
bf16 is each side's own: DeepSpeed's bf16 mode for ours (bf16 weights, fp32 master copy),
``TrainingArguments(bf16=True)`` autocast for HF.

Throughput is measured over steps ``--warmup``..``--steps`` from wall-clock timestamps (ours: the
``time`` field of ``metrics.jsonl``, logged every ``--warmup`` steps; HF: a ``TrainerCallback``). Samples/s are
measured; tokens/s = samples/s x the corpus' tokens per sample (images/s for ViT); MFU = FLOPs per
sample (``models.flops``) x samples/s / the peak: the CPU's measured matmul peak, or the GPU's dense
peak for ``--precision`` from ``monitoring.throughput.PEAK_FLOPS``. Each side runs ``--repeats``
times, alternating, and its best rate is kept. Prints one table and the ratio.

On a GPU machine without this repo's environment, ``benchmarks/gpu_train_throughput.sh`` runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "pipelines"))

CONFIGS = {
    "cpu": {"bert": "configs/train/bert_tiny_cpu.yaml", "gpt": "configs/train/gpt_tiny_cpu.yaml", "vit": "configs/train/vit_tiny_cpu.yaml"},
    "cuda": {"bert": "configs/train/gpu/bert_base_phase1.yaml", "gpt": "configs/train/gpu/gpt2_small.yaml",
             "vit": "configs/train/gpu/vit_b16.yaml"},
}
# Defaults per device. GPU: the recipes' sequence lengths (BERT phase 1: 128, GPT-2: 1024); micro batches
# of ~32k tokens (BERT, GPT) or 128 images, which one 80-141 GB GPU holds without activation checkpointing.
SEQ_LEN = {"cpu": {"bert": 128, "gpt": 128, "vit": 0}, "cuda": {"bert": 128, "gpt": 1024, "vit": 0}}
BATCH = {"cpu": {"bert": 32, "gpt": 32, "vit": 32}, "cuda": {"bert": 256, "gpt": 32, "vit": 128}}
WORKERS = {"cpu": 1, "cuda": 4}


def make_corpus(kind: str, root: Path, seq_len: int, samples: int, vocab_size: int = 0, image_size: int = 40) -> Path:
    import corpus_fixtures as cf

    sizes = (samples // 2, samples - samples // 2)
    if kind == "bert":
        return cf.make_bert_corpus(root, train_sizes=sizes, val_sizes=(64,), seq_len=seq_len, vocab_size=vocab_size)
    if kind == "gpt":
        return cf.make_gpt_corpus(root, train_sizes=sizes, val_sizes=(64,), seq_len=seq_len, vocab_size=vocab_size)
    return cf.make_image_corpus(root, train_sizes=sizes, val_sizes=(64,), size=image_size)


def run_ours(kind: str, corpus: Path, run_dir: Path, args: argparse.Namespace) -> float:
    cmd = [sys.executable, "-m", "pipelines.pretrain", CONFIGS[args.device][kind], f"data.corpus={corpus}", f"train.run_dir={run_dir}",
           f"train.max_steps={args.steps}", f"data.micro_batch_size={args.batch}", f"data.num_workers={args.workers}",
           f"train.global_batch_size={args.batch}",  # one micro-batch per step, as the other side steps (the recipes accumulate)
           "train.eval_every=0", "train.eval_batches=1", "train.checkpoint_every=0", f"train.log_every={args.warmup}",
           "logging.tensorboard=false", "logging.progress=false", "distributed.zero_stage=2", "train.resume=never",
           f"optim.lr={args.lr}", f"train.precision={args.precision}", f"model.compile={str(args.compile).lower()}",
           "distributed.world_free_checkpoints=false"]  # the final checkpoint is outside the timing; keep it small
    subprocess.run(cmd, cwd=REPO, check=True, env=_env(args), stdout=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["time"] for r in rows if r.get("split") == "train" and "loss" in r}
    return (args.steps - args.warmup) * args.batch / (times[args.steps] - times[args.warmup])


def run_hf(kind: str, corpus: Path, out: Path, args: argparse.Namespace) -> float:
    cmd = [sys.executable, __file__, "--hf-worker", kind, "--corpus", str(corpus), "--out", str(out), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--batch", str(args.batch), "--workers", str(args.workers), "--lr", str(args.lr),
           "--device", args.device, "--precision", args.precision, *(["--compile"] if args.compile else [])]
    subprocess.run(cmd, cwd=REPO, check=True, env=_env(args))
    return json.loads(out.read_text())["samples_per_s"]


def _env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    return env


def hf_worker(args: argparse.Namespace) -> None:
    """Child process: transformers.Trainer on the equivalent HF model and the same collated batches."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import models
    from pipelines.engine import objectives as tasks
    from pipelines.engine.config import load_run_config
    from pipelines.engine.trainer import build_model
    from pipelines.loading import loader as data

    cfg = load_run_config(REPO / CONFIGS[args.device][args.hf_worker], [f"data.corpus={args.corpus}"])
    kind = {"bert": "bert_pairs", "gpt": "packed_lm", "vit": "images"}[args.hf_worker]
    m = data.load_manifest(args.corpus, kind=kind)
    task = tasks.build_task(cfg, m)
    ours, _ = build_model(cfg, task)
    hf_model = models.hf.to_hf(ours).train()
    shards = m.shards("train")
    raw = [(k, p) for _, k, p in data.read_samples(m, shards, 0, sum(s.samples for s in shards))]

    class Samples(torch.utils.data.Dataset):
        """Raw shard bytes in memory, decoded per item like our loader does (PNG decode, frombuffer)."""

        def __len__(self):
            return len(raw)

        def __getitem__(self, i):
            return data.decode_sample(m.kind, raw[i][0], raw[i][1], m.token_dtype)

    def collate(items):
        batch = task.collate(items, epoch=0, train=True)
        return {k: v for k, v in task.model_inputs(batch).items()}

    stamps: dict[int, float] = {}

    class Clock(TrainerCallback):
        def on_step_end(self, _args, state, _control, **_kw):
            if args.device == "cuda" and state.global_step in (args.warmup, args.steps):
                torch.cuda.synchronize()  # the timed steps' kernels have finished, not only been queued
            stamps[state.global_step] = time.time()

    o = cfg.optim
    targs = TrainingArguments(
        output_dir=str(Path(args.out).parent / "hf_out"), per_device_train_batch_size=args.batch, max_steps=args.steps,
        learning_rate=args.lr, adam_beta1=o.betas[0], adam_beta2=o.betas[1], adam_epsilon=o.eps, weight_decay=o.weight_decay,
        max_grad_norm=o.grad_clip, optim="adamw_torch", lr_scheduler_type="linear", warmup_steps=10,
        use_cpu=args.device == "cpu", bf16=args.precision == "bf16", torch_compile=args.compile,
        report_to="none", save_strategy="no", eval_strategy="no", logging_strategy="no",
        dataloader_num_workers=args.workers, disable_tqdm=True, seed=0, remove_unused_columns=False,
    )
    Trainer(model=hf_model, args=targs, train_dataset=Samples(), data_collator=collate, callbacks=[Clock()]).train()
    rate = (args.steps - args.warmup) * args.batch / (stamps[args.steps] - stamps[args.warmup])
    Path(args.out).write_text(json.dumps({"samples_per_s": rate}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="bert,gpt,vit")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10, help="Steps excluded from the timing window; --steps must be a multiple.")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu: the tiny CPU configs; cuda: the GPU recipes.")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--compile", action="store_true", help="torch.compile the model, both sides.")
    p.add_argument("--batch", type=int, default=None, help="Micro batch, both sides (default: 32; GPU: BERT 256, GPT 32, ViT 128).")
    p.add_argument("--seq-len", type=int, default=None, help="Tokens per sample (default: 128; GPU: GPT 1024, BERT 128).")
    p.add_argument("--workers", type=int, default=None, help="DataLoader workers, both sides (default: 1; GPU: 4).")
    p.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for both sides (0 = leave as is).")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--repeats", type=int, default=2, help="Runs per side (alternating); the best rate is reported.")
    p.add_argument("--hf-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--corpus", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.hf_worker:
        hf_worker(args)
        return

    import torch

    import models
    from monitoring.throughput import cpu_peak_flops, peak_flops_for
    from pipelines.engine import objectives as tasks
    from pipelines.engine.config import load_run_config
    from pipelines.engine.trainer import build_model
    from pipelines.loading import loader as data

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda: torch sees no CUDA device.")
        device_name = torch.cuda.get_device_name()
        peak = peak_flops_for(device_name, args.precision)
        header = f"device: {device_name}, {args.precision}, dense peak {peak / 1e12:.1f} TFLOP/s (monitoring.throughput)"
    else:
        peak = cpu_peak_flops(args.precision, seconds=1.0)
        header = f"device: CPU, {torch.get_num_threads()} threads, measured {args.precision} matmul peak {peak / 1e9:.1f} GFLOP/s"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.models.split(","):
            run = argparse.Namespace(**vars(args))  # this model's settings: the defaults of its device
            run.batch = args.batch or BATCH[args.device][kind]
            run.workers = WORKERS[args.device] if args.workers is None else args.workers
            recipe = REPO / CONFIGS[args.device][kind]
            base, gpu = load_run_config(recipe), args.device == "cuda"
            # GPU: the model's real vocabulary (its LM/MLM head is a large share of the FLOPs) and image size
            vocab = getattr(models.get_config(base.model.name), "vocab_size", 0) if gpu else 0
            corpus = make_corpus(kind, Path(tmp) / kind / "corpus", args.seq_len or SEQ_LEN[args.device][kind],
                                 max(512, run.batch * 16), vocab_size=vocab, image_size=base.data.image_size if gpu else 40)
            m = data.load_manifest(corpus)
            cfg = load_run_config(recipe, [f"data.corpus={corpus}"])
            model, _ = build_model(cfg, tasks.build_task(cfg, m))
            flops = models.flops.training_flops_per_sample(model.config, m.seq_len or None)
            del model
            split = m.raw["splits"]["train"]
            per_sample = split["tokens"] / split["samples"] if kind != "vit" else 1.0
            ours = hf = 0.0
            for r in range(args.repeats):  # alternate the two sides; best of N damps load from other jobs
                ours = max(ours, run_ours(kind, corpus, Path(tmp) / kind / f"ours{r}", run))
                hf = max(hf, run_hf(kind, corpus, Path(tmp) / kind / f"hf{r}.json", run))
            unit = "images/s" if kind == "vit" else "tokens/s"
            mfu = (flops / peak) if peak else float("nan")  # no table entry for this GPU: MFU not known
            rows.append((kind, run.batch, m.seq_len, unit, ours * per_sample, hf * per_sample, ours * mfu, hf * mfu, ours / hf))
    print(header)
    print(f"{'model':<6} {'batch':>5} {'seq':>5} {'unit':<9} {'ours':>12} {'HF Trainer':>12} {'MFU ours':>9} {'MFU HF':>8} {'ratio':>6}")
    for kind, b, t, unit, o, h, mo, mh, r in rows:
        print(f"{kind:<6} {b:>5} {t or '-':>5} {unit:<9} {o:>12,.0f} {h:>12,.0f} {mo:>9.1%} {mh:>8.1%} {r:>6.2f}x")


if __name__ == "__main__":
    main()
