"""What every fine-tuning flow shares (classification and QA run the same skeleton).

resolve the checkpoint → tokenizer → `RunConfig` of `epochs` passes with one evaluation and one
checkpoint per epoch (`epoch_run_config`) → `Trainer` (with `early_stopping`) → the best epoch by
`selection_metric` from `metrics.jsonl` (`best_epoch`) → export it → score the export. The task
modules (`classification`, `qa`) supply the data, the head, the task and the scorer.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from pipelines.engine import distributed as dist
from pipelines.engine.config import DataConfig, ModelConfig, RunConfig
from pipelines.finetune import FinetuneConfig
from pipelines.finetune.data import FinetuneError

__all__ = ["LOWER_IS_BETTER", "epoch_run_config", "resolve_release", "load_tokenizer", "early_stopping", "best_epoch"]

#: Metrics where smaller is better; every other selection metric is maximized.
LOWER_IS_BETTER = {"loss", "mse"}


def epoch_run_config(cfg: FinetuneConfig, num_train: int, world_size: int, model_name: str) -> tuple[RunConfig, int]:
    """The `RunConfig` the Trainer runs for fine-tuning: `epochs` passes, one evaluation and checkpoint each."""
    d = cfg.data
    per_step = world_size * d.micro_batch_size * cfg.train.grad_accum_steps
    steps_per_epoch = num_train // per_step
    if steps_per_epoch < 1:
        raise FinetuneError(f"{d.train}: {num_train} training examples/windows are fewer than one optimizer step "
                            f"({per_step}); lower data.micro_batch_size or train.grad_accum_steps.")
    train_cfg = dataclasses.replace(cfg.train, max_steps=cfg.epochs * steps_per_epoch, eval_every=steps_per_epoch,
                                    checkpoint_every=steps_per_epoch, keep_last=cfg.epochs, eval_batches=0)
    run_cfg = RunConfig(data=DataConfig(micro_batch_size=d.micro_batch_size, num_workers=0),
                        model=ModelConfig(name=model_name), optim=cfg.optim, schedule=cfg.schedule,
                        train=train_cfg, distributed=cfg.distributed, logging=cfg.logging)
    return run_cfg, steps_per_epoch


def resolve_release(checkpoint: str, run_dir: Path, env: dist.DistEnv) -> Path:
    """A release dir as it is; one of our run checkpoints is exported (by rank 0) into run_dir/base-release."""
    path = Path(checkpoint)
    if (path / "config.json").is_file():
        return path
    if (path / "trainer_state.json").is_file() or (path / "checkpoints").is_dir():
        from pipelines.engine.checkpoint import claim_run_dir
        from pipelines.engine.export import export_checkpoint

        target = run_dir / "base-release"
        if env.rank == 0:
            claim_run_dir(run_dir)  # refuses a user's folder before anything is written into it
            export_checkpoint(path, target, overwrite=True, inside_run_dir=True)
        dist.barrier_if_initialized()
        return target
    raise FinetuneError(
        f"checkpoint={checkpoint}: not a release directory (no config.json) nor a run checkpoint "
        f"(no trainer_state.json). Pass a directory written by `pretrain export` or `save_pretrained`, or a run dir."
    )


def load_tokenizer(release: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(release), trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise FinetuneError(f"{release}: no usable tokenizer files ({exc}). Copy the tokenizer the model was trained with into it.") from None


def early_stopping(cfg: FinetuneConfig):
    """A `should_stop(step, eval_metrics)` that stops after `patience` evaluations without improvement."""
    if cfg.early_stopping_patience <= 0:
        return None
    sign = -1.0 if cfg.selection_metric in LOWER_IS_BETTER else 1.0
    state = {"best": -np.inf, "bad": 0}

    def should_stop(_step: int, metrics: dict[str, float]) -> bool:
        score = sign * metrics.get(cfg.selection_metric, -np.inf * sign)
        if score > state["best"]:
            state["best"], state["bad"] = score, 0
        else:
            state["bad"] += 1
        return state["bad"] >= cfg.early_stopping_patience

    return should_stop


def best_epoch(run_dir: Path, metric: str, steps_per_epoch: int) -> tuple[int, list[dict[str, Any]]]:
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("split") == "eval" and row.get("step", 0) % steps_per_epoch == 0:
            rows.append(row)
    if not rows:
        raise FinetuneError(f"{run_dir}/metrics.jsonl has no evaluation; the run did not finish an epoch.")
    if metric not in rows[-1]:
        raise FinetuneError(f"selection_metric={metric!r} is not among the dev metrics {sorted(k for k in rows[-1] if k not in ('step', 'split', 'time'))}.")
    sign = -1.0 if metric in LOWER_IS_BETTER else 1.0
    best = max(rows, key=lambda r: (sign * r[metric], -r["step"]))
    return int(best["step"]), [{"epoch": r["step"] // steps_per_epoch, **{k: v for k, v in r.items() if k not in ("split", "time")}} for r in rows]
