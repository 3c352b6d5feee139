"""`pretrain demo`: the whole pipeline on text that ships with Python, in minutes on 2 CPU cores.

raw text → Ray prep (WordPiece + BERT pairs → shards) → 2-process DeepSpeed ZeRO-2 MLM+NSP
pretraining → export to a transformers directory → classification fine-tuning → a summary that
compares every number with its baseline. Each stage is the library function the CLI uses, driven
by the YAML files in `configs/demo/`, with the demo's output directory set by overrides.
"""

from __future__ import annotations

import json
import tarfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.config import ConfigError
from core.errors import Terminated
from core.files import atomic_write_text, claim_output_dir
from pipelines.ops.demo_data import (
    write_classification_task,
    write_digit_images,
    write_package_qa_task,
    write_pretraining_corpus,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PRETRAIN_CONFIG = CONFIGS / "demo" / "pretrain_bert.yaml"


@dataclass
class DemoOptions:
    out_dir: str = "demo_out"
    pretrain_steps: int = 300
    num_processes: int = 2
    small: bool = False  # a ~300 KB corpus and fewer steps, for the end-to-end test


def _stage(title: str) -> float:
    print(f"\n=== {title}", flush=True)
    return time.perf_counter()


def _read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    rows = []
    path = run_dir / "metrics.jsonl"
    for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a crash
    return rows


def unigram_mlm_baseline(corpus: Path, split: str = "validation") -> float:
    """Accuracy of always predicting the most frequent non-special token (what MLM must beat)."""
    manifest = json.loads((corpus / "manifest.json").read_text(encoding="utf-8"))
    specials = set(manifest["tokenizer"]["special_tokens"].values())
    dtype = np.dtype("<u2") if manifest["token_dtype"] == "uint16" else np.dtype("<u4")
    counts: Counter[int] = Counter()
    for shard in manifest["splits"][split]["shards"]:
        with tarfile.open(corpus / shard["name"]) as tar:
            for member in tar:
                if ".input_ids." in member.name:
                    counts.update(np.frombuffer(tar.extractfile(member).read(), dtype=dtype).tolist())
    for token in specials:
        counts.pop(token, None)
    total = sum(counts.values())
    return max(counts.values()) / total if total else 0.0


def pretrain_overrides(corpus: Path, run_dir: Path, steps: int) -> list[str]:
    """Overrides of configs/demo/pretrain_bert.yaml: the demo's paths and a schedule scaled to ``steps``."""
    return [
        f"data.corpus={corpus}",
        f"train.run_dir={run_dir}",
        f"train.max_steps={steps}",
        f"train.eval_every={max(steps // 3, 1)}",
        f"train.checkpoint_every={max(steps // 3, 1)}",
        f"schedule.warmup_steps={max(steps // 10, 1)}",
        "train.overwrite=true",  # a rerun of the demo starts its own run over (resume: never)
    ]


def check_options(opts: DemoOptions, train_overrides: list[str]) -> None:
    """Refuse --nproc / --steps the pretraining stage cannot take before any stage runs (it used to fail
    there, minutes in, with accelerate's traceback); then the pretraining config as the CLI checks it."""
    from pipelines.engine.check import check
    from pipelines.engine.config import load_run_config

    if opts.num_processes < 1:
        raise ConfigError(f"--nproc {opts.num_processes}: the demo pretrains with at least 1 process "
                          f"(default 2). Pass --nproc 1 or more.")
    if opts.pretrain_steps < 1:
        raise ConfigError(f"--steps {opts.pretrain_steps}: the demo needs at least 1 pretraining step "
                          f"(default 300; --small tests use 20-120). Pass --steps 1 or more.")
    check(load_run_config(str(PRETRAIN_CONFIG), train_overrides), world_size=opts.num_processes)


def run_demo(opts: DemoOptions) -> dict[str, Any]:
    from core.config import load_config
    from data_prep.config import PrepConfig
    from data_prep.job import run_prepare
    from pipelines.engine.export import export_checkpoint
    from pipelines.engine.launcher import launch
    from pipelines.finetune import FinetuneConfig, run_finetune

    out_dir = Path(opts.out_dir).resolve()
    raw, task, corpus, release = out_dir / "raw", out_dir / "task", out_dir / "corpus", out_dir / "release"
    run_dir = out_dir / "runs" / "bert-tiny"
    train_overrides = pretrain_overrides(corpus, run_dir, opts.pretrain_steps)
    check_options(opts, train_overrides)  # before minutes of corpus writing and Ray prep
    out = claim_output_dir(out_dir, "demo", what="--out (the demo directory)")  # never a user's folder
    started = time.perf_counter()

    t = _stage("1/5 Writing the corpus from Python's own documentation")
    text_stats = write_pretraining_corpus(raw, max_chars=400_000 if opts.small else None)
    task_stats = write_classification_task(task)
    write_package_qa_task(out / "qa")  # for configs/demo/finetune_package_qa.yaml (not run by the demo)
    digits = write_digit_images(out / "digits")  # for configs/data/digits_images.yaml (not run by the demo)
    print(f"{text_stats['files']} files, {text_stats['chars'] / 1e6:.2f} MB of text; "
          f"task: {task_stats['train']} train / {task_stats['validation']} validation docstrings "
          f"from {', '.join(task_stats['labels'])} ({time.perf_counter() - t:.0f}s)")
    print(f"{digits} digit images in {out / 'digits'} (configs/data/digits_images.yaml)" if digits is not None else
          f"{out / 'digits'} not written: the digit images come with scikit-learn (pip install -e \".[demo]\").")

    t = _stage("2/5 Preparing WebDataset shards with a Ray job (WordPiece + BERT sentence pairs)")
    # overwrite: the demo's own corpus, rebuilt when a rerun changes --small (the same options resume it)
    prep_overrides = [f"output={corpus}", f"sources=[{{type: text, paths: ['{raw}'], text_mode: file}}]", "overwrite=true"]
    if opts.small:
        prep_overrides += ["tokenizer.vocab_size=4000", "dupe_factor=1"]
    run_prepare(load_config(CONFIGS / "demo" / "prepare_bert.yaml", prep_overrides, cls=PrepConfig))
    print(f"prepared in {time.perf_counter() - t:.0f}s")

    t = _stage(f"3/5 Pretraining tiny BERT (MLM + NSP): {opts.num_processes} DeepSpeed ZeRO-2 processes")
    code = launch(str(PRETRAIN_CONFIG), train_overrides, opts.num_processes)
    if code > 128:  # stopped as asked (Ctrl-C, SIGTERM): the ranks checkpointed; the demo ends here, as `pretrain train`
        raise Terminated(code - 128)
    if code != 0:
        where = f"; what it wrote is in {run_dir}" if run_dir.is_dir() else ""
        if code == 2:  # the ranks explained it (a config or data problem): their one paragraph is above
            raise ConfigError(f"The demo's pretraining stopped (exit 2): its message is above{where}.")
        raise RuntimeError(f"The demo's pretraining exited with code {code}: its log is above{where}.")
    print(f"pretrained in {time.perf_counter() - t:.0f}s")

    t = _stage("4/5 Exporting the checkpoint to a Hugging Face directory")
    export_checkpoint(run_dir, release, overwrite=True)  # the demo's own release (a rerun replaces it)
    print(f"exported to {release} ({time.perf_counter() - t:.0f}s)")

    t = _stage("5/5 Fine-tuning a classification head: which package is this docstring from?")
    ft_cfg = load_config(
        CONFIGS / "demo" / "finetune_docstrings.yaml",
        [
            f"checkpoint={release}",
            f"data.train={task / 'train.tsv'}",
            f"data.validation={task / 'validation.tsv'}",
            f"train.run_dir={out / 'runs' / 'finetune-docstrings'}",
            "train.resume=never",  # a rerun of the demo fine-tunes afresh (the shipped configs resume: auto)
            "train.overwrite=true",
        ]
        + (["epochs=4"] if opts.small else []),
        cls=FinetuneConfig,
    )
    ft = run_finetune(ft_cfg)
    print(f"fine-tuned in {time.perf_counter() - t:.0f}s")

    summary = summarize(run_dir, corpus, ft, task_stats["majority_baseline"])
    summary["release_dir"] = str(release)
    summary["wall_time_s"] = time.perf_counter() - started
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
    print_summary(summary)
    return summary


def summarize(run_dir: Path, corpus: Path, finetune: dict[str, Any], majority: float) -> dict[str, Any]:
    rows = _read_metrics(run_dir)
    train = [r for r in rows if r.get("split") == "train" and "loss" in r]
    evals = [r for r in rows if r.get("split") == "eval"]
    last_eval = evals[-1] if evals else {}
    return {
        "loss_start": train[0]["loss"] if train else float("nan"),
        "loss_end": train[-1]["loss"] if train else float("nan"),
        "steps": train[-1]["step"] if train else 0,
        "mlm_accuracy": last_eval.get("mlm_accuracy", float("nan")),
        "mlm_unigram_baseline": unigram_mlm_baseline(corpus),
        "nsp_accuracy": last_eval.get("nsp_accuracy", float("nan")),
        "finetune_accuracy": finetune["metrics"]["accuracy"],
        "majority_baseline": majority,
        "run_dir": str(run_dir),
        "tensorboard_dir": str(run_dir / "tb"),
        "finetune_dir": finetune["run_dir"],
        "finetuned_release_dir": finetune["release_dir"],
    }


def print_summary(s: dict[str, Any]) -> None:
    print("\n=== Summary")
    print(f"pretraining loss      {s['loss_start']:.3f} -> {s['loss_end']:.3f} over {s['steps']} steps")
    print(f"MLM accuracy          {s['mlm_accuracy']:.3f}   (unigram baseline {s['mlm_unigram_baseline']:.3f})")
    print(f"NSP accuracy          {s['nsp_accuracy']:.3f}   (chance 0.500)")
    print(f"fine-tuned accuracy   {s['finetune_accuracy']:.3f}   (majority class {s['majority_baseline']:.3f})")
    print(f"run dir               {s['run_dir']}")
    print(f"TensorBoard           tensorboard --logdir {s['tensorboard_dir']}")
    print(f"exported model        {s['release_dir']}")
    print(f"fine-tuned model      {s['finetuned_release_dir']}")
    print(f"total time            {s['wall_time_s'] / 60:.1f} min")
