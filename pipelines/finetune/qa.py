"""Extractive QA fine-tuning on the pretraining engine (`train.task: qa`, see `pipelines.finetune`).

The classification flow (`pipelines.finetune.classification`) with spans instead of labels: resolve the
checkpoint → read SQuAD JSON (bad questions counted) → windows with `data.max_seq_len` /
`qa.doc_stride` → our `QuestionAnswering` head on the release's encoder (or the same architecture
from random init) → `Trainer` with one evaluation (span loss, start/end accuracy on the dev
windows) and one checkpoint per epoch → best epoch by `selection_metric` → transformers release
(`AutoModelForQuestionAnswering`) → that exported model decodes the dev set: `predictions.json`
({question id: answer}, the official format) and `metrics.json` (official EM/F1, v2 splits).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.files import atomic_write_text
from pipelines.engine.distributed import DistEnv
from pipelines.engine.objectives import Task
from pipelines.finetune import FinetuneConfig
from pipelines.finetune.data import FinetuneError, ReadReport
from pipelines.finetune.inputs import check_max_seq_len, check_segments, pad_token_id, write_task_release
from pipelines.finetune.runner import (
    FinetuneJob,
    fit_export_score,
    load_tokenizer,
    padded_for_eval,
    resolve_release,
    start_ranks,
)
from pipelines.finetune.scoring import forward_on_ranks, scoring_device
from pipelines.finetune.squad import (
    QAExample,
    check_bad_share,
    decode_predictions,
    prepare_features,
    read_squad,
    squad_metrics,
)

__all__ = ["QATask", "collate_qa", "build_qa_model", "finetune_qa", "predict_release"]

#: The model families a release must be of (``pipelines.finetune.task_families``): span heads on an encoder.
FAMILIES = ("bert",)


def collate_qa(items: list[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Pad windows to the longest in the batch; `valid` marks real items (fillers balance ranks)."""
    width = max(len(f["input_ids"]) for f in items)
    n = len(items)
    batch = {"input_ids": torch.full((n, width), pad_id, dtype=torch.long),
             "token_type_ids": torch.zeros((n, width), dtype=torch.long),
             "attention_mask": torch.zeros((n, width), dtype=torch.long)}
    for i, f in enumerate(items):
        k = len(f["input_ids"])
        batch["input_ids"][i, :k] = torch.tensor(f["input_ids"])
        batch["token_type_ids"][i, :k] = torch.tensor(f["token_type_ids"])
        batch["attention_mask"][i, :k] = 1
    batch["start_positions"] = torch.tensor([int(f.get("start_position", 0)) for f in items])
    batch["end_positions"] = torch.tensor([int(f.get("end_position", 0)) for f in items])
    batch["valid"] = torch.tensor([bool(f.get("valid", True)) for f in items])
    return batch


class QATask(Task):
    """Span loss (CE over start + CE over end) / 2, averaged over valid windows; dev: loss and start/end/span accuracy.

    Padding positions are masked out of the softmax so a window's logits compete only among its tokens.
    """

    name, family = "qa", "bert"
    input_names = ("input_ids", "attention_mask", "token_type_ids")

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def collate(self, samples, *, epoch=0, train=True):
        return collate_qa(samples, self.pad_id)

    def forward(self, model, batch):
        out = model(**self.model_inputs(batch))
        pad = batch["attention_mask"] == 0
        s = out["start_logits"].float().masked_fill(pad, -1e4)
        e = out["end_logits"].float().masked_fill(pad, -1e4)
        out["start_logits"], out["end_logits"] = s, e
        valid = batch["valid"].float()
        per_item = (torch.nn.functional.cross_entropy(s, batch["start_positions"], reduction="none")
                    + torch.nn.functional.cross_entropy(e, batch["end_positions"], reduction="none")) / 2
        out["per_item_loss"] = per_item
        out["loss"] = (per_item * valid).sum() / valid.sum().clamp(min=1)
        return out

    def eval_sums(self, out, batch):
        valid = batch["valid"].bool()
        s_ok = (out["start_logits"].argmax(-1) == batch["start_positions"]) & valid
        e_ok = (out["end_logits"].argmax(-1) == batch["end_positions"]) & valid
        null = (batch["start_positions"] == 0) & (batch["end_positions"] == 0) & valid  # labelled at [CLS]
        span_ok = s_ok & e_ok
        return {"count": float(valid.sum()), "loss_sum": float((out["per_item_loss"] * valid).sum()),
                "start_ok": float(s_ok.sum()), "end_ok": float(e_ok.sum()), "span_ok": float(span_ok.sum()),
                "answer_count": float((valid & ~null).sum()), "answer_ok": float((span_ok & ~null).sum()),
                "null_count": float(null.sum()), "null_ok": float((span_ok & null).sum())}

    def eval_metrics(self, s):
        """``accuracy`` over every window; ``answer_accuracy`` over the windows that hold the answer and
        ``null_accuracy`` over those labelled at [CLS]: a run stuck on [CLS] has a high null and a
        near-zero answer accuracy, and its overall accuracy is the share of null windows."""
        n = max(s["count"], 1.0)
        return {"loss": s["loss_sum"] / n, "start_accuracy": s["start_ok"] / n, "end_accuracy": s["end_ok"] / n,
                "accuracy": s["span_ok"] / n, "answer_accuracy": s["answer_ok"] / max(s["answer_count"], 1.0),
                "null_accuracy": s["null_ok"] / max(s["null_count"], 1.0), "null_share": s["null_count"] / n}

    def tokens(self, batch):
        return int(batch["attention_mask"].sum())

    def batch_flops(self, batch, config):
        """Real window lengths (not the padded width, not max_position_embeddings, no MLM head): MFU stays honest."""
        from models.flops import encoder_training_flops

        rows = batch["attention_mask"][batch["valid"].bool()] if "valid" in batch else batch["attention_mask"]
        return encoder_training_flops(config, rows.sum(1).tolist(), head_outputs=2)


def build_qa_model(release: Path, init: str, seed: int = 0) -> torch.nn.Module:
    """Our `QuestionAnswering` on the release's BERT encoder; `init=random` re-initializes every weight.

    The new head (and a random encoder) is drawn from `seed`, so runs repeat and every rank starts equal.
    """
    import models
    from models.bert import init_bert_

    torch.manual_seed(seed)
    try:
        model, _report = models.hf.from_hf(release, head="qa")
    except ValueError as exc:
        raise FinetuneError(f"{release}: {exc} QA fine-tuning supports BERT-architecture checkpoints.") from None
    if getattr(model, "family", None) != "bert":
        raise FinetuneError(f"{release} holds a {getattr(model, 'family', '?')} model; QA fine-tuning needs a BERT-architecture encoder.")
    if init == "random":
        init_bert_(model, model.config)
    return model


def _read(path: str, cfg: FinetuneConfig, tokenizer: Any, *, labels_report: bool) -> tuple[list[QAExample], list[dict[str, Any]], ReadReport]:
    """Examples + labelled windows; questions whose answer fits no window count as bad (training file)."""
    q, d = cfg.qa, cfg.data
    examples, report = read_squad(path, version_2=q.version_2, max_bad_share=d.max_bad_share)
    feats = prepare_features(examples, tokenizer, max_seq_len=d.max_seq_len, doc_stride=q.doc_stride,
                             max_query_len=q.max_query_len, labels=True, version_2=q.version_2,
                             report=report if labels_report else None)
    if labels_report:
        check_bad_share(report, d.max_bad_share, hint="raise data.max_seq_len so answers fit in a window, or fix the file")
    if not feats:
        raise FinetuneError(f"{path}: no window holds an answer; check data.max_seq_len and qa.doc_stride.")
    return examples, feats, report


def finetune_qa(cfg: FinetuneConfig) -> dict[str, Any]:
    """Fine-tune a span head, export the best epoch, decode the dev set with the export; returns metrics + paths."""
    env = start_ranks(cfg)
    run_dir = Path(cfg.train.run_dir)
    release = resolve_release(cfg.checkpoint, run_dir, env, FAMILIES, "qa")
    d = cfg.data
    tokenizer = load_tokenizer(release)
    _, train_feats, train_report = _read(d.train, cfg, tokenizer, labels_report=True)
    val_ex, val_feats, val_report = _read(d.validation, cfg, tokenizer, labels_report=False)
    model = build_qa_model(release, cfg.init, cfg.train.seed)
    check_max_seq_len(d.max_seq_len, model.config, release)
    check_segments(True, model.config, release)  # question and context
    pad_id = pad_token_id(tokenizer, model.config, release)  # training, decoding and the release's tokenizer
    if env.rank == 0:
        print(train_report.summary(), val_report.summary(), f"{len(train_feats)} training windows, "
              f"{len(val_feats)} dev windows", sep="\n", flush=True)

    def score(out: Path) -> dict[str, Any]:
        predictions, null_odds = predict_release(out, val_ex, cfg, env=env)  # every rank scores its share
        if env.rank == 0:
            atomic_write_text(run_dir / "predictions.json", json.dumps(predictions, indent=2, ensure_ascii=False))
        return squad_metrics(val_ex, predictions, version_2=cfg.qa.version_2, null_odds=null_odds)

    task = QATask(pad_id)
    return fit_export_score(cfg, env, release, FinetuneJob(
        model=model, task=task, model_name="bert-qa", train_feats=train_feats,
        val_feats=padded_for_eval(val_feats, env.world_size * d.micro_batch_size), collate=task.collate,
        model_build={"name": "bert-qa", "checkpoint": str(release)},
        data_info={"train": str(d.train), "validation": str(d.validation), "version_2": cfg.qa.version_2},
        export=lambda step: _export_best(model, run_dir / "checkpoints", step, release, run_dir / "release", cfg, pad_id),
        score=score, card_name="qa", pipeline_tag="question-answering",
        result_extra={"predictions": str(run_dir / "predictions.json")},
    ))


def _export_best(model, checkpoints: Path, step: int, base: Path, out: Path, cfg: FinetuneConfig, pad_id: int) -> Path:
    import models
    from pipelines.engine.checkpoint import step_dir_name
    from pipelines.engine.export import consolidated_state_dict

    model.load_state_dict(consolidated_state_dict(checkpoints / step_dir_name(step)))
    hf = models.hf.to_hf(model.float().eval())
    q = cfg.qa
    card = (f"# Fine-tuned extractive QA model\n\nFrom `{base}` (init: {cfg.init}), best epoch at step {step} by "
            f"`{cfg.selection_metric}`. SQuAD {'v2.0 (null answers)' if q.version_2 else 'v1.1'}; windows of "
            f"{cfg.data.max_seq_len} tokens, doc_stride {q.doc_stride}, max_answer_len {q.max_answer_len}"
            f"{f', null_score_threshold {q.null_score_threshold}' if q.version_2 else ''}.\n\n"
            f"Load with `transformers.AutoModelForQuestionAnswering.from_pretrained(this_dir)`.\n")
    return write_task_release(hf, out, base, pad_id, card, cfg.data.max_seq_len)


@torch.no_grad()
def predict_release(release: Path, examples: list[QAExample], cfg: FinetuneConfig, batch_size: int = 32,
                    env: DistEnv | None = None) -> tuple[dict[str, str], dict[str, float]]:
    """Answers by the exported model loaded back with transformers (so the release is what was measured).
    Under ``env`` every rank calls it and runs its share of the windows' batches on its device."""
    from transformers import AutoModelForQuestionAnswering

    tokenizer = load_tokenizer(release)
    device = scoring_device(env)
    hf = AutoModelForQuestionAnswering.from_pretrained(str(release), trust_remote_code=False).eval().to(device)
    q = cfg.qa
    feats = prepare_features(examples, tokenizer, max_seq_len=cfg.data.max_seq_len, doc_stride=q.doc_stride,
                             max_query_len=q.max_query_len)
    pad_id = tokenizer.pad_token_id  # training's (write_task_release gave it to the release's tokenizer)
    pad_id = 0 if pad_id is None else pad_id  # another release: any id, padded positions are masked and cut off

    def span_logits(chunk: list[dict[str, Any]]) -> np.ndarray:  # [2 (start, end), windows, width]
        batch = collate_qa(chunk, pad_id)
        out = hf(**{k: batch[k].to(device) for k in ("input_ids", "attention_mask", "token_type_ids")})
        return torch.stack([out.start_logits, out.end_logits]).float().cpu().numpy()

    chunks = [feats[i: i + batch_size] for i in range(0, len(feats), batch_size)]
    starts: list[np.ndarray] = []
    ends: list[np.ndarray] = []
    for chunk, logits in zip(chunks, forward_on_ranks(chunks, span_logits, env), strict=True):
        for k, f in enumerate(chunk):
            n = len(f["input_ids"])
            starts.append(logits[0, k, :n])
            ends.append(logits[1, k, :n])
    return decode_predictions(examples, feats, starts, ends, n_best=q.n_best, max_answer_len=q.max_answer_len,
                              version_2=q.version_2, null_score_threshold=q.null_score_threshold)
