"""Which kernel torch's ``scaled_dot_product_attention`` picks for each GPU recipe's attention, and what every kernel
that accepts that attention costs: forward + backward on the recipe's own shapes, in one process.

SDPA chooses among FlashAttention-2, the memory-efficient (cutlass) kernel, cuDNN's fused attention and the math
fallback by a priority list and per-call constraints: a padding mask (BERT) rules flash out; some torch builds put
cuDNN first on Hopper (``check_prefer_cudnn_attention`` in aten's ``sdp_utils.cpp``, by cuDNN version), others flash;
cuDNN refuses some dropout rates in some versions. Published comparisons on Hopper disagree, by shape and version.
Which kernel a run got is invisible in its throughput; this prints it, and the
others' times beside it, so a lease says whether ``model.attention_backend`` (the kernel a run prefers) is worth
setting for a recipe. ``gpu_check.py`` prints this table before each recipe's rows.

    python benchmarks/attention_backends.py                           # the three GPU recipes' attention, bf16
    python benchmarks/attention_backends.py --recipes bert --device cpu --precision fp32 --batch 4   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu_check import GPU  # noqa: E402  (recipe -> its GPU config, data config, prepare overrides)
from pipelines.engine.model_build import ATTENTION_KERNELS  # noqa: E402

#: the fused kernels a run can prefer (``model.attention_backend``); math is the fallback every call accepts
FUSED = {name: getattr(SDPBackend, kernel) for name, kernel in ATTENTION_KERNELS.items() if name != "math"}


@dataclass
class Attention:
    """One recipe's attention call as a GPU of its run makes it."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    causal: bool
    padding_mask: bool
    dropout: float

    def describe(self) -> str:
        extra = ", causal" * self.causal + ", padding mask" * self.padding_mask + f", dropout {self.dropout:g}" * (self.dropout > 0)
        return f"{self.batch} x {self.heads} heads x {self.seq} x {self.head_dim}{extra}"


def recipe_attention(recipe: str, overrides: list[str] = ()) -> Attention:
    """The attention of ``recipe`` (gpt, bert, vit) on one GPU: its micro batch there, its model's heads and dropout."""
    import models
    from core.config import load_config
    from pipelines.engine.check import batch_split
    from pipelines.engine.config import RunConfig

    path, _, prepared = GPU[recipe]
    cfg = load_config(REPO / path, list(overrides), cls=RunConfig)
    model = models.get_config(cfg.model.name, **cfg.model.overrides)
    seq = next((int(kv.split("=")[1]) for kv in prepared if kv.startswith("seq_len=")), 0)  # as its corpus is prepared
    if not seq:  # ViT: one token per patch, and the class token
        seq = (model.image_size // model.patch_size) ** 2 + 1
    return Attention(batch=batch_split(cfg, 1)[0], heads=model.num_heads, seq=seq, head_dim=model.hidden_size // model.num_heads,
                     causal=recipe == "gpt", padding_mask=recipe == "bert", dropout=model.attention_dropout)


def _inputs(a: Attention, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The fused projection's output [B, T, 3C] and Q, K, V as views of it, as ``models/layers.py`` takes them (the
    strides decide which kernels accept the call), and BERT's padding mask."""
    g = torch.Generator(device="cpu").manual_seed(0)
    width = a.heads * a.head_dim
    qkv = torch.randn(a.batch, a.seq, 3 * width, generator=g).to(device, dtype).requires_grad_()
    q, k, v = (t.view(a.batch, a.seq, a.heads, a.head_dim).transpose(1, 2) for t in qkv.split(width, dim=2))
    mask = None
    if a.padding_mask:  # BERT's batches: every eighth pair padded after 3/4 of the positions (the mask's shape is what matters)
        keep = torch.ones(a.batch, a.seq, dtype=torch.bool)
        keep[::8, a.seq * 3 // 4:] = False
        mask = keep[:, None, None, :].to(device)
    return qkv, q, k, v, mask


def default_backend(a: Attention, q, k, v, mask) -> str:
    """What SDPA picks for this call with every backend allowed (torch's own priority and constraints)."""
    choice = torch._fused_sdp_choice(q, k, v, mask, a.dropout, a.causal)
    return SDPBackend(choice).name.lower().replace("_attention", "")


def time_backend(a: Attention, qkv, q, k, v, mask, backend: SDPBackend | None, steps: int, warmup: int) -> float | str:
    """ms per forward + backward with only ``backend`` allowed (None: SDPA's own choice), or why it refuses the call."""
    sync = torch.cuda.synchronize if q.is_cuda else (lambda: None)
    grad = torch.ones_like(q)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                for i in range(warmup + steps):
                    if i == warmup:
                        sync()
                        t0 = time.perf_counter()
                    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=a.dropout, is_causal=a.causal)
                    torch.autograd.grad(out, qkv, grad)  # a fresh gradient, into the projection's layout as in a layer
                sync()
        except RuntimeError as exc:  # "No available kernel": torch warns why (the kernel's constraint that failed)
            reasons = [re.sub(r"\s*\(Triggered internally at .*\)\s*$", "", str(w.message)) for w in said]
            reasons = [r for r in reasons if r and "not used because" not in r]
            return "; ".join(reasons) or str(exc).splitlines()[0]
    return (time.perf_counter() - t0) / steps * 1e3


def compare(recipe: str, device: torch.device, dtype: torch.dtype, *, batch: int = 0, steps: int = 20, warmup: int = 3,
            overrides: list[str] = ()) -> dict:
    """The recipe's attention, SDPA's pick for it, and every fused kernel's ms per forward + backward."""
    a = recipe_attention(recipe, overrides)
    if batch:
        a.batch = batch
    qkv, q, k, v, mask = _inputs(a, device, dtype)
    picked = default_backend(a, q, k, v, mask)
    times = {"default": time_backend(a, qkv, q, k, v, mask, None, steps, warmup)}
    for name, backend in FUSED.items():
        times[name] = times["default"] if name == picked else time_backend(a, qkv, q, k, v, mask, backend, steps, warmup)
    return {"recipe": recipe, "attention": asdict(a), "shape": a.describe(), "default": picked, "ms": times}


def format_rows(rows: list[dict]) -> str:
    """A markdown table: per recipe, SDPA's pick and each fused kernel's ms (and its ratio to the pick's)."""
    lines = ["| recipe | attention (one GPU's call) | SDPA picks: ms | " + " | ".join(f"{n} ms" for n in FUSED) + " |",
             "|---|---|---|" + "---|" * len(FUSED)]
    for r in rows:
        base = r["ms"]["default"]
        cells = []
        for name in FUSED:
            t = r["ms"][name]
            if isinstance(t, str):
                cells.append("refuses")
            else:
                cells.append(f"{t:.3f}" + (f" ({t / base:.2f}x)" if isinstance(base, float) and name != r["default"] else ""))
        picked = f"{base:.3f}" if isinstance(base, float) else base
        lines.append(f"| {r['recipe']} | {r['shape']} | {r['default']}: {picked} | " + " | ".join(cells) + " |")
    refusals = [f"- {r['recipe']}, {n} refuses: {t}" for r in rows for n, t in r["ms"].items() if isinstance(t, str)]
    return "\n".join(lines + ([""] + refusals if refusals else []))


def _at_least_one(text: str) -> int:
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"needs at least 1 timed step, got {text}")
    return int(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipes", default="gpt,bert,vit")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16", help="the recipes train in bf16")
    p.add_argument("--batch", type=int, default=0, help="another batch than the recipe's on one GPU (a smoke run)")
    p.add_argument("--steps", type=_at_least_one, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--set", action="append", default=[], help="a recipe override (key=value), e.g. data.micro_batch_size=32")
    p.add_argument("--json", default="", help="also write the rows to this JSON file")
    args = p.parse_args()
    device, dtype = torch.device(args.device), torch.bfloat16 if args.precision == "bf16" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    cudnn = torch.backends.cudnn.version() if device.type == "cuda" else None
    rows = [compare(r, device, dtype, batch=args.batch, steps=args.steps, warmup=args.warmup, overrides=args.set)
            for r in args.recipes.split(",")]
    print(f"SDPA kernels, forward + backward, {args.precision}, on {name} (torch {torch.__version__}, cuDNN {cudnn}):")
    print(format_rows(rows), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "torch": torch.__version__, "cudnn": cudnn, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
