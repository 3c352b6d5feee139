"""A few clipped ZeRO optimizer steps of a tiny GPT, one of them with a NaN gradient, as the step-patch tests
(test_one_rank.py, and on 2 ranks zero_step_job.py) run them against stock DeepSpeed."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

import models
from pipelines.engine.config import OptimConfig
from pipelines.engine.optim import build_optimizer, deepspeed_optimizer_fields

STEPS, ACCUM, NAN_STEP = 4, 2, 2


def train(deepspeed, stage: int, precision: str, install: Callable[[Any], list[str]] | None, extra: dict | None = None,
          kernel: str = "default", rank: int = 0, nan_rank: int = 0, nan_in: str = "loss"):
    """Weights, reported norms and skipped steps after ``STEPS`` clipped optimizer steps of a tiny GPT
    (``ACCUM`` micro-batches each, each rank its own; at step ``NAN_STEP`` rank ``nan_rank`` gets a NaN gradient:
    ``nan_in="loss"`` everywhere, as the trainer makes one; ``"embedding"`` in the token embedding's only, so that
    after the reduction one rank's partition holds it and only the all-reduced norm tells the other), and the
    patches ``install`` put in (None: stock DeepSpeed).
    ``kernel="fused"``: torch's fused AdamW, with which the skip is decided on the device."""
    from pipelines.engine.zero_step import device_step, host_grad_norm

    cfg = OptimConfig(name="adamw", lr=1e-2, weight_decay=0.1, grad_clip=0.05, kernel=kernel)  # small: every step clips
    torch.manual_seed(0)
    model = models.create("gpt-tiny", vocab_size=64)
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ACCUM,
                 # a small bucket: stock DeepSpeed reduces it several times within one backward
                 "zero_optimization": {"stage": stage, "contiguous_gradients": True, "overlap_comm": False,
                                       "reduce_bucket_size": 20_000},
                 "bf16": {"enabled": precision == "bf16"}, **deepspeed_optimizer_fields(cfg), **(extra or {})}
    engine, *_ = deepspeed.initialize(model=model, optimizer=build_optimizer(model, cfg), config=ds_config)
    installed = [] if install is None else install(engine)
    g = torch.Generator().manual_seed(1 + rank)
    norms, skipped = [], []
    for step in range(STEPS):
        for micro in range(ACCUM):
            ids = torch.randint(0, 64, (2, 8), generator=g)
            loss = engine(input_ids=ids, labels=ids)["loss"]
            poisoned = step == NAN_STEP and micro == ACCUM - 1 and rank == nan_rank
            if poisoned and nan_in == "loss":
                loss = loss * float("nan")
            hook = (engine.module.wte.weight.register_hook(lambda g: g * float("nan"))
                    if poisoned and nan_in == "embedding" else None)
            engine.backward(loss)
            if hook is not None:
                hook.remove()
            engine.step()
        pending = device_step(engine)  # as DeepSpeedEngine.step reads them: a step later, or before the update
        if pending is not None:
            (norm,) = pending.tolist()
            norms.append(norm)
            skipped.append(not math.isfinite(norm))
        else:
            norms.append(host_grad_norm(engine))
            skipped.append(not engine.was_step_applied())
    weights = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    return weights, norms, skipped, installed


def same(a, b) -> None:
    """Two runs of ``train``: the same skipped step, the same norms and the same weights, bitwise."""
    (wa, na, sa, _), (wb, nb, sb, _) = a, b
    assert sa == sb == [i == NAN_STEP for i in range(STEPS)], (sa, sb)
    assert all(float(x) == float(y) for x, y in zip(na, nb, strict=True) if math.isfinite(float(x))), (na, nb)
    assert [math.isfinite(float(x)) for x in na] == [math.isfinite(float(y)) for y in nb], (na, nb)
    assert all(torch.equal(wa[n], wb[n]) for n in wa), [n for n in wa if not torch.equal(wa[n], wb[n])]
