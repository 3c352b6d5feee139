"""What our engines add per training step over the bare step, on one process: DDP and DeepSpeed ZeRO-0/1/2/3.

The bare step is forward + backward + ``optimizer.step()`` + ``zero_grad`` of the model with the
optimizer ``build_optimizer`` makes, on one batch kept in memory. The engine step is what
``Trainer._train_step`` asks of the engine for the same batch between log steps: ``engine(**batch)``, the
step's agreement (read a step late), ``engine.backward``, ``engine.step()`` (clipping, the overflow check, the LR
scheduler; DeepSpeed: its gradient hooks, buckets, flat fp32 partitions and their copies). No loader,
no logging: ``logging_overhead.py`` and ``loader_throughput.py`` time those.

Each engine runs in a child process (one accelerate state per process) that times the bare step and
the engine step in alternating blocks on identical copies of the model, and keeps each one's median
block. The overhead is paired: each round times one block of every side back to back, the round's ratio is
engine / bare of those adjacent blocks, and the table gives the median ratio over the rounds with its
interquartile range -- a load change on a shared machine moves both blocks of a round alike, where
the ratio of two independent medians takes the whole drift. Prints one table: ms per step (each side's
median block) and engine / bare - 1 (goal: <= 5 %).

``--stock`` also builds, in the same process, the engine with ``distributed.one_rank_fast_path=false``
(DDP: accelerate's ``DistributedDataParallel`` wrapper kept; DeepSpeed: none of the one-rank patches of
``pipelines.engine.one_rank``, ZeRO-0's skipped all-reduce included) and times it in the same
alternating blocks: the before/after of the one-process fast path as one more ratio, engine / stock.

``--clock cpu`` times this process's CPU time instead of the wall clock: with one thread, what the
other jobs of a busy machine disturb least (they still share its caches).

``--narrow W`` builds the model at width W (``W // 32`` heads, d_ff 4W) with all its layers and parameter
tensors (GPT-2 small: 148, BERT-base: 158), on a short batch: the arithmetic all but vanishes and a step's
time is the host's own -- Python, dispatch, hooks, per-tensor loops -- which on a GPU must hide under
the device's step (GPT-2 small ~35 ms, BERT-base at 45 % MFU ~6 ms on an H100) or bound it.

    python benchmarks/engine_overhead.py [--model gpt-tiny] [--batch 8] [--seq-len 128] [--engines ddp,zero0,zero1,zero2] [--stock] [--clock cpu]
    python benchmarks/engine_overhead.py --model gpt2-small --narrow 64 --batch 2 --seq-len 32 --engines zero2,zero3 --clock cpu

ZeRO-3 replaces ``torch.nn.functional.linear`` for its whole process, so in its child the bare step runs through
DeepSpeed's linear too (a few per cent slower than in the other children).
    python benchmarks/engine_overhead.py --model bert-base --narrow 64 --batch 2 --seq-len 32 --engines ddp,zero2 --stock
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ENGINES = {"ddp": ("ddp", 0), "zero0": ("deepspeed", 0), "zero1": ("deepspeed", 1), "zero2": ("deepspeed", 2),
           "zero3": ("deepspeed", 3)}


def child(args: argparse.Namespace) -> dict:
    import torch

    import models
    from core.config import load_config
    from pipelines.engine import distributed as dist
    from pipelines.engine import engines
    from pipelines.engine.config import RunConfig
    from pipelines.engine.host_reads import HostCopy, loss_or_nan
    from pipelines.engine.optim import build_optimizer

    engine_name, stage = ENGINES[args.child]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(dist.free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    cfg = load_config(REPO / "configs/train/gpt_tiny_cpu.yaml",
                      [f"distributed.engine={engine_name}", f"distributed.zero_stage={stage}", "train.precision=fp32",
                       f"data.micro_batch_size={args.batch}", "optim.grad_clip=1.0"], cls=RunConfig)
    env = dist.init_env()
    torch.manual_seed(0)
    narrow = ({"hidden_size": args.narrow, "num_heads": max(1, args.narrow // 32), "intermediate_size": 4 * args.narrow}
              if args.narrow else {})
    model = models.create(args.model, vocab_size=args.vocab, **narrow)
    bare = copy.deepcopy(model)
    bare_opt = build_optimizer(bare, cfg.optim, offload=False, device=env.device)
    stock_model = copy.deepcopy(model) if args.stock else None
    engine = engines.build_engine(cfg, env, model, build_optimizer(model, cfg.optim, offload=False, device=env.device),
                                  lambda step: 1.0)
    engine.train()
    sides: dict = {"bare": None, "engine": engine}
    if stock_model is not None:  # a second engine in this process: accelerate keeps one state per process, so reset it
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state()
        GradientState._reset_state()
        stock_cfg = copy.deepcopy(cfg)
        stock_cfg.distributed.one_rank_fast_path = False  # the DDP wrapper and DeepSpeed as they come
        sides["stock"] = engines.build_engine(
            stock_cfg, env, stock_model, build_optimizer(stock_model, cfg.optim, offload=False, device=env.device),
            lambda step: 1.0)
        sides["stock"].train()
    batch = make_batch(args)

    def bare_step() -> None:
        loss = bare(**batch)["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(bare.parameters(), 1.0)
        bare_opt.step()
        bare_opt.zero_grad(set_to_none=True)

    late: dict[int, HostCopy] = {}

    def engine_step(engine) -> None:  # Trainer._train_step between log steps: its reads come a step late
        loss = engine(**batch)["loss"]
        agreed = loss.detach().to(torch.float64).reshape(1)  # the step's agreement (one rank: no collective)
        engine.backward(loss_or_nan(loss, agreed[0]))
        engine.step()  # its outcome is read when the next step() settles it
        if id(engine) in late:
            late.pop(id(engine)).tolist()  # the previous step's agreement
        late[id(engine)] = HostCopy(agreed)

    steps = {name: (bare_step if name == "bare" else (lambda e=e: engine_step(e))) for name, e in sides.items()}

    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    def block(fn) -> float:
        t0 = clock()
        for _ in range(args.block):
            fn()
        return (clock() - t0) / args.block

    for fn in steps.values():  # warm-up: allocator, DeepSpeed's first-step set-up
        for _ in range(2):
            fn()
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for i in range(args.rounds):  # which side goes first rotates too
        for side in order[i % len(order):] + order[:i % len(order)]:
            times[side].append(block(steps[side]))
    result = {k: statistics.median(v) for k, v in times.items()}
    for side in steps.keys() - {"bare"}:  # per round, against the bare block of the same round
        result[f"{side}_ratios"] = [t / b for t, b in zip(times[side], times["bare"], strict=True)]
    return result


def make_batch(args: argparse.Namespace) -> dict:
    """One batch for the model: causal LM (labels = inputs), or BERT's MLM + NSP with 15 % of the positions
    masked and gathered by ``masked_positions``, as the loader makes them."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, args.vocab, (args.batch, args.seq_len), generator=g)
    if not args.model.startswith("bert"):
        return {"input_ids": ids, "labels": ids}
    masked = torch.rand(ids.shape, generator=g) < 0.15
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids),
            "labels": labels, "masked_positions": torch.nonzero(masked.reshape(-1)).reshape(-1),
            "next_sentence_label": torch.randint(0, 2, (args.batch,), generator=g)}


def paired(ratios: list[float]) -> str:
    """The median of the per-round ratios - 1, with their interquartile range."""
    q1, q2, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return f"{q2 - 1:+.1%} [{q1 - 1:+.1%}, {q3 - 1:+.1%}]"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--narrow", type=int, default=0, metavar="W",
                   help="build the model at width W with all its layers: a step's time is the host's own")
    p.add_argument("--block", type=int, default=5, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=12, help="rounds of alternating bare / engine blocks")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--engines", default="ddp,zero0,zero1,zero2", help=f"any of {','.join(ENGINES)}")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: this process's CPU time (with --threads 1, what the other jobs of a shared machine disturb least)")
    p.add_argument("--stock", action="store_true", help="also time the engine with distributed.one_rank_fast_path=false in the same blocks")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rounds < 2:
        p.error("--rounds must be at least 2: the overhead is a median and interquartile range over rounds")
    import torch

    torch.set_num_threads(args.threads)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    print(f"{args.model}{f' at width {args.narrow}' if args.narrow else ''}, batch {args.batch} x {args.seq_len}, fp32, CPU, {args.threads} thread(s); "
          f"{args.rounds} rounds of alternating blocks of {args.block} steps, {args.clock} clock; "
          "overhead: median per-round ratio - 1 [interquartile range]")
    print(f"{'engine':<8} {'bare ms':>9} {'engine ms':>10} {'overhead':>24}"
          + (f" {'stock ms':>9} {'stock overhead':>24} {'engine/stock':>13}" if args.stock else ""))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(args.threads)}
    for name in args.engines.split(","):
        cmd = [sys.executable, __file__, "--child", name, "--model", args.model, "--vocab", str(args.vocab), "--batch",
               str(args.batch), "--seq-len", str(args.seq_len), "--narrow", str(args.narrow), "--block", str(args.block), "--rounds", str(args.rounds),
               "--threads", str(args.threads), "--clock", args.clock, *(["--stock"] if args.stock else [])]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"{name:<8} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
            continue
        r = json.loads(lines[-1][7:])
        row = f"{name:<8} {r['bare'] * 1e3:>9.1f} {r['engine'] * 1e3:>10.1f} {paired(r['engine_ratios']):>24}"
        if "stock" in r:
            per_round = [e / s for e, s in zip(r["engine_ratios"], r["stock_ratios"], strict=True)]
            row += f" {r['stock'] * 1e3:>9.1f} {paired(r['stock_ratios']):>24} {statistics.median(per_round):>13.3f}"
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
