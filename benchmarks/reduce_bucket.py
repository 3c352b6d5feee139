"""DeepSpeed's gradient bucket at its default size (5e8 elements) against one the model's size.

``build_engine`` sets ``zero_optimization.reduce_bucket_size`` to the model's parameter count when that is
below DeepSpeed's default (``distributed.reduce_bucket_size``). ZeRO-1/2 allocate the bucket with
``torch.empty`` on every micro-step and ZeRO-3 once; under ``train.deterministic`` torch fills every
``empty`` with NaN, 2 GB a micro-step in fp32. This runs the same 2-rank CPU job (tiny BERT, gloo,
``python -m pipelines.pretrain`` through ``distributed.launch``, accumulation 2) with the default bucket
(a JSON that sets 5e8) and with ours, alternating, for ZeRO-1/2/3 with and without
``train.deterministic``, and prints per row the median step time of each (steps 3 onward), their ratio,
and whether every step's loss and gradient norm are bitwise the same.

    python benchmarks/reduce_bucket.py                 # ~5 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "pipelines"))

CONFIG = "configs/train/bert_tiny_cpu.yaml"


def run(corpus: Path, run_dir: Path, stage: int, deterministic: bool, steps: int, extra: list[str]) -> list[dict]:
    from job_helpers import run_pretrain, summary_of

    summary_of(run_pretrain(CONFIG, [
        f"data.corpus={corpus}", f"train.run_dir={run_dir}", f"train.max_steps={steps}", "train.checkpoint_every=0",
        f"distributed.zero_stage={stage}", "data.micro_batch_size=4", "train.grad_accum_steps=2", "data.num_workers=2",
        "data.shuffle_buffer=16", f"train.deterministic={str(deterministic).lower()}", "train.eval_every=0",
        "train.eval_batches=2", "train.log_every=1", *extra], processes=2))
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r.get("split") == "train"]


def main() -> None:
    import corpus_fixtures as cf

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--stages", default="1,2,3")
    args = p.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, 2 CPU ranks (gloo), {CONFIG}, micro batch 4 x accumulation 2")
    print("| ZeRO | deterministic | default bucket (5e8) ms/step | model-sized ms/step | ratio | losses and norms bitwise |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = cf.make_bert_corpus(root / "corpus")
        default = root / "default.json"
        default.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 500_000_000}}))
        for stage in map(int, args.stages.split(",")):
            for deterministic in (True, False):
                rows = {}
                for name, extra in (("default", [f"distributed.deepspeed_config={default}"]), ("sized", [])):
                    rows[name] = run(corpus, root / f"{stage}-{deterministic}-{name}", stage, deterministic, args.steps, extra)
                ms = {k: 1e3 * statistics.median(r["step_time"] for r in v[2:]) for k, v in rows.items()}
                same = [(r["loss"], r.get("grad_norm")) for r in rows["default"]] == [(r["loss"], r.get("grad_norm")) for r in rows["sized"]]
                print(f"| {stage} | {deterministic} | {ms['default']:.1f} | {ms['sized']:.1f} | {ms['sized'] / ms['default']:.3f} | {same} |",
                      flush=True)


if __name__ == "__main__":
    main()
