"""Ensembles against one run at a time (issue #33): the same K runs of the literature warmup map, in one process.

    python benchmarks/ensemble_speed.py                       # K=8 runs of post-LN L6, 20 steps, this machine's device
    python benchmarks/ensemble_speed.py --members 96 --depth 24 --steps 30   # a GPU's share of the map

Both ways train the first K runs (grid order: seeds, arms, lrs, beta2) of one stack and depth of
configs/sweeps/warmup_map_literature.yaml on its corpus (demo_out/corpus_lit_gpt, see the config's header), with
the config's diagnostics and final evaluation, through ``pipelines.study.sweep.run_local``: ``ensemble=0`` (each run
in turn, as before) and ``ensemble=K`` (``pipelines.study.ensemble``). Prints run-steps per second (K x steps / wall
time) and the process CPU seconds per run-step of each, and their ratio. Scratch sweep dirs in a temp folder.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SWEEP = REPO / "configs/sweeps/warmup_map_literature.yaml"


def timed_sweep(overrides: list[str], steps: int) -> tuple[float, float, list[dict]]:
    from pipelines.study.sweep import load_sweep, run_local

    sweep = load_sweep(SWEEP, overrides)
    wall, cpu = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(io.StringIO()):
        records = run_local(sweep, [f"train.max_steps={steps}", f"train.eval_every={steps}"])
    return time.perf_counter() - wall, time.process_time() - cpu, records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", type=int, default=8, help="K runs (<= 96).")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--norm", default="post", choices=("post", "pre", "tfixup"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--corpus", default=str(REPO / "demo_out/corpus_lit_gpt"))
    args = parser.parse_args()
    if not (Path(args.corpus) / "manifest.json").is_file():
        print(f"error: {args.corpus}/manifest.json is missing; prepare it as configs/sweeps/warmup_map_literature.yaml's "
              "header says (pretrain prepare configs/data/gpt_packed.yaml output=demo_out/corpus_lit_gpt seq_len=64 "
              "tokenizer.vocab_size=4096 shard_target_mb=1).", file=sys.stderr)
        return 2
    import torch

    from pipelines.study.sweep import expand, load_sweep

    norm = {"post": "[model.overrides.norm_placement=post, model.overrides.init=standard]",
            "pre": "[model.overrides.norm_placement=pre, model.overrides.init=standard]",
            "tfixup": "[model.overrides.norm_placement=post, model.overrides.init=t-fixup]"}[args.norm]
    with tempfile.TemporaryDirectory() as tmp:
        grid = [f"corpus={args.corpus}", "jobs=1", "threads=0",
                f"axes.depth={{L{args.depth}: [model.overrides.num_layers={args.depth}]}}",
                f"axes.norm={{{args.norm}: {norm}}}"]
        names = [s.name for s in expand(load_sweep(SWEEP, [*grid, f"out_dir={tmp}/plan"]))][: args.members]
        keep = "keep=[" + ", ".join(f'"{n}"' for n in names) + "]"
        device = "cuda" if torch.cuda.is_available() else "cpu"
        print(f"{len(names)} runs of {args.norm}-LN L{args.depth}, {args.steps} steps each, on {device} "
              f"(torch {torch.__version__})", flush=True)
        rows = {}
        for label, ensemble in (("one at a time", 0), (f"ensemble of {len(names)}", len(names))):
            wall, cpu, records = timed_sweep([*grid, keep, f"out_dir={tmp}/{ensemble}", f"ensemble={ensemble}"], args.steps)
            statuses = sorted({r["status"] for r in records})
            run_steps = len(records) * args.steps
            rows[label] = (run_steps / wall, cpu / run_steps)
            print(f"{label:>20}: {wall:7.1f} s wall, {run_steps / wall:8.1f} run-steps/s, "
                  f"{1000 * cpu / run_steps:7.1f} CPU ms per run-step, statuses {statuses}", flush=True)
    (single_rate, single_cpu), (ens_rate, ens_cpu) = rows.values()
    print(f"ensemble / one at a time: {ens_rate / single_rate:.2f}x run-steps/s, "
          f"{single_cpu / ens_cpu:.2f}x less CPU per run-step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
