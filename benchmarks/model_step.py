"""The bare training step of GPT-2 small: our model vs the equivalent `transformers.GPT2LMHeadModel`, no engine, no loader.

`train_throughput.py` times whole training runs (loader, DeepSpeed, logging). This times only
forward + backward + `AdamW(fused=True)` on one random batch kept on the device, with bf16 autocast
over fp32 weights for both models (``models.hf.to_hf`` makes the HF model from ours, so sizes and
weights match), and, with ``--compile``, ours under ``torch.compile`` too. It says how much of the
peak the model's kernels can reach at all, and so how much of a run's gap to it is the model and
how much the rest. MFU = ``models.flops`` FLOPs per sample x samples/s / the device's dense peak.

    python benchmarks/model_step.py [--device cuda] [--batch 32] [--seq-len 1024] [--steps 30] [--compile]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import models  # noqa: E402
from monitoring.throughput import cpu_peak_flops, peak_flops_for  # noqa: E402


def time_steps(model: torch.nn.Module, ids: torch.Tensor, steps: int, warmup: int, dtype: torch.dtype | None) -> float:
    """Seconds per step (forward, backward, AdamW) after `warmup` untimed steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=ids.is_cuda)
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    for i in range(warmup + steps):
        if i == warmup:
            sync()
            t0 = time.perf_counter()
        with torch.autocast(ids.device.type, dtype=dtype, enabled=dtype is not None):
            loss = model(input_ids=ids, labels=ids)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    return (time.perf_counter() - t0) / steps


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
    p.add_argument("--overrides", default="", help="model overrides k=v,k=v (e.g. a smaller model to try on CPU)")
    args = p.parse_args()

    overrides = {k: int(v) for k, v in (kv.split("=") for kv in args.overrides.split(",") if kv)}
    dev, dtype = torch.device(args.device), torch.bfloat16 if args.precision == "bf16" else None
    torch.manual_seed(0)
    ours = models.create(args.model, vocab_size=50257, **overrides).to(dev).train()
    hf = models.hf.to_hf(ours).to(dev).train()
    hf.config.use_cache = False
    ids = torch.randint(0, ours.config.vocab_size, (args.batch, args.seq_len), device=dev)
    flops = models.flops.training_flops_per_sample(ours.config, args.seq_len)
    if dev.type == "cuda":
        name, peak = torch.cuda.get_device_name(dev), peak_flops_for(torch.cuda.get_device_name(dev), args.precision)
    else:
        name, peak = "CPU", cpu_peak_flops("fp32" if dtype is None else "bf16")

    rows = [("ours", time_steps(ours, ids, args.steps, args.warmup, dtype)), ("HF", time_steps(hf, ids, args.steps, args.warmup, dtype))]
    if args.compile:
        t0 = time.perf_counter()
        compiled = torch.compile(ours)
        rows.append(("ours, compiled", time_steps(compiled, ids, args.steps, args.warmup, dtype)))
        print(f"compile + warm-up: {time.perf_counter() - t0 - args.steps * rows[-1][1]:.0f} s")
    print(f"device: {name}, {args.precision}, peak {peak / 1e12:.1f} TFLOP/s; {args.model}, batch {args.batch} x {args.seq_len}")
    print(f"{'model':<15} {'ms/step':>8} {'tokens/s':>11} {'MFU':>6} {'vs HF':>6}")
    hf_s = rows[1][1]
    for label, s in rows:
        print(f"{label:<15} {s * 1e3:>8.1f} {args.batch * args.seq_len / s:>11,.0f} {flops * args.batch / s / peak:>6.1%} {hf_s / s:>5.2f}x")


if __name__ == "__main__":
    main()
