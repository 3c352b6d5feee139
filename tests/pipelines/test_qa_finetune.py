"""QA fine-tuning end to end: a cloze task from Python's own docs, our Trainer, a transformers release.

The task (see `test_qa.cloze_examples`): real paragraphs of `pydoc_data.topics`; a sentence with
its longest word replaced by [MASK] is the question, that word's span in the paragraph the answer.
Train and dev questions come from different topics.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_qa import cloze_examples, make_tokenizer, topic_paragraphs

from core.config import load_config
from pipelines.finetune import FinetuneConfig, run_finetune
from pipelines.finetune.data import FinetuneError
from pipelines.finetune.squad import QAExample, read_squad, write_squad

REPO = Path(__file__).resolve().parents[2]


def _dev_topics(paragraphs) -> set[str]:
    """Every 5th topic (sorted by name) is dev: never pretrained on, never trained on with answers."""
    return set(sorted({t for t, _ in paragraphs})[::5])


def split_by_topic(paragraphs):
    dev = _dev_topics(paragraphs)
    return [p for p in paragraphs if p[0] not in dev], [p for p in paragraphs if p[0] in dev]


@pytest.fixture(scope="module")
def cloze(tmp_path_factory):
    root = tmp_path_factory.mktemp("qa-cloze")
    tokenizer = make_tokenizer(root / "tokenizer")
    train_p, dev_p = split_by_topic(topic_paragraphs())
    train, dev = cloze_examples(train_p, prefix="tr"), cloze_examples(dev_p, prefix="dv")
    write_squad(root / "train.json", train)
    write_squad(root / "dev.json", dev)
    return {"root": root, "tokenizer": tokenizer, "paragraphs": train_p + dev_p, "train": train, "dev": dev}


@pytest.fixture(scope="module")
def hf_base(cloze):
    """A BERT checkpoint directory made by transformers itself (random weights) with our tokenizer."""
    from transformers import BertConfig, BertForMaskedLM

    base = cloze["root"] / "hf-bert"
    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(vocab_size=len(cloze["tokenizer"]), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=64, max_position_embeddings=128)).save_pretrained(str(base))
    cloze["tokenizer"].save_pretrained(str(base))
    return base


def qa_config(release: Path, run_dir: Path, train: Path, dev: Path, **over) -> FinetuneConfig:
    overrides = {"checkpoint": release, "data.train": train, "data.validation": dev, "train.run_dir": run_dir,
                 "data.max_seq_len": 96, "qa.doc_stride": 24, "qa.max_query_len": 48, "qa.max_answer_len": 8,
                 "data.micro_batch_size": 16, "optim.lr": 1e-3, "schedule.warmup_steps": 10, "train.log_every": 1000,
                 "logging.tensorboard": False, **over}
    return load_config(REPO / "configs/finetune/qa.yaml", [f"{k}={v}" for k, v in overrides.items()], cls=FinetuneConfig)


def _unanswerable(examples: list[QAExample], paragraphs, every: int) -> list[QAExample]:
    """v2.0: every `every`-th question is asked of another paragraph, where it has no answer."""
    out = []
    for i, ex in enumerate(examples):
        if i % every == 0:
            other = next(p for _, p in paragraphs[(i * 7) % len(paragraphs):] + paragraphs if p != ex.context)
            ex = QAExample(ex.qid, ex.question, other, [], True, ex.where)
        out.append(ex)
    return out


@pytest.mark.slow
def test_finetune_from_a_transformers_checkpoint_v2_and_release_loads_back(cloze, hf_base, tmp_path):
    from transformers import AutoModelForQuestionAnswering, AutoTokenizer

    base = hf_base
    train_p, dev_p = split_by_topic(cloze["paragraphs"])
    train = write_squad(tmp_path / "train.json", _unanswerable(cloze["train"][:160], train_p, 4), version_2=True)
    dev_ex = _unanswerable(cloze["dev"][:30], dev_p, 3)
    dev = write_squad(tmp_path / "dev.json", dev_ex, version_2=True)
    cfg = qa_config(base, tmp_path / "run", train, dev, epochs=1, **{"qa.version_2": True})
    result = run_finetune(cfg)
    run = tmp_path / "run"
    metrics = json.loads((run / "metrics.json").read_text())["metrics"]
    assert metrics == result["metrics"]
    assert {"exact_match", "f1", "HasAns_f1", "NoAns_f1", "best_exact", "best_f1"} <= set(metrics) and metrics["NoAns_total"] == 10
    from huggingface_hub import ModelCard

    card = ModelCard.load(run / "release" / "README.md")  # Hub metadata carrying the metrics.json scores
    assert card.data.pipeline_tag == "question-answering" and card.data.base_model == str(base)
    scores = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert scores["f1"] == pytest.approx(metrics["f1"], abs=1e-4) and scores["best_f1"] == pytest.approx(metrics["best_f1"], abs=1e-4)
    predictions = json.loads((run / "predictions.json").read_text())
    assert set(predictions) == {e.qid for e in dev_ex} and all(isinstance(v, str) for v in predictions.values())
    # the saved config is the fine-tuning config, and the release is a transformers QA model
    saved = load_config(run / "config.yaml", [], cls=FinetuneConfig)
    assert saved.train.task == "qa" and saved.qa.version_2
    hf = AutoModelForQuestionAnswering.from_pretrained(result["release_dir"]).eval()
    assert type(hf).__name__ == "BertForQuestionAnswering"
    tok2 = AutoTokenizer.from_pretrained(result["release_dir"])
    enc = tok2(dev_ex[1].question, dev_ex[1].context, return_tensors="pt", truncation="only_second", max_length=96)
    out = hf(**enc)
    assert out.start_logits.shape == enc["input_ids"].shape and torch.isfinite(out.end_logits).all()
    # decoding with the exported model reproduces predictions.json
    from pipelines.finetune.qa import predict_release

    again, _ = predict_release(Path(result["release_dir"]), read_squad(dev, version_2=True)[0], cfg)
    assert again == predictions


def test_bad_training_file_fails_with_file_and_question_id(cloze, hf_base, tmp_path):
    examples = [QAExample(e.qid, e.question, e.context, [{**e.answers[0], "answer_start": e.answers[0]["answer_start"] + 1}]
                          if i % 10 == 0 else e.answers, False, e.where) for i, e in enumerate(cloze["train"][:100])]
    bad = write_squad(tmp_path / "bad.json", examples)
    cfg = qa_config(hf_base, tmp_path / "run", bad, bad)
    with pytest.raises(FinetuneError, match=r"bad\.json.*question id tr-0-0.*over the limit of 1\.0%"):
        run_finetune(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()  # it failed before training
