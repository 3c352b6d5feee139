"""Fine-tuning speed: ours (`pretrain finetune`) vs `transformers.Trainer`, same release, data, batch,
steps and evaluation cadence, in one run.

Both sides do the same work, each timed from its first line to a scored release:

* **ours**: `pipelines.finetune.run_finetune` (`configs/finetune/{qa,classification}.yaml`): train
  ``--epochs`` epochs, evaluate the dev set and checkpoint after every epoch, pick the best epoch,
  export it as a transformers release, score the release on the dev set, write the card.
* **HF**: `transformers.Trainer` with ``eval_strategy=save_strategy="epoch"`` and
  ``load_best_model_at_end`` (the same cadence), `save_pretrained`, then the same dev scorer as ours.

Same model (``--release`` or a random-init BERT of ``--layers``/``--hidden`` built here), batch
``--batch``, sequence ``--seq``, epochs, learning rate and warmup (`finetune_quality.py` holds both
recipes; only the timing is added here). Tasks: the docstring classification task (847 train / 201
dev) and the package QA task (the same docstrings as extractive QA), written by `pipelines.ops.demo_data`.
``--repeat`` alternates the two sides; the fastest run of each counts. Prints seconds and samples/s
(training examples x epochs / wall) per side and the ratio HF wall / our wall (goal >= 1.0).

    python benchmarks/finetune_throughput.py [--tasks classification,qa] [--epochs 3] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from finetune_quality import add_recipe_args, hf, make_release, ours  # noqa: E402  (it also puts the repo on sys.path)


def timed(fn, *args, **kwargs) -> tuple[float, float]:
    """(seconds, result) of one call."""
    t0 = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - t0, result


def train_size(task: str, data: Path) -> int:
    if task == "qa":
        return sum(len(p["qas"]) for art in json.loads((data / "train.json").read_text())["data"] for p in art["paragraphs"])
    return sum(1 for line in (data / "train.tsv").read_text().splitlines()[1:] if line.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="classification,qa", help="comma-separated: classification, qa")
    add_recipe_args(parser)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import torch

    from pipelines.ops.demo_data import write_classification_task, write_package_qa_task

    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="finetune-throughput-"))
    release = Path(args.release) if args.release else make_release(root / "release", args.layers, args.hidden)
    summary = {}
    for task in args.tasks.split(","):
        data = root / f"data-{task}"
        (write_package_qa_task if task == "qa" else write_classification_task)(data)
        samples = train_size(task, data) * args.epochs
        walls: dict[str, list[float]] = {"ours": [], "hf": []}
        scores: dict[str, list[float]] = {"ours": [], "hf": []}
        for r in range(args.repeat):
            for side, fn in (("ours", ours), ("hf", lambda *a: hf(*a, per_epoch=True))):
                seconds, score = timed(fn, task, release, data, root / f"{side}-{task}-{r}", args, 0)
                walls[side].append(seconds)
                scores[side].append(score)
                print(f"{task:15s} run {r} {side:4s}: {seconds:7.1f} s  {samples / seconds:7.1f} samples/s  dev score {score:6.2f}",
                      flush=True)
        best = {side: min(w) for side, w in walls.items()}
        ratio = best["hf"] / best["ours"]
        summary[task] = {"ours_s": best["ours"], "hf_s": best["hf"], "ratio_hf_over_ours": ratio, "samples": samples,
                         "scores": scores}
        print(f"{task:15s} fastest: ours {best['ours']:.1f} s, HF Trainer {best['hf']:.1f} s -> ours / HF speed "
              f"{ratio:.2f}x (goal >= 1.0)", flush=True)
    print(f"\nrelease {release}; epochs {args.epochs}, seq {args.seq}, batch {args.batch}, threads {args.threads}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
