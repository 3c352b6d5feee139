"""The bare training step of GPT-2 small: our model vs the equivalent `transformers.GPT2LMHeadModel`, no engine, no loader.

`train_throughput.py` times whole training runs (loader, DeepSpeed, logging). This times only
forward + backward + `AdamW(fused=True)` on one random batch kept on the device, with bf16 autocast
over fp32 weights for both models (``models.hf.to_hf`` makes the HF model from ours, so sizes and
weights match), and, with ``--compile``, ours under ``torch.compile`` too. It says how much of the
peak the model's kernels can reach at all, and so how much of a run's gap to it is the model and
how much the rest. MFU = ``models.flops`` FLOPs per sample x samples/s / the device's dense peak.

    python benchmarks/model_step.py [--device cuda] [--batch 32] [--seq-len 1024] [--steps 30] [--compile]
    python benchmarks/model_step.py --model bert-base --batch 8 --seq-len 128 --no-hf --json out.json
    python benchmarks/model_step.py --model vit-base --batch 128 --no-hf

BERT batches mask 15 % of the positions (MLM+NSP, as the recipe's collator does), ViT batches are
random 224 px images with 1000 classes. ``--json`` writes the rows (``gpu_check.py`` reads them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import models  # noqa: E402
from benchmarks.plain_bert import PlainBERT  # noqa: E402
from benchmarks.plain_gpt import PlainGPT  # noqa: E402
from benchmarks.plain_vit import PlainViT  # noqa: E402
from monitoring.throughput import cpu_peak_flops, peak_flops_for  # noqa: E402
from pipelines.engine.model_build import ATTENTION_KERNELS, preferred_attention  # noqa: E402

#: issue #30's baselines by model family: the model as a plain PyTorch loop writes it (``--plain``)
PLAIN = {"gpt": PlainGPT, "bert": PlainBERT, "vit": PlainViT}


def make_batch(model: torch.nn.Module, batch: int, seq_len: int, dev: torch.device) -> tuple[dict[str, torch.Tensor], float]:
    """One random batch the model's pretraining task feeds it, and the MLM share of positions (BERT)."""
    cfg = model.config
    if model.family == "vit":
        return {"pixel_values": torch.randn(batch, cfg.num_channels, cfg.image_size, cfg.image_size, device=dev),
                "labels": torch.randint(0, cfg.num_labels, (batch,), device=dev)}, 1.0
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=dev)
    if model.family == "gpt":
        return {"input_ids": ids, "labels": ids}, 1.0
    masked = torch.rand(batch, seq_len) < 0.15  # drawn on the host, as the loader masks (objectives.MLMNSPTask)
    return {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": torch.ones_like(ids),
            "labels": torch.where(masked.to(dev), ids, -100), "masked_positions": masked.flatten().nonzero()[:, 0].to(dev),
            "next_sentence_label": torch.randint(0, 2, (batch,), device=dev)}, 0.15


def time_steps(model: torch.nn.Module, inputs: dict[str, torch.Tensor], steps: int, warmup: int, dtype: torch.dtype | None,
               clip: float = 0.0, reads: bool = False) -> float:
    """Seconds per step (forward, backward, AdamW) after `warmup` untimed steps. ``clip``: gradient-norm
    clipping as the recipes clip; ``reads``: the two host reads the trainer made in every step until it read
    them a step late (the loss after the forward, the clipped norm before the update): what they cost."""
    first = next(iter(inputs.values()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=first.is_cuda)
    params = list(model.parameters())
    sync = torch.cuda.synchronize if first.is_cuda else (lambda: None)
    for i in range(warmup + steps):
        if i == warmup:
            sync()
            t0 = time.perf_counter()
        with torch.autocast(first.device.type, dtype=dtype, enabled=dtype is not None):
            loss = model(**inputs)["loss"]
        if reads:
            loss.detach().to(torch.float64).reshape(1).tolist()
        loss.backward()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
            if reads:
                float(norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    return (time.perf_counter() - t0) / steps


def compiled_kernels(model: torch.nn.Module, inputs: dict[str, torch.Tensor], dtype: torch.dtype | None) -> int:
    """How many kernels inductor generates for the model's forward and backward (matmuls and attention
    are library calls, not counted): each is at least one pass over memory, so two models of the same
    math that differ here differ in memory traffic. Compiles a fresh copy (the timed ones keep their cache)."""
    import copy

    from torch._inductor import metrics

    torch._dynamo.reset()
    metrics.reset()
    first = next(iter(inputs.values()))
    with torch.autocast(first.device.type, dtype=dtype, enabled=dtype is not None):
        loss = torch.compile(copy.deepcopy(model))(**inputs)["loss"]
    loss.backward()
    count = metrics.generated_kernel_count
    torch._dynamo.reset()
    return count


def _number(text: str) -> int | float | bool:
    """``"12"`` -> 12, ``"0.1"`` -> 0.1, ``"false"`` -> False (model overrides are sizes, rates or switches)."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        return float(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt2-small")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--compile", action="store_true", help="also time ours under torch.compile")
    p.add_argument("--vocab-size", type=int, default=0, help="the tokenizer's (default: GPT-2's for gpt, the config's else)")
    p.add_argument("--no-hf", action="store_true", help="leave out the transformers model")
    p.add_argument("--plain", action="store_true", help="also time issue #30's baseline, the model as a plain PyTorch "
                   "loop writes it (GPT: benchmarks/plain_gpt.py, BERT: plain_bert.py, ViT: plain_vit.py; compiled with --compile), and print "
                   "ours / plain")
    p.add_argument("--trainer-reads", action="store_true", help="also time ours (compiled with --compile) with the "
                   "recipes' clipping, and with clipping and the trainer's two host reads per step")
    p.add_argument("--attention-backend", default="auto", choices=["auto", *ATTENTION_KERNELS],
                   help="the attention kernel SDPA tries first, as a run's model.attention_backend")
    p.add_argument("--json", default="", help="also write the rows to this JSON file")
    p.add_argument("--overrides", default="", help="model overrides k=v,k=v (e.g. a smaller model to try on CPU, "
                   "the recipe's hidden_dropout=0.0)")
    args = p.parse_args()
    with preferred_attention(args.attention_backend):  # for every model of the process, as for a run's
        run(args)


def run(args: argparse.Namespace) -> None:
    overrides = {k: _number(v) for k, v in (kv.split("=") for kv in args.overrides.split(",") if kv)}
    dev, dtype = torch.device(args.device), torch.bfloat16 if args.precision == "bf16" else None
    torch.manual_seed(0)
    if args.vocab_size:
        overrides["vocab_size"] = args.vocab_size
    elif args.model.startswith("gpt"):
        overrides.setdefault("vocab_size", 50257)  # GPT-2's tokenizer
    ours = models.create(args.model, **overrides)
    ours = ours.to(dev).train()
    inputs, mlm_fraction = make_batch(ours, args.batch, args.seq_len, dev)
    if ours.family == "vit":
        flops, unit, per_sample = models.flops.training_flops_per_sample(ours.config), "images/s", 1
    else:
        flops = models.flops.training_flops_per_sample(ours.config, args.seq_len, mlm_fraction=mlm_fraction)
        unit, per_sample = "tokens/s", args.seq_len
    if dev.type == "cuda":
        name, peak = torch.cuda.get_device_name(dev), peak_flops_for(torch.cuda.get_device_name(dev), args.precision)
    else:
        name, peak = "CPU", cpu_peak_flops("fp32" if dtype is None else "bf16")

    rows = [("ours", time_steps(ours, inputs, args.steps, args.warmup, dtype))]
    if not args.no_hf:
        hf = models.hf.to_hf(ours).to(dev).train()
        hf.config.use_cache = False
        rows.append(("HF", time_steps(hf, inputs, args.steps, args.warmup, dtype)))
        del hf
    if args.compile:
        t0 = time.perf_counter()
        compiled = torch.compile(ours)
        rows.append(("ours, compiled", time_steps(compiled, inputs, args.steps, args.warmup, dtype)))
        print(f"compile + warm-up: {time.perf_counter() - t0 - args.steps * rows[-1][1]:.0f} s")
    if args.trainer_reads:  # what a run's step adds on the device's side: clipping, then the trainer's two reads
        timed = compiled if args.compile else ours
        rows.append(("ours, clipped", time_steps(timed, inputs, args.steps, args.warmup, dtype, clip=1.0)))
        rows.append(("ours, clipped + 2 reads", time_steps(timed, inputs, args.steps, args.warmup, dtype, clip=1.0,
                                                           reads=True)))
    if args.plain and ours.family in PLAIN:
        torch.manual_seed(0)
        plain = PLAIN[ours.family].like(ours.config).to(dev).train()
        label = "plain, compiled" if args.compile else "plain"
        if args.compile:
            print(f"inductor kernels for one forward + backward: ours {compiled_kernels(ours, inputs, dtype)}, "
                  f"plain {compiled_kernels(plain, inputs, dtype)}")
        rows.append((label, time_steps(torch.compile(plain) if args.compile else plain, inputs, args.steps, args.warmup, dtype)))
        del plain
    size = f"{args.batch} x {args.seq_len}" if per_sample > 1 else f"{args.batch} images"
    print(f"device: {name}, {args.precision}, peak {peak / 1e12:.1f} TFLOP/s; {args.model}, batch {size}")
    print(f"{'model':<24} {'ms/step':>8} {unit:>11} {'MFU':>6} {'vs HF':>6}")
    base = rows[1][1] if not args.no_hf else rows[0][1]
    out = []
    for label, sec in rows:
        rate = args.batch * per_sample / sec
        print(f"{label:<24} {sec * 1e3:>8.1f} {rate:>11,.0f} {flops * args.batch / sec / peak:>6.1%} {base / sec:>5.2f}x")
        out.append({"model": label, "ms_per_step": sec * 1e3, "rate": rate, "unit": unit,
                    "mfu": flops * args.batch / sec / peak if peak else None})
    plain_row = next((sec for label, sec in rows if label.startswith("plain")), None)
    if plain_row is not None:
        ours_sec = dict(rows)["ours, compiled" if args.compile else "ours"]
        print(f"ours{', compiled' if args.compile else ''} / plain loop: {plain_row / ours_sec:.3f}x the plain loop's {unit}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "peak_flops": peak, "rows": out}, indent=1))


if __name__ == "__main__":
    main()
