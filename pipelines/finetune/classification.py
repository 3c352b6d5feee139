"""Sequence-classification fine-tuning on the pretraining engine (see `pipelines.finetune`).

Flow: resolve the checkpoint (a release dir, or one of our run checkpoints exported on the fly) →
read and tokenize the labelled files → a classifier on the release's body, as its family's
`CLASSIFIER_FAMILIES` entry builds it (BERT: `SequenceClassifier` on the pooled [CLS]; GPT:
`LastTokenClassifier` on the last non-pad token, as `GPT2ForSequenceClassification`), or the same
architecture from random init → `Trainer` with one evaluation and one checkpoint per epoch
→ pick the best epoch on the dev metric → export it as a transformers release directory →
`metrics.json` computed by that exported model on the whole dev set.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipelines.engine.distributed import DistEnv
from pipelines.engine.objectives import Task
from pipelines.finetune import FinetuneConfig
from pipelines.finetune.data import (
    FinetuneError,
    collate_classification,
    encode_examples,
    read_examples,
)
from pipelines.finetune.inputs import BERT_INPUTS, check_max_seq_len, check_segments, pad_token_id, write_task_release
from pipelines.finetune.metrics import classification_metrics, metrics_from_confusion, regression_metrics
from pipelines.finetune.runner import (
    FinetuneJob,
    fit_export_score,
    load_tokenizer,
    padded_for_eval,
    resolve_release,
    start_ranks,
)
from pipelines.finetune.scoring import forward_on_ranks, scoring_device


class ClassificationTask(Task):
    """Cross-entropy (or MSE when `num_labels == 1`); eval sums a confusion matrix so macro-F1/MCC are exact across ranks."""

    name, family = "classification", "bert"
    input_names = ("input_ids", "attention_mask", "token_type_ids")

    def __init__(self, num_labels: int, pad_id: int, seq_len: int):
        self.num_labels, self.pad_id, self.seq_len = num_labels, pad_id, seq_len
        self.regression = num_labels == 1

    def flops_kwargs(self):
        return {"seq_len": self.seq_len, "mlm_fraction": 0.0}  # the classifier's own head is negligible

    def collate(self, samples, *, epoch=0, train=True):
        return collate_classification(samples, self.pad_id)

    def forward(self, model, batch):
        out = model(**self.model_inputs(batch))
        logits, labels, valid = out["logits"], batch["labels"], batch["valid"]
        if self.regression:
            err = (logits.squeeze(-1).float() - labels.float()) ** 2
            out["loss"] = (err * valid).sum() / valid.sum().clamp(min=1)
        else:
            ce = torch.nn.functional.cross_entropy(logits.float(), labels.masked_fill(~valid, -100), reduction="sum")
            out["loss"] = ce / valid.sum().clamp(min=1)  # 0, not NaN, for a batch of fillers only
        return out

    def eval_sums(self, out, batch):
        valid = batch["valid"].bool()
        n = float(valid.sum())
        sums = {"count": n, "loss_sum": float(out["loss"]) * n}
        if self.regression:
            x, y = out["logits"].squeeze(-1).float()[valid], batch["labels"].float()[valid]
            sums.update(sx=float(x.sum()), sy=float(y.sum()), sxx=float((x * x).sum()), syy=float((y * y).sum()),
                        sxy=float((x * y).sum()), sse=float(((x - y) ** 2).sum()))
            return sums
        pred, gold = out["logits"].argmax(-1)[valid], batch["labels"][valid]
        cm = torch.zeros(self.num_labels, self.num_labels, dtype=torch.float64)
        cm.index_put_((gold.cpu(), pred.cpu()), torch.ones(len(gold), dtype=torch.float64), accumulate=True)
        sums.update({f"cm_{t}_{p}": float(cm[t, p]) for t in range(self.num_labels) for p in range(self.num_labels)})
        return sums

    def eval_metrics(self, s):
        n = max(s["count"], 1.0)
        metrics = {"loss": s["loss_sum"] / n}
        if self.regression:
            cov = s["sxy"] / n - (s["sx"] / n) * (s["sy"] / n)
            var = (s["sxx"] / n - (s["sx"] / n) ** 2) * (s["syy"] / n - (s["sy"] / n) ** 2)
            metrics.update(mse=s["sse"] / n, pearson=float(cov / np.sqrt(var)) if var > 0 else 0.0)
            return metrics
        k = self.num_labels
        cm = np.array([[s[f"cm_{t}_{p}"] for p in range(k)] for t in range(k)])
        metrics.update(metrics_from_confusion(cm))
        return metrics

    def tokens(self, batch):
        return int(batch["attention_mask"].sum())

    def batch_flops(self, batch, config):
        """Real sequence lengths of the valid items (dynamic padding: widths vary by batch), the pooler and the classifier."""
        from models.flops import encoder_training_flops

        mask = batch["attention_mask"]
        rows = mask[batch["valid"].bool()] if "valid" in batch else mask
        return encoder_training_flops(config, rows.sum(1).tolist(), sequence_params=self.head_params(config.hidden_size))

    def head_params(self, d: int) -> int:
        return d * d + d * self.num_labels  # BERT's pooler + classifier


class GPTClassificationTask(ClassificationTask):
    """The same loss and metrics on ``LastTokenClassifier``: no segment ids, no pooler (``score`` is d x K)."""

    family = "gpt"
    input_names = ("input_ids", "attention_mask")

    def head_params(self, d: int) -> int:
        return d * self.num_labels


@dataclass(frozen=True)
class ClassifierFamily:
    """How classification fine-tuning puts a head on one model family's release (``CLASSIFIER_FAMILIES``).

    ``fresh``/``unused``: key prefixes of the new head (initialized here) and of checkpoint weights the
    classifier does not use (pretraining heads): anything else in the load report is warned about.
    ``reinit``: ``init=random`` on the built classifier. ``pad_fallbacks``: tokenizer attributes giving the
    pad id when neither the tokenizer nor the config has one (``inputs.pad_token_id``). ``input_names``:
    what the model reads, so what the release's tokenizer returns (``inputs.release_tokenizer``).
    """

    task: type[ClassificationTask]
    model_name: str
    fresh: str
    unused: tuple[str, ...]
    reinit: Callable[[torch.nn.Module], None]
    pad_fallbacks: tuple[str, ...] = ()
    input_names: tuple[str, ...] = BERT_INPUTS
    set_pad: Callable[[torch.nn.Module, int], None] = lambda model, pad_id: None


def _bert_reinit(model: torch.nn.Module) -> None:
    from models.bert import init_bert_

    model.apply(lambda m: init_bert_(m, model.config) if m is model else None)


def _gpt_reinit(model: torch.nn.Module) -> None:
    from models.gpt import GPT

    fresh = GPT(model.config)
    fresh.lm_head = None  # as on the classifier's backbone
    model.backbone.load_state_dict(fresh.state_dict())


def _gpt_set_pad(model: torch.nn.Module, pad_id: int) -> None:
    model.pad_token_id = pad_id  # the classified token is the last that is not pad_id, in training and in the release


#: model family -> its classifier. GPT's pad token, when the tokenizer has none (GPT-2's): its end-of-text
#: token, transformers' usual choice for GPT-2; right padding and a causal mask keep it out of every real
#: token's view, and ``last_non_pad_index`` then classifies each text's last token.
CLASSIFIER_FAMILIES: dict[str, ClassifierFamily] = {
    "bert": ClassifierFamily(task=ClassificationTask, model_name="bert-classifier", fresh="classifier.",
                             unused=("cls.",), reinit=_bert_reinit),
    "gpt": ClassifierFamily(task=GPTClassificationTask, model_name="gpt-classifier", fresh="score.", unused=(),
                            reinit=_gpt_reinit, pad_fallbacks=("eos_token_id",), input_names=("input_ids", "attention_mask"),
                            set_pad=_gpt_set_pad),
}


#: The model families a release must be of (``pipelines.finetune.task_families``).
FAMILIES = tuple(CLASSIFIER_FAMILIES)


def _collate_with_valid(task: ClassificationTask):
    def collate(items):
        batch = collate_classification(items, task.pad_id)
        batch["valid"] = torch.tensor([bool(it.get("valid", True)) for it in items])
        return batch

    return collate


def build_classifier(release: Path, label_names: list[str], regression: bool, init: str, seed: int) -> torch.nn.Module:
    """The release's body with a new classification head (``CLASSIFIER_FAMILIES`` of its family)."""
    import models

    torch.manual_seed(seed)  # the new head (and init=random weights) are the same on every rank and rerun
    supported = " and ".join(f.upper() for f in CLASSIFIER_FAMILIES)
    try:
        with warnings.catch_warnings():  # a fresh classifier is expected; anything else is reported below
            warnings.simplefilter("ignore", UserWarning)
            model, report = models.hf.from_hf(
                release, head="classification", num_labels=1 if regression else len(label_names),
                id2label=None if regression else dict(enumerate(label_names)),
            )
    except ValueError as exc:
        raise FinetuneError(f"{release}: {exc} Classification fine-tuning supports {supported}-architecture checkpoints.") from None
    family = CLASSIFIER_FAMILIES.get(getattr(model, "family", None))
    if family is None:
        raise FinetuneError(f"{release} holds a {getattr(model, 'family', '?')} model; classification fine-tuning "
                            f"needs a {supported}-architecture release.")
    # A fresh classifier and unused pretraining heads are expected; anything else is worth a warning.
    unexpected_fresh = [k for k in report.missing if not k.startswith(family.fresh)]
    if unexpected_fresh or [k for k in report.unexpected if not k.startswith(family.unused)]:
        warnings.warn(str(report), stacklevel=2)
    if init == "random":
        family.reinit(model)
    # said in the release's config: transformers' loss and pipeline scores (raw for regression) follow it
    model.problem_type = "regression" if regression else "single_label_classification"
    return model


def finetune_classification(cfg: FinetuneConfig) -> dict[str, Any]:
    """Read and tokenize the labelled files, build the classifier, then the shared fit/export/score skeleton."""
    env = start_ranks(cfg)
    run_dir = Path(cfg.train.run_dir)
    release = resolve_release(cfg.checkpoint, run_dir, env, FAMILIES, "classification")
    tokenizer = load_tokenizer(release)  # a tokenizer the model cannot take is refused before the data is read
    d = cfg.data
    columns = dict(text_column=d.text_column, label_column=d.label_column, text_pair_column=d.text_pair_column,
                   regression=d.regression, max_bad_share=d.max_bad_share)
    train_ex, labels, train_report = read_examples(d.train, **columns)
    val_ex, _, val_report = read_examples(d.validation, label_names=labels, **columns)
    if env.rank == 0:
        print(train_report.summary(), val_report.summary(), sep="\n", flush=True)
    model = build_classifier(release, labels, d.regression, cfg.init, cfg.train.seed)
    family = CLASSIFIER_FAMILIES[model.family]
    check_max_seq_len(d.max_seq_len, model.config, release)
    check_segments(bool(d.text_pair_column), model.config, release)
    # training, evaluation, the model (GPT: which token is classified) and the release's tokenizer
    pad_id = pad_token_id(tokenizer, model.config, release, family.pad_fallbacks)
    family.set_pad(model, pad_id)
    task = family.task(1 if d.regression else len(labels), pad_id, d.max_seq_len)
    return fit_export_score(cfg, env, release, FinetuneJob(
        model=model, task=task, model_name=family.model_name,
        train_feats=encode_examples(train_ex, tokenizer, d.max_seq_len),
        val_feats=padded_for_eval(encode_examples(val_ex, tokenizer, d.max_seq_len), env.world_size * d.micro_batch_size,
                                  label=0.0 if d.regression else 0),
        collate=_collate_with_valid(task),
        model_build={"name": family.model_name, "checkpoint": str(release), "labels": labels},
        data_info={"train": str(d.train), "validation": str(d.validation), "labels": labels},
        export=lambda step: _export_best(model, run_dir / "checkpoints", step, release, run_dir / "release", labels,
                                         d.regression, pad_id, d.max_seq_len, family.input_names),
        score=lambda out: evaluate_release(out, val_ex, d.max_seq_len, labels, d.regression, env),
        card_name="classifier", pipeline_tag="text-classification",
    ))


def _export_best(model, checkpoints: Path, step: int, base: Path, out: Path, labels: list[str], regression: bool,
                 pad_id: int, max_seq_len: int, input_names: tuple[str, ...]) -> Path:
    import models
    from pipelines.engine.checkpoint import step_dir_name
    from pipelines.engine.export import consolidated_state_dict

    sd = consolidated_state_dict(checkpoints / step_dir_name(step))
    model.load_state_dict(sd)
    hf = models.hf.to_hf(model.float().eval())
    if not regression:
        hf.config.id2label = dict(enumerate(labels))
        hf.config.label2id = {name: i for i, name in enumerate(labels)}
    card = f"# Fine-tuned sequence classifier\n\nFrom `{base}`, best epoch at step {step}. Labels: {', '.join(labels)}.\n"
    return write_task_release(hf, out, base, pad_id, card, max_seq_len, input_names)


@torch.no_grad()
def evaluate_release(release: Path, examples, max_seq_len: int, labels: list[str], regression: bool,
                     env: DistEnv | None = None) -> dict[str, float]:
    """Dev metrics of the exported model, loaded back with transformers (so the release is what was measured).

    Its tokenizer is called with its defaults, as a transformers user calls it: ``release_tokenizer`` made
    them pad on the right with training's pad id, return segment ids and truncate (``truncation=True``, as
    ``pipeline`` takes it) at ``max_seq_len``, so this is what training fed the model. Under ``env`` every
    rank calls it and runs its share of the batches on its device (``scoring.forward_on_ranks``).
    """
    from transformers import AutoModelForSequenceClassification

    tokenizer = load_tokenizer(release)
    device = scoring_device(env)
    hf = AutoModelForSequenceClassification.from_pretrained(str(release), trust_remote_code=False).eval().to(device)

    def logits(chunk) -> np.ndarray:
        pairs = [e.text_pair for e in chunk] if chunk[0].text_pair is not None else None
        enc = tokenizer([e.text for e in chunk], pairs, truncation="longest_first", max_length=max_seq_len,
                        padding=True, return_tensors="pt")
        return hf(**enc.to(device)).logits.float().cpu().numpy()

    out = np.concatenate(forward_on_ranks([examples[i: i + 64] for i in range(0, len(examples), 64)], logits, env))
    gold = [e.label for e in examples]
    if regression:
        return regression_metrics(out[:, 0].tolist(), gold)
    return classification_metrics(out.argmax(-1).tolist(), gold, len(labels))
