"""What every fine-tuning flow shares (classification and QA run the same skeleton).

resolve the checkpoint → tokenizer → `RunConfig` of `epochs` passes with one evaluation and one
checkpoint per epoch (`epoch_run_config`) → `Trainer` with an `EpochSelection` (it records each
epoch's evaluation and stops early) → the best epoch by `selection_metric` (`epoch_rank`, the one
definition of "best") → export it (rank 0) → score the export (every rank its share of the dev
set's batches, on its device: `scoring`). The task
modules (`classification`, `qa`) supply the data, the head, the task and the scorer.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.config import ConfigError
from core.errors import CheckpointError
from core.files import atomic_write_text, tree_inside
from monitoring.sinks import plain
from pipelines.engine import distributed as dist
from pipelines.engine.check import batch_split
from pipelines.engine.config import DataConfig, ModelConfig, RunConfig
from pipelines.engine.hooks import RunHooks
from pipelines.finetune import FinetuneConfig
from pipelines.finetune.card import write_card
from pipelines.finetune.data import FinetuneError

__all__ = ["LOWER_IS_BETTER", "FinetuneJob", "fit_export_score", "ValidItems", "padded_for_eval", "epoch_run_config",
           "start_ranks", "resolve_release", "refuse_other_epochs", "refuse_other_family", "load_tokenizer", "check_tokenizer_fits", "EpochSelection", "epoch_rank", "best_epoch"]

#: Metrics where smaller is better; every other selection metric is maximized.
LOWER_IS_BETTER = {"loss", "mse"}


@dataclass
class FinetuneJob:
    """What a task module hands `fit_export_score`: its data, head and task, and how to export and score."""

    model: Any
    task: Any
    model_name: str  # the name recorded in the run config ("bert-classifier", "bert-qa")
    train_feats: Sequence[dict[str, Any]]
    val_feats: Sequence[dict[str, Any]]  # padded to whole evaluation batches (`padded_for_eval`)
    collate: Callable[[list[dict[str, Any]]], dict[str, Any]]
    model_build: dict[str, Any]
    data_info: dict[str, Any]
    export: Callable[[int], Path]  # best step -> the release directory, run_dir/release (rank 0 calls it)
    score: Callable[[Path], dict[str, Any]]  # the export -> dev metrics; every rank calls it (rank 0 may write side files)
    card_name: str  # the release card's name is "<base release>-<card_name>"
    pipeline_tag: str
    result_extra: dict[str, Any] = field(default_factory=dict)
    worker_preload: tuple[str, ...] = ()  # modules the collate needs, imported once by the workers' forkserver


def start_ranks(cfg: FinetuneConfig) -> dist.DistEnv:
    """This process's rank, with the job's process group joined before the engine exists: ``resolve_release``'s
    barrier (rank 0 exports a run checkpoint that every rank then loads) and the image check's exchange need
    it, and ``build_engine`` takes the group as it is (``distributed.join_process_group``)."""
    env = dist.init_env()
    dist.join_process_group(cfg.distributed, env)
    return env


def fit_export_score(cfg: FinetuneConfig, env: dist.DistEnv, release: Path, job: FinetuneJob) -> dict[str, Any]:
    """Train `epochs` passes, export the best epoch, score the export, write its card and metrics.json."""
    from pipelines.engine.trainer import Trainer
    from pipelines.loading.loader import MapStyleSource

    d, run_dir = cfg.data, Path(cfg.train.run_dir)
    run_cfg, steps_per_epoch = epoch_run_config(cfg, len(job.train_feats), env.world_size, job.model_name)
    refuse_other_epochs(run_cfg, steps_per_epoch, env.world_size)
    common = dict(micro_batch_size=run_cfg.data.micro_batch_size, rank=env.rank, world=env.world_size, seed=cfg.train.seed,
                  num_workers=run_cfg.data.num_workers, preload=job.worker_preload)  # text tasks: 0 workers
    trainer = Trainer(
        run_cfg, model=job.model, task=job.task, env=env,
        # every epoch sees every example: the last batch is partial (topped up with masked fillers), as in transformers
        train_data=MapStyleSource(ValidItems(job.train_feats), job.collate, shuffle=True,
                                  filler={**job.train_feats[0], "valid": False}, **common),
        eval_data=MapStyleSource(job.val_feats, job.collate, shuffle=False, **common),
        model_build=job.model_build, data_info=job.data_info, hooks=(selection := EpochSelection(cfg, steps_per_epoch)),
    )
    summary = trainer.fit()
    if summary["resumed_from"]:  # epochs of earlier sessions are only in the run's record
        best_step, history = best_epoch(run_dir, cfg.selection_metric, steps_per_epoch)
    else:
        best_step, history = selection.best(run_dir)
    result: dict[str, Any] = {"run_dir": str(run_dir), "release_dir": str(run_dir / "release"), "best_step": best_step,
                              "history": history, "steps": summary["steps"], **job.result_extra}
    out = run_dir / "release"
    if env.rank == 0:
        job.export(best_step)
    dist.barrier_if_initialized()  # the export is whole on disk before any rank loads it
    result["metrics"] = job.score(out)  # every rank scores its share of the dev set (``scoring``)
    if env.rank == 0:
        write_card(out, name=f"{Path(release).name}-{job.card_name}", base=release, pipeline_tag=job.pipeline_tag,
                   train_file=d.train, dev_file=d.validation, metrics=result["metrics"],
                   body=(out / "README.md").read_text(encoding="utf-8"))
        atomic_write_text(run_dir / "metrics.json", json.dumps(result, indent=2))
    dist.barrier_if_initialized()
    return result


class ValidItems(Sequence):
    """``items`` each read with ``valid: True`` added: a view, so a compact dataset (``ImageItems``) stays compact
    when a loader pickles it to its workers."""

    def __init__(self, items: Sequence[dict[str, Any]]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        return {**self.items[i], "valid": True}


def padded_for_eval(features: list[dict[str, Any]], multiple: int, **filler_fields: Any) -> list[dict[str, Any]]:
    """Mark real items valid and pad with invalid ones so every rank evaluates the whole dev set."""
    out = [{**f, "valid": True} for f in features]
    filler = {"input_ids": features[0]["input_ids"][:2], "token_type_ids": [0, 0], **filler_fields, "valid": False}
    return out + [filler] * (-len(out) % multiple)


def epoch_run_config(cfg: FinetuneConfig, num_train: int, world_size: int, model_name: str) -> tuple[RunConfig, int]:
    """The `RunConfig` the Trainer runs for fine-tuning: `epochs` passes, one evaluation and checkpoint each."""
    d = cfg.data
    micro, accum, per_step = batch_split(cfg, world_size)  # train.global_batch_size, if set, over these ranks
    steps_per_epoch = -(-num_train // (world_size * micro)) // accum  # last batch partial
    if steps_per_epoch < 1:
        raise FinetuneError(f"{d.train}: {num_train} training examples/windows are fewer than one optimizer step "
                            f"({per_step}); lower data.micro_batch_size, train.grad_accum_steps or train.global_batch_size.")
    train_cfg = dataclasses.replace(cfg.train, max_steps=cfg.epochs * steps_per_epoch, eval_every=steps_per_epoch,
                                    checkpoint_every=steps_per_epoch, keep_last=cfg.epochs, eval_batches=0,
                                    grad_accum_steps=accum)
    run_cfg = RunConfig(data=DataConfig(micro_batch_size=micro, num_workers=cfg.loader_workers),
                        model=ModelConfig(name=model_name), optim=cfg.optim, schedule=cfg.schedule,
                        train=train_cfg, distributed=cfg.distributed, logging=cfg.logging)
    return run_cfg, steps_per_epoch


def refuse_other_epochs(run_cfg: RunConfig, steps_per_epoch: int, world_size: int) -> None:
    """Refuse to resume a run whose epochs had another number of steps (another ``--nproc``, micro batch, global
    batch or training file): its checkpoints and evaluations sit at the old epoch ends, so the resumed run would
    count epochs from the wrong steps, drop the finished epochs from the selection and overwrite the release."""
    import yaml

    from pipelines.engine.checkpoint_find import newest_checkpoint, read_trainer_state

    t = run_cfg.train
    newest = None if t.resume == "never" else Path(t.resume) if t.resume != "auto" else newest_checkpoint(Path(t.run_dir))
    try:
        saved = yaml.safe_load((newest / "config.yaml").read_text(encoding="utf-8")) if newest else None
        before, state = int(saved["train"]["eval_every"]), read_trainer_state(newest)
        micro, accum = saved["data"]["micro_batch_size"], saved["train"]["grad_accum_steps"]
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError, CheckpointError):
        return  # no checkpoint, or a damaged one: the trainer's resume reports it
    if before != steps_per_epoch:
        raise FinetuneError(
            f"{t.run_dir} holds a run of {before} steps an epoch ({state.get('world_size', '?')} process(es) x "
            f"micro-batch {micro} x {accum} accumulated, at step {state.get('step', '?')}: {newest}); this command "
            f"makes {steps_per_epoch} ({world_size} x {run_cfg.data.micro_batch_size} x {t.grad_accum_steps}), so a "
            f"resume would end its epochs at other steps. Run it as before (--nproc, data.micro_batch_size, "
            f"train.global_batch_size, the same data.train), or give it a new train.run_dir.")


def resolve_release(checkpoint: str, run_dir: Path, env: dist.DistEnv, families: tuple[str, ...] = ("bert",),
                    task: str = "qa") -> Path:
    """A release dir as it is; one of our run checkpoints is exported (by rank 0) into run_dir/base-release.
    A checkpoint of a model family outside ``families`` (those ``task`` fine-tunes) is refused first."""
    path = Path(checkpoint)
    if not path.is_dir():
        raise FinetuneError(
            f"checkpoint={checkpoint} {'is a file, not a directory' if path.exists() else 'does not exist'}. "
            f"Pass a release directory (written by `pretrain export` or `save_pretrained`) or a pretraining run dir."
        )
    refuse_other_family(checkpoint, families, task)
    if (path / "config.json").is_file():
        return tree_inside(path, ".", what="the release directory")  # tokenizer and weights: nothing read from outside
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


#: What each family's release is called in a refusal (and which config trains one).
_FAMILY_RELEASES = {"bert": "BERT-architecture encoder (a release of a configs/train/bert_*.yaml run, or a BERT "
                            "Hugging Face directory)",
                    "gpt": "GPT-2-architecture decoder (a release of a configs/train/gpt_*.yaml run, or a GPT-2 "
                           "Hugging Face directory)",
                    "vit": "ViT image model (a release of a configs/train/vit_*.yaml run, or a ViT Hugging Face "
                           "directory)"}


def refuse_other_family(checkpoint: str, families: tuple[str, ...], task: str) -> None:
    """Before anything else is checked (``pretrain finetune``): a checkpoint of a family ``task`` does not fine-tune
    is the problem, not the data files a user pointed at it (an image folder as data.train was refused as "a
    directory, not a file")."""
    path = Path(checkpoint)
    if (path / "config.json").is_file():
        _refuse_other_family(checkpoint, tree_inside(path, ".", what="the release directory"), families, task)
    elif (path / "trainer_state.json").is_file() or (path / "checkpoints").is_dir():
        _refuse_other_family(checkpoint, path, families, task)


def _refuse_other_family(checkpoint: str, path: Path, families: tuple[str, ...], task: str) -> None:
    """Before a run is exported or a tokenizer is read: a model of another family is the problem, not its files."""
    family = checkpoint_family(path)
    if family not in (None, *families):
        from pipelines.finetune import FINETUNE_TASKS, task_families

        wanted = " or a ".join(_FAMILY_RELEASES.get(f, f) for f in families)
        fits = [t for t in FINETUNE_TASKS if family in task_families(t)]
        hint = f" A {family} release fine-tunes with train.task={' or '.join(fits)}." if fits else ""
        raise FinetuneError(f"checkpoint={checkpoint} holds a {family} model; {task} fine-tuning needs a {wanted}.{hint}")


def checkpoint_family(path: Path) -> str | None:
    """The model family of a release (its config.json ``model_type``) or of a run's newest checkpoint; None
    when it cannot be told here (an unknown type or a damaged run is reported where it is loaded)."""
    from core.families import family_of_model, get_family, list_families

    try:
        if (path / "config.json").is_file():
            model_type = json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
            return next((f for f in list_families() if get_family(f).hf_model_type == model_type), None)
        from pipelines.engine.checkpoint import read_trainer_state
        from pipelines.engine.export import resolve_checkpoint

        build = read_trainer_state(resolve_checkpoint(path)).get("model_build") or {}
        return family_of_model(build["name"]).name if build.get("name") else None
    except Exception:  # noqa: BLE001 - the loaders below give the precise message
        return None


def load_tokenizer(release: Path):
    """The release's tokenizer; refused without vocabulary files (transformers 5 would build one of 5 special tokens
    and every word would be [UNK])."""
    from transformers import AutoTokenizer

    from pipelines.engine.export import VOCABULARY_FILES, has_tokenizer

    if not has_tokenizer(release):
        raise FinetuneError(f"{release}: no tokenizer files (none of {', '.join(VOCABULARY_FILES)}). Copy the tokenizer "
                            f"the model was trained with into it (tokenizer.save_pretrained('{release}')).")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(release), trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise FinetuneError(f"{release}: no usable tokenizer files ({exc}). Copy the tokenizer the model was trained with into it.") from None
    check_tokenizer_fits(release, len(tokenizer))
    return tokenizer


def check_tokenizer_fits(release: Path, tokens: int) -> None:
    """Refuse a tokenizer whose ids reach past the model's embedding table (an IndexError mid-forward otherwise).

    ``tokens`` counts added tokens too. A larger ``vocab_size`` (embeddings padded to a multiple, as GPT-2's
    50304) is fine: those rows are never looked up.
    """
    try:
        vocab = json.loads((release / "config.json").read_text(encoding="utf-8")).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return  # no readable config.json: loading the model reports it
    if isinstance(vocab, int) and tokens > vocab:
        raise ConfigError(
            f"{release}: its tokenizer has {tokens} tokens (added ones included) but the model's embedding table "
            f"(config.json vocab_size) has {vocab} rows, so token ids {vocab}..{tokens - 1} would index past it. "
            f"The tokenizer files are not the model's: copy back the tokenizer it was pretrained with (the one "
            f"`pretrain export` put into the release), or fine-tune a release whose vocab_size is at least {tokens}."
        )


def epoch_rank(row: dict[str, Any], metric: str) -> tuple[float, float, int]:
    """How epochs compare, larger is better: ``metric`` (negated when lower is better), then the lower dev
    loss, then the earlier step. Ties of a count-based metric (accuracy on a small dev set) are not equal
    models (issue #31: a tie kept epoch 2 of 3 at 67.5 F1 where epoch 3, with the lower loss, had 71.1)."""
    sign = -1.0 if metric in LOWER_IS_BETTER else 1.0
    return sign * float(row[metric]), -float(row.get("loss", 0.0)), -int(row["step"])


class EpochSelection(RunHooks):
    """The fine-tuning run's hooks: its config saved with the run, each epoch-end evaluation recorded,
    and early stopping after ``early_stopping_patience`` epochs that do not become the best (``epoch_rank``)."""

    def __init__(self, cfg: FinetuneConfig, steps_per_epoch: int) -> None:
        self.config_to_save, self.metric, self.steps_per_epoch = cfg, cfg.selection_metric, steps_per_epoch
        self.patience = cfg.early_stopping_patience
        self.rows: list[dict[str, Any]] = []
        self._best: dict[str, Any] | None = None
        self._bad = 0

    def on_evaluation(self, step: int, metrics: dict[str, float]) -> bool:
        if step % self.steps_per_epoch:
            return False
        row = {"step": step, **plain(metrics)}
        self.rows.append(row)
        if self.metric in row and (self._best is None or epoch_rank(row, self.metric) > epoch_rank(self._best, self.metric)):
            self._best, self._bad = row, 0
        else:
            self._bad += 1
        return 0 < self.patience <= self._bad

    def finished_line(self, resume: Any, run_dir: Path) -> str | None:
        """A rerun of a finished run: the budget to raise is ``epochs`` (``train.max_steps`` is made from it)."""
        if resume.finished != "max_steps":
            return None
        return (f"run {run_dir} has trained its {resume.step // self.steps_per_epoch} epoch(s) (checkpoint "
                f"{resume.path}): nothing to train. Raise epochs to train further; its best epoch is exported and "
                f"scored again.")

    def best(self, run_dir: Path) -> tuple[int, list[dict[str, Any]]]:
        """The best epoch's step and every epoch's evaluation (``best_epoch``'s answer, from this session)."""
        return _select(self.rows, self.metric, self.steps_per_epoch, run_dir)


def _select(rows: list[dict[str, Any]], metric: str, steps_per_epoch: int, run_dir: Path) -> tuple[int, list[dict[str, Any]]]:
    if not rows:
        raise FinetuneError(f"{run_dir}/metrics.jsonl has no evaluation; the run did not finish an epoch.")
    if metric not in rows[-1]:
        raise FinetuneError(f"selection_metric={metric!r} is not among the dev metrics {sorted(k for k in rows[-1] if k not in ('step', 'split', 'time'))}.")
    best = max(rows, key=lambda r: epoch_rank(r, metric))
    history = [{"epoch": r["step"] // steps_per_epoch, **{k: v for k, v in r.items() if k not in ("split", "time")}}
               for r in rows]
    return int(best["step"]), history


def best_epoch(run_dir: Path, metric: str, steps_per_epoch: int) -> tuple[int, list[dict[str, Any]]]:
    """The best epoch-end evaluation (``epoch_rank``) as recorded in ``run_dir/metrics.jsonl`` (a resumed run:
    its earlier sessions' epochs), and the history."""
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("split") == "eval" and row.get("step", 0) % steps_per_epoch == 0:
            rows.append(row)
    return _select(rows, metric, steps_per_epoch, run_dir)
