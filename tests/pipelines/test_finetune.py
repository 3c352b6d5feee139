"""Classification fine-tuning through the pretraining engine, from a transformers-made checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from finetune_fixtures import save_hf_bert_checkpoint, write_topic_task

from core.config import load_config
from pipelines.finetune import FinetuneConfig, run_finetune
from pipelines.finetune.data import FinetuneError

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "finetune" / "classification.yaml"


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    return save_hf_bert_checkpoint(tmp_path_factory.mktemp("hf-bert"))


@pytest.fixture(scope="module")
def topic_task(tmp_path_factory):
    return write_topic_task(tmp_path_factory.mktemp("task"))


def overrides(checkpoint, task, run_dir, *extra):
    train, val = task
    return [f"checkpoint={checkpoint}", f"data.train={train}", f"data.validation={val}", f"train.run_dir={run_dir}",
            "data.micro_batch_size=16", "data.max_seq_len=64", "optim.lr=2e-3", "logging.progress=false",
            "logging.tensorboard=false", *extra]


def test_finetune_from_transformers_checkpoint_round_trips(hf_checkpoint, topic_task, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    import models

    cfg = load_config(CONFIG, overrides(hf_checkpoint, topic_task, tmp_path / "run", "epochs=6"), cls=FinetuneConfig)
    result = run_finetune(cfg)
    release = Path(result["release_dir"])
    assert len(result["history"]) == 6 and result["best_step"] in [h["step"] for h in result["history"]]
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert saved["metrics"]["accuracy"] == result["metrics"]["accuracy"]
    assert result["metrics"]["accuracy"] > 0.5  # 3 balanced-ish classes: chance is ~0.33
    assert (tmp_path / "run" / "config.yaml").read_text().startswith("checkpoint:")  # the fine-tuning config

    # the release's card is Hub model-card metadata carrying the dev metrics of metrics.json
    from huggingface_hub import ModelCard

    card = ModelCard.load(release / "README.md")
    assert card.data.base_model == str(hf_checkpoint) and card.data.pipeline_tag == "text-classification"
    assert card.data.license and card.data.datasets == [str(cfg.data.train)]
    scores = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert scores["accuracy"] == pytest.approx(result["metrics"]["accuracy"], abs=1e-4)
    assert set(scores) == {"accuracy", "macro_f1", "mcc"}
    assert "best epoch" in card.text and "accuracy" in card.text

    # label names travel through the exported config; transformers and our loader give the same logits
    hf = AutoModelForSequenceClassification.from_pretrained(release).eval()
    assert hf.config.id2label == {0: "debugger", 1: "formatstrings", 2: "string-methods"}
    ours, report = models.hf.from_hf(release)
    assert report.missing == [] and report.unexpected == []
    assert ours.id2label == hf.config.id2label
    enc = AutoTokenizer.from_pretrained(release)(["the pdb prompt", "str.upper returns a copy"], padding=True, return_token_type_ids=True,
                                                return_tensors="pt")
    with torch.no_grad():
        ref = hf(**enc).logits
        got = ours.eval()(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])["logits"]
    assert torch.allclose(ref, got, atol=1e-5)


def test_unknown_architecture_and_bad_labels_fail_clearly(hf_checkpoint, topic_task, tmp_path):
    (tmp_path / "empty").mkdir()
    cfg = load_config(CONFIG, overrides(tmp_path / "empty", topic_task, tmp_path / "r1"), cls=FinetuneConfig)
    with pytest.raises(FinetuneError, match="not a release directory"):
        run_finetune(cfg)
    bad = tmp_path / "bad.tsv"
    bad.write_text("text\tlabel\n" + "".join(f"row {i}\tunknown-{i}\n" for i in range(20)))
    cfg = load_config(CONFIG, overrides(hf_checkpoint, (topic_task[0], bad), tmp_path / "r2"), cls=FinetuneConfig)
    with pytest.raises(FinetuneError, match="label not in the label set"):
        run_finetune(cfg)


@pytest.mark.slow
def test_two_process_deepspeed_finetune(hf_checkpoint, topic_task, tmp_path):
    from pipelines.engine.distributed import launch

    run_dir = tmp_path / "ds"
    code = launch(str(CONFIG), overrides(hf_checkpoint, topic_task, run_dir, "epochs=8", "distributed.engine=deepspeed",
                                         "distributed.zero_stage=2"), 2, module="pipelines.finetune")
    assert code == 0
    metrics = json.loads((run_dir / "metrics.json").read_text())
    history = metrics["history"]
    assert len(history) == 8 and history[-1]["loss"] < history[0]["loss"]  # dev loss falls across epochs
    assert metrics["metrics"]["accuracy"] > 0.45  # 3 classes of 20 dev sentences each: chance is 0.33


def test_best_epoch_breaks_a_tie_of_the_selection_metric_by_the_dev_loss(tmp_path):
    """Equal dev window accuracy on a small dev set is a tie of counts, not of models: the epoch with the
    lower dev loss is kept (issue #31); with equal losses too, the earlier one."""
    from pipelines.finetune.runner import best_epoch

    rows = [{"step": 7, "split": "eval", "accuracy": 0.014, "loss": 3.9}, {"step": 10, "split": "eval", "accuracy": 0.9},
            {"step": 14, "split": "eval", "accuracy": 0.649, "loss": 1.41}, {"step": 14, "split": "train", "loss": 1.0},
            {"step": 21, "split": "eval", "accuracy": 0.649, "loss": 1.17}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    step, history = best_epoch(tmp_path, "accuracy", 7)  # step 10 is no epoch end: not a candidate
    assert step == 21 and [h["epoch"] for h in history] == [1, 2, 3]
    assert best_epoch(tmp_path, "loss", 7)[0] == 21
    rows[-1]["loss"] = 1.41
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert best_epoch(tmp_path, "accuracy", 7)[0] == 14
