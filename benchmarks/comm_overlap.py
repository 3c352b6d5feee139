"""Does the gradient communication overlap the backward? DeepSpeed ZeRO-2 and DDP, eager and compiled, on 2 ranks.

A data-parallel step hides its gradient reduction only where a bucket's collective starts while the backward
is still computing: on a GPU it then runs on its own stream beside the backward's kernels. This runs one
backward of a small GPT on each rank under ``torch.profiler`` and counts the collectives that start before
the backward's last compute node ends (the host's order is the order the streams get their work). Eager,
both engines reduce buckets as they fill. Under ``torch.compile`` the backward is one autograd node unless
dynamo splits the graph: it does for DDP (its DDPOptimizer cuts the graph at DDP's buckets, whether DDP wraps the
compiled module, as our DDP engine builds it, or is compiled itself), not for DeepSpeed,
whose gradient hooks then all fire after the compiled backward has queued its last kernel -- unless the blocks are
compiled one graph each (``model.compile_regions``, ``pipelines.engine.model_build.compile_each_block_``).

    torchrun --nproc_per_node 2 benchmarks/comm_overlap.py      # gloo on CPU; nccl on GPUs

Prints one line per case (rank 0): collectives, and how many started during the backward's compute.
Issue #30: which engine's communication the multi-GPU plan may count as hidden (``pretrain plan``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as td

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VOCAB, BATCH, SEQ = 8192, 4, 64
BUCKETS = 6  # the model's gradients in about this many buckets


def _model():
    import models

    torch.manual_seed(0)
    return models.create("gpt-tiny", vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0)


def _ddp(compiled: bool):
    model = _model()
    cap_mb = max(1.0, sum(p.numel() * p.element_size() for p in model.parameters()) / BUCKETS / 2**20)  # >= DDP's first bucket
    model = model.to(_device())  # compiled, then wrapped: the order the DDP engine builds it in (engines.build_engine)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.compile(model) if compiled else model, bucket_cap_mb=cap_mb)
    return ddp, lambda loss: loss.backward()


def _deepspeed(compiled: bool | str):
    import deepspeed

    from pipelines.engine.config import OptimConfig
    from pipelines.engine.optim import build_optimizer, deepspeed_optimizer_fields

    model, cfg = _model(), OptimConfig(name="adamw", lr=1e-3, kernel="default")
    numel = sum(p.numel() for p in model.parameters())
    ds = {"train_micro_batch_size_per_gpu": BATCH, "zero_optimization": {"stage": 2, "overlap_comm": False,
                                                                          "reduce_bucket_size": numel // BUCKETS},
          **deepspeed_optimizer_fields(cfg)}
    engine, *_ = deepspeed.initialize(model=model, optimizer=build_optimizer(model, cfg), config=ds)
    if compiled == "blocks":  # as the engine compiles it with model.compile_regions=blocks (auto on several GPUs)
        from pipelines.engine.model_build import compile_each_block_

        compile_each_block_(engine.module, {})
    if compiled:
        engine.compile()
    return engine, engine.backward


def _device() -> torch.device:
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")


def overlapped(step_model, backward) -> tuple[int, int]:
    """(collectives in one backward, collectives that started before its last compute node ended)."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device=_device())
    for _ in range(3):  # warm-up: compilation, DDP's bucket rebuild after its first step
        backward(step_model(input_ids=ids, labels=ids)["loss"])
    loss = step_model(input_ids=ids, labels=ids)["loss"]
    with torch.profiler.profile() as prof:
        backward(loss)
    events = list(prof.events())
    compute = [e for e in events if ("Backward" in e.name or "CompiledFunction" in e.name)
               and "AccumulateGrad" not in e.name and not e.name.startswith("autograd::engine")]
    collectives = [e for e in events if e.name in ("c10d::allreduce_", "c10d::reduce_scatter_", "c10d::_reduce_scatter_base_")]
    end = max(e.time_range.end for e in compute)
    return len(collectives), sum(e.time_range.start < end for e in collectives)


def main() -> int:
    import deepspeed

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(_device())
    modes = {False: "eager", True: "compiled", "blocks": "compiled block by block"}
    for name, build, compiles in (("deepspeed zero2", _deepspeed, (False, True, "blocks")), ("ddp", _ddp, (False, True))):
        for compiled in compiles:
            torch._dynamo.reset()  # no compiled code shared between cases (dynamo would reuse DDP's split graph)
            total, early = overlapped(*build(compiled))
            if td.get_rank() == 0:
                print(f"{name:15s} {modes[compiled]:23s}: {total:2d} collectives in the backward, "
                      f"{early:2d} started during its compute", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
