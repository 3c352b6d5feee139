"""Operator counts per step: an engine's step (DDP, DeepSpeed ZeRO-1/2) against the bare compiled step, in the GPU recipe's settings.

Issue #30: on one H100 the GPT-2 recipe under ``distributed.engine=ddp`` took 69 ms a step against the
bare compiled step's 38 ms. Counts, unlike times, carry from one device to another, so this runs both
steps through the real code -- ``engines.build_engine`` as ``pipelines.pretrain`` calls it, with the
recipe's ``torch.compile``, bf16 autocast over fp32 weights, no dropout, padded vocabulary, clip 1.0 --
and prints, per step: aten operators, dtype casts, host reads (``aten::_local_scalar_dense``), the
compiled regions run, dynamo's graphs / graph breaks / recompiles, and each operator the engine runs
more often than the bare step -- on a GPU also the kernel launches, copies and synchronize calls, so
what a host-bound gap between an engine and the bare step is made of. ``--engine zero2`` (or zero1)
counts DeepSpeed's one-rank step, with the recipe's fused AdamW.

    python benchmarks/ddp_step_ops.py [--device cpu|cuda] [--engine ddp|zero1|zero2] [--model gpt-tiny] [--batch 2] [--seq-len 64]
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ENGINES = {"ddp": ["distributed.engine=ddp"], "zero1": ["distributed.engine=deepspeed", "distributed.zero_stage=1"],
           "zero2": ["distributed.engine=deepspeed", "distributed.zero_stage=2"]}
ROWS = ("aten::_to_copy", "aten::copy_", "aten::_local_scalar_dense", "CompiledFunction", "CompiledFunctionBackward",
        "aten::_foreach_norm", "Optimizer.step#AdamW.step", "cudaLaunchKernel", "cudaStreamSynchronize", "cudaEventSynchronize",
        "cudaDeviceSynchronize", "cudaMemcpyAsync")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--engine", default="ddp", choices=sorted(ENGINES))
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--vocab", type=int, default=500, help="not a multiple of 64: the recipe's padding applies")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=2, help="profiled steps per side (after 3 warm-up steps)")
    args = p.parse_args()

    import torch
    from torch._dynamo.utils import counters

    import models
    from core.config import load_config
    from pipelines.engine import distributed as dist
    from pipelines.engine import engines
    from pipelines.engine.config import RunConfig
    from pipelines.engine.host_reads import HostCopy, loss_or_nan
    from pipelines.engine.optim import build_optimizer

    if args.device == "cpu":
        os.environ["ACCELERATE_USE_CPU"] = "true"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(dist.free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    cfg = load_config(REPO / "configs/train/gpt_tiny_cpu.yaml",
                      [*ENGINES[args.engine], "train.precision=bf16", "model.compile=true", "optim.grad_clip=1.0", "optim.kernel=fused",
                       f"data.micro_batch_size={args.batch}"], cls=RunConfig)
    env = dist.init_env()
    dev = torch.device(env.device)
    torch.manual_seed(0)
    model = models.create(args.model, vocab_size=args.vocab, pad_vocab_multiple=64, hidden_dropout=0.0,
                          attention_dropout=0.0).to(dev)
    bare = torch.compile(copy.deepcopy(model).train())
    bare_opt = build_optimizer(bare, cfg.optim, offload=False, device=env.device)
    engine = engines.build_engine(cfg, env, model, build_optimizer(model, cfg.optim, offload=False, device=env.device),
                                  lambda step: 1.0)
    engine.train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), device=dev)
    batch = {"input_ids": ids, "labels": ids}

    def bare_step() -> None:  # benchmarks/model_step.py's step, plus the recipe's clipping
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = bare(**batch)["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(bare.parameters(), 1.0)
        bare_opt.step()
        bare_opt.zero_grad(set_to_none=True)

    late: list[HostCopy] = []

    def engine_step() -> None:  # what Trainer._train_step asks of the engine between log steps
        loss = engine(**batch)["loss"]
        agreed = loss.detach().to(torch.float64).reshape(1)  # the step's agreement (one rank: no collective)
        engine.backward(loss_or_nan(loss, agreed[0]))
        engine.step()  # its outcome is read when the next step() settles it
        if late:
            late.pop().tolist()  # the previous step's agreement, read a step late
        late.append(HostCopy(agreed))

    found = {}
    label = f"{args.engine} engine"
    for name, step in ((label, engine_step), ("bare", bare_step)):  # the engine compiles first; the bare step
        # then reuses its graph when the two are the same (dynamo guards on the module type and its inputs)
        counters.clear()
        for _ in range(3):
            step()
        dyn = (sum(counters["frames"].values()) and counters["frames"]["ok"], counters["stats"]["unique_graphs"],
               sum(counters["graph_break"].values()), sum(counters["recompiles"].values()))
        with torch.profiler.profile() as prof:
            for _ in range(args.steps):
                step()
        ops = collections.Counter({e.key: e.count // args.steps for e in prof.key_averages()})
        found[name] = ops
        print(f"{name}: {sum(v for k, v in ops.items() if k.startswith('aten::'))} aten ops/step; "
              + ", ".join(f"{k} {ops.get(k, 0)}" for k in ROWS)
              + f"; dynamo frames {dyn[0]}, new graphs {dyn[1]}, graph breaks {dyn[2]}, recompiles {dyn[3]}")
    more = {k: found[label][k] - found["bare"].get(k, 0) for k in found[label]}
    print(f"{label} - bare, per step:", ", ".join(f"{k} {v:+d}" for k, v in sorted(more.items(), key=lambda kv: -kv[1]) if v))
    # the torch optimizer that steps: DDP's own, or the one DeepSpeed's ZeRO optimizer steps its fp32 partitions with
    inner = engine._torch_optimizer() if isinstance(engine, engines.DDPEngine) else engine.model.optimizer.optimizer
    print(f"weights {next(engine.module.parameters()).dtype} (bare {next(bare.parameters()).dtype}); engine module "
          f"{type(engine.model).__name__} around {type(engine.module).__name__}; optimizer "
          f"{type(inner).__name__} fused={inner.defaults.get('fused')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
