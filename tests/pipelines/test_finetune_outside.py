"""Fine-tuning BERTs published elsewhere, with other people's tokenizer and config choices: each is refused
before training with one clear message, or trained, exported and scored as transformers will run the release."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from finetune_fixtures import (
    pydoc_paragraphs,
    save_outside_bert,
    write_pair_task,
    write_regression_task,
    write_topic_task,
)

from core.config import load_config
from pipelines.finetune import FinetuneConfig, run_finetune
from pipelines.finetune.data import FinetuneError, collate_classification, encode_examples, read_examples

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "finetune" / "classification.yaml"


@pytest.fixture(scope="module")
def topic_task(tmp_path_factory):
    return write_topic_task(tmp_path_factory.mktemp("task"), per_class=60)


def finetune(checkpoint: Path, task: tuple[Path, Path], run_dir: Path, *extra: str) -> dict:
    train, val = task
    return run_finetune(load_config(CONFIG, [
        f"checkpoint={checkpoint}", f"data.train={train}", f"data.validation={val}", f"train.run_dir={run_dir}",
        "epochs=2", "data.micro_batch_size=16", "data.max_seq_len=64", "optim.lr=2e-3", "logging.progress=false",
        "logging.tensorboard=false", *extra], cls=FinetuneConfig))


def test_an_outside_classifier_fine_tuned_for_regression_is_released_as_a_regression_model(topic_task, tmp_path):
    """The source's 2-label head (names neg/pos, single-label) is not the new task's: the release says regression."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    src = save_outside_bert(tmp_path / "sentiment", model_class="BertForSequenceClassification", num_labels=2,
                            problem_type="single_label_classification", id2label={0: "neg", 1: "pos"},
                            label2id={"neg": 0, "pos": 1})
    result = finetune(src, write_regression_task(topic_task, tmp_path), tmp_path / "run", "data.regression=true",
                      "selection_metric=pearson")
    hf = AutoModelForSequenceClassification.from_pretrained(result["release_dir"]).eval()
    assert hf.config.problem_type == "regression" and hf.config.num_labels == 1 and "neg" not in hf.config.label2id
    tok = AutoTokenizer.from_pretrained(result["release_dir"])
    out = hf(**tok(["the pdb prompt"], return_tensors="pt"), labels=torch.tensor([0.5]))
    assert out.loss.item() == pytest.approx((out.logits.item() - 0.5) ** 2, rel=1e-5)  # MSE, transformers' own loss
    score = pipeline("text-classification", model=hf, tokenizer=tok)("the pdb prompt")[0]["score"]
    assert score == pytest.approx(out.logits.item(), rel=1e-5)  # the raw prediction, not a sigmoid of it


@pytest.mark.parametrize("variant", [dict(no_pad_token=True), dict(tokenizer_kwargs={"padding_side": "left"}),
                                     dict(tokenizer_kwargs={"model_input_names": ["input_ids", "attention_mask"]})],
                         ids=["no pad token", "pads on the left", "no token_type_ids"])
def test_the_release_tokenizer_feeds_the_model_what_training_did(topic_task, tmp_path, variant):
    """A tokenizer without a pad token crashed after training; one padding left or leaving out segment ids scored
    the release on other inputs than training's. The release's tokenizer, called with its defaults, now gives
    exactly training's batches, and metrics.json is what the release does on them."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    src = save_outside_bert(tmp_path / "src", **variant)
    pairs = write_pair_task(topic_task, tmp_path)
    result = finetune(src, pairs, tmp_path / "run", "data.text_pair_column=text2")
    release = Path(result["release_dir"])
    columns = dict(text_column="text", text_pair_column="text2", label_column="label")
    _, labels, _ = read_examples(pairs[0], **columns)
    dev, _, _ = read_examples(pairs[1], label_names=labels, **columns)
    trained = collate_classification(encode_examples(dev, AutoTokenizer.from_pretrained(src), 64), pad_id=0)  # [PAD]

    tok = AutoTokenizer.from_pretrained(release)
    served = tok([e.text for e in dev], [e.text_pair for e in dev], truncation="longest_first", max_length=64,
                 padding=True, return_tensors="pt")
    assert set(served) == {"input_ids", "token_type_ids", "attention_mask"}
    for name in served:
        assert torch.equal(served[name], trained[name]), name
    hf = AutoModelForSequenceClassification.from_pretrained(release).eval()
    assert hf.config.pad_token_id == tok.pad_token_id == 0
    with torch.no_grad():
        pred = hf(**served).logits.argmax(-1)
    assert result["metrics"]["accuracy"] == pytest.approx((pred == trained["labels"]).float().mean().item())


def test_the_release_tokenizer_truncates_where_training_did(topic_task, tmp_path):
    """A tokenizer saved without model_max_length (transformers' 10**30) gave a release that pipeline(...,
    truncation=True) fed 300 positions into a 128-position model: a crash. Capped at the position table (128),
    it still read texts longer than training's data.max_seq_len (64) further than training and metrics.json
    did, so the pipeline's accuracy was not metrics.json's. The release's tokenizer stops at max_seq_len."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    src = save_outside_bert(tmp_path / "src")
    assert AutoTokenizer.from_pretrained(src).model_max_length > 10**20
    release = finetune(src, topic_task, tmp_path / "run", "epochs=1")["release_dir"]
    tok = AutoTokenizer.from_pretrained(release)
    assert tok.model_max_length == 64
    long_text = " ".join(pydoc_paragraphs(40))
    assert len(tok(long_text)["input_ids"]) > 128
    served = pipeline("text-classification", model=release)(long_text, truncation=True, top_k=None)
    hf = AutoModelForSequenceClassification.from_pretrained(release).eval()
    with torch.no_grad():  # what training and metrics.json fed the model: its first 64 tokens
        probs = hf(**tok(long_text, truncation=True, max_length=64, return_tensors="pt")).logits.softmax(-1)[0]
    assert {r["label"]: r["score"] for r in served} == pytest.approx(
        {hf.config.id2label[i]: p for i, p in enumerate(probs.tolist())}, abs=1e-6)


def test_max_seq_len_beyond_the_position_table_is_refused_before_training(topic_task, tmp_path):
    src = save_outside_bert(tmp_path / "src", max_position_embeddings=32)
    with pytest.raises(FinetuneError, match=r"data.max_seq_len=64 exceeds the model's max_position_embeddings=32"):
        finetune(src, topic_task, tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_pair_task_on_a_model_with_one_token_type_is_refused_before_training(topic_task, tmp_path):
    src = save_outside_bert(tmp_path / "src", type_vocab_size=1)
    with pytest.raises(FinetuneError, match=r"type_vocab_size=1: the model cannot tell a text pair's two segments"):
        finetune(src, write_pair_task(topic_task, tmp_path), tmp_path / "run", "data.text_pair_column=text2")
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert finetune(src, topic_task, tmp_path / "single", "epochs=1")["metrics"]  # single texts: type 0 only


def test_no_pad_token_in_the_tokenizer_nor_the_config_is_refused_before_training(topic_task, tmp_path):
    src = save_outside_bert(tmp_path / "src", no_pad_token=True, pad_token_id=None)
    with pytest.raises(FinetuneError, match="the tokenizer has no pad token and config.json no pad_token_id"):
        finetune(src, topic_task, tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()


def task_config(config: str, checkpoint: Path, task: tuple[Path, Path], run_dir: Path) -> FinetuneConfig:
    """The shipped fine-tuning ``config`` on ``checkpoint`` and the topic task's files."""
    train, val = task
    return load_config(CONFIG.parent / config, [f"checkpoint={checkpoint}", f"data.train={train}",
                                                f"data.validation={val}", f"train.run_dir={run_dir}"], cls=FinetuneConfig)


@pytest.mark.parametrize("config", ["classification_small.yaml", "qa.yaml"])
def test_a_release_without_tokenizer_files_is_refused_before_training(topic_task, tmp_path, config):
    """transformers 5 builds a 5-token tokenizer for a directory with no tokenizer files: fine-tuning trained
    on all-[UNK] inputs and released a model without a tokenizer. Now one message names the missing files."""
    src = save_outside_bert(tmp_path / "src")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        (src / name).unlink(missing_ok=True)
    cfg = task_config(config, src, topic_task, tmp_path / "run")
    with pytest.raises(FinetuneError, match=r"no tokenizer files \(none of tokenizer.json, vocab.txt, vocab.json\)"):
        run_finetune(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("config", ["classification_small.yaml", "qa.yaml"])
def test_an_image_release_is_refused_for_its_family_not_its_tokenizer(topic_task, tmp_path, config):
    """A ViT release has no tokenizer at all: the message must name the model, before a tokenizer is read."""
    import transformers

    torch.manual_seed(0)
    vit = tmp_path / "vit"
    transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8,
    )).save_pretrained(str(vit), safe_serialization=True)
    cfg = task_config(config, vit, topic_task, tmp_path / "run")
    wanted = {"classification_small.yaml": r"classification fine-tuning needs a BERT-architecture encoder .* or a "
                                           r"GPT-2-architecture decoder", "qa.yaml": r"qa fine-tuning needs a BERT-"
                                           r"architecture encoder \(a release of a configs/train/bert_\*.yaml run"}[config]
    with pytest.raises(FinetuneError, match=rf"holds a vit model; {wanted}"):
        run_finetune(cfg)
    assert not (tmp_path / "run").exists()
