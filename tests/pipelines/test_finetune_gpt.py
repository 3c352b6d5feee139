"""Classification fine-tuning of GPT releases (ours from `pretrain export`, and transformers-made GPT-2s):
our `LastTokenClassifier` computes what transformers' `GPT2ForSequenceClassification` computes, and the
fine-tuned release, loaded with transformers, serves what the run reported."""

from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path

import pytest
import torch
from finetune_fixtures import save_hf_gpt2, save_our_gpt_checkpoint, write_topic_task

REPO = Path(__file__).resolve().parents[2]
TEXTS = ["Return a copy of the string with leading whitespace removed.",  # rows of different lengths: padded batch
         "The debugger prompt.",
         "Format specifications are used within replacement fields contained within a format string to define "
         "how individual values are presented."]


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """Our GPT release (a gpt-tiny run checkpoint exported as `pretrain export` does) and a transformers GPT-2."""
    from pipelines.engine.export import export_checkpoint

    root = tmp_path_factory.mktemp("gpt-releases")
    ckpt = save_our_gpt_checkpoint(root / "run")
    return {"ours": export_checkpoint(ckpt, root / "ours"), "transformers": save_hf_gpt2(root / "gpt2"),
            "ours-checkpoint": ckpt}


@pytest.fixture(scope="module")
def topic_task(tmp_path_factory):
    return write_topic_task(tmp_path_factory.mktemp("task"), per_class=60)


@pytest.mark.parametrize("regression", [False, True], ids=["classification", "regression"])
@pytest.mark.parametrize("source", ["ours", "transformers"])
def test_our_gpt_classifier_computes_what_gpt2_for_sequence_classification_computes(releases, source, regression):
    """Same weights, same right-padded batch of different lengths (pad = eos, the tokenizer has no pad token):
    transformers classifies each row's last non-pad token; a classifier reading the padding (or the first
    token, as BERT's) would differ in logits and loss."""
    import transformers

    from pipelines.finetune.classification import build_classifier
    from pipelines.finetune.inputs import pad_token_id
    from pipelines.finetune.runner import load_tokenizer

    release = releases[source]
    tok = load_tokenizer(release)
    assert tok.pad_token is None  # GPT-2's situation: the pad id is the end-of-text token
    labels = ["a", "b", "c"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = build_classifier(release, labels, regression, "pretrained", seed=0)
    pad = pad_token_id(tok, ours.config, release, ("eos_token_id",))
    assert pad == tok.eos_token_id
    ours.pad_token_id = pad
    ours.eval()
    n = 1 if regression else 3
    theirs = transformers.GPT2ForSequenceClassification.from_pretrained(
        str(release), num_labels=n, pad_token_id=pad, problem_type=ours.problem_type).eval()
    with torch.no_grad():
        theirs.score.weight.copy_(ours.score.weight)
    tok.pad_token = tok.eos_token
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    lengths = enc["attention_mask"].sum(1)
    assert len(set(lengths.tolist())) == 3 and tok.padding_side == "right"
    y = torch.tensor([0.2, 1.5, -0.7]) if regression else torch.tensor([2, 0, 1])
    with torch.no_grad():
        mine = ours(enc["input_ids"], enc["attention_mask"], labels=y)
        ref = theirs(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], labels=y)
    torch.testing.assert_close(mine["logits"], ref.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine["loss"], ref.loss, atol=1e-5, rtol=1e-5)
    # and what our export writes is that same transformers model
    import models

    exported = models.hf.to_hf(ours)
    assert type(exported).__name__ == "GPT2ForSequenceClassification" and exported.config.pad_token_id == pad
    with torch.no_grad():
        torch.testing.assert_close(exported(**enc).logits, ref.logits, atol=1e-5, rtol=1e-5)


def test_a_released_gpt2_classifier_reads_back_with_its_labels_and_pad_id(releases):
    """from_hf of a `GPT2ForSequenceClassification` directory builds our classifier with its labels and pad id."""
    import models

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = models.hf.from_hf(releases["transformers"], head="classification", num_labels=2,
                                     id2label={0: "no", 1: "yes"})
    model.pad_token_id = 0
    hf = models.hf.to_hf(model)
    back, report = models.hf.from_hf(hf)
    assert type(back).__name__ == "LastTokenClassifier" and back.id2label == {0: "no", 1: "yes"}
    assert back.pad_token_id == 0 and not report.missing and not report.unexpected


def test_init_random_redraws_the_gpt_body_and_keeps_the_classifier_whole(releases):
    """`init=random` (the baseline for pretraining) re-initializes every body weight; the LM head stays dropped."""
    from pipelines.finetune.classification import build_classifier

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pre = build_classifier(releases["ours"], ["a", "b"], False, "pretrained", seed=0)
        rnd = build_classifier(releases["ours"], ["a", "b"], False, "random", seed=0)
    assert set(pre.state_dict()) == set(rnd.state_dict()) and rnd.backbone.lm_head is None
    for key in ("backbone.wte.weight", "backbone.blocks.0.attn.qkv.weight", "backbone.blocks.1.mlp.fc2.weight"):
        assert not torch.equal(pre.state_dict()[key], rnd.state_dict()[key]), key
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    rnd.pad_token_id = 0
    assert torch.isfinite(rnd(ids, (ids != 0).long(), labels=torch.tensor([0, 1]))["loss"])


@pytest.mark.slow
@pytest.mark.parametrize("source", ["ours-checkpoint", "transformers"])
def test_pretrain_finetune_of_a_gpt_release_serves_what_it_reported(releases, source, tmp_path):
    """`pretrain finetune configs/demo/finetune_docstrings.yaml` from our GPT run checkpoint and from a transformers
    GPT-2, on the demo's docstring task: transformers' `pipeline` on the release (batched, so padded) gives the
    accuracy the run recorded for its best epoch (our model in training) and, example by example, our model's
    predictions."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    import models
    from pipelines.cli import main
    from pipelines.ops.demo_data import write_classification_task

    write_classification_task(tmp_path / "task", max_per_class=30)
    run = tmp_path / "run"
    assert main(["finetune", str(REPO / "configs" / "demo" / "finetune_docstrings.yaml"),
                 f"checkpoint={releases[source]}", f"data.train={tmp_path / 'task' / 'train.tsv'}",
                 f"data.validation={tmp_path / 'task' / 'validation.tsv'}", f"train.run_dir={run}", "epochs=3",
                 "data.max_seq_len=64", "logging.progress=false", "logging.tensorboard=false"]) == 0
    result = json.loads((run / "metrics.json").read_text())
    best = next(h for h in result["history"] if h["step"] == result["best_step"])
    assert result["metrics"]["accuracy"] == pytest.approx(best["accuracy"])  # the release = our model in training

    release = run / "release"
    hf = AutoModelForSequenceClassification.from_pretrained(str(release)).eval()
    tok = AutoTokenizer.from_pretrained(str(release))
    assert type(hf).__name__ == "GPT2ForSequenceClassification"
    assert hf.config.pad_token_id == tok.pad_token_id == tok.eos_token_id and tok.padding_side == "right"
    assert set(hf.config.label2id) == {"tkinter", "asyncio", "email", "logging", "xml"}
    assert hf.config.id2label[hf.config.label2id["xml"]] == "xml"
    assert "token_type_ids" not in tok("a text")  # GPT2Model would add their embeddings: training fed none

    with open(tmp_path / "task" / "validation.tsv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))  # as the run read it: quoted cells unquoted
    texts, gold = [r["text"] for r in rows], [r["label"] for r in rows]
    assert tok.model_max_length == 64  # truncation=True stops where training did (it was the position table's 128)
    served = [p["label"] for p in pipeline("text-classification", model=hf, tokenizer=tok, batch_size=8)(
        texts, truncation=True)]
    assert sum(p == g for p, g in zip(served, gold, strict=True)) / len(gold) == pytest.approx(result["metrics"]["accuracy"])
    ours, _ = models.hf.from_hf(release)  # our LastTokenClassifier, our forward
    ours.eval()
    mine = []
    with torch.no_grad():
        for i in range(0, len(texts), 16):
            enc = tok(texts[i: i + 16], padding=True, truncation=True, max_length=64, return_tensors="pt")
            mine += [ours.id2label[int(k)] for k in ours(enc["input_ids"], enc["attention_mask"])["logits"].argmax(-1)]
    assert mine == served


def test_qa_on_a_gpt_release_is_refused_in_one_line(releases, topic_task, tmp_path, capsys):
    """Extractive QA needs a BERT encoder: a GPT release (or run) is refused naming the model, exit 2, nothing written."""
    from pipelines.cli import main

    train, val = topic_task
    for source in ("ours", "ours-checkpoint"):
        code = main(["finetune", str(REPO / "configs" / "finetune" / "qa.yaml"), f"checkpoint={releases[source]}",
                     f"data.train={train}", f"data.validation={val}", f"train.run_dir={tmp_path / 'run'}"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
        assert "holds a gpt model; qa fine-tuning needs a BERT-architecture encoder" in err[0]
        assert not (tmp_path / "run").exists()


def test_the_release_tokenizer_of_a_gpt_drops_segment_ids(tmp_path):
    """A GPT trained with a WordPiece tokenizer (which returns token_type_ids): transformers' GPT2Model adds
    wte[token_type_ids] to the input, which our GPT never did, so the release's tokenizer must not return them."""
    from finetune_fixtures import save_wordpiece_tokenizer
    from transformers import AutoTokenizer

    from pipelines.finetune.inputs import release_tokenizer

    base = save_wordpiece_tokenizer(tmp_path / "wp")
    tok = AutoTokenizer.from_pretrained(str(base), model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    tok.save_pretrained(str(base))
    out, changed = release_tokenizer(base, 0, tmp_path / "staged", 128, ("input_ids", "attention_mask"))
    assert any(c.startswith("model_input_names") for c in changed)
    assert set(AutoTokenizer.from_pretrained(str(out))("a", "b")) == {"input_ids", "attention_mask"}


def test_a_gpt_without_pad_or_end_of_text_token_is_refused_with_a_pad_that_works(tmp_path):
    """A byte-level BPE saved with no special tokens: the refusal told GPT users to pad with the unk token (there
    is none) as 'any id works'; for a GPT the pad id picks the classified token, so it must be one no text ends with."""
    import transformers

    from pipelines.finetune.classification import CLASSIFIER_FAMILIES
    from pipelines.finetune.data import FinetuneError
    from pipelines.finetune.inputs import pad_token_id

    src = save_hf_gpt2(tmp_path / "gpt2")
    tok = transformers.AutoTokenizer.from_pretrained(str(src), bos_token=None, eos_token=None, unk_token=None)
    config = transformers.GPT2Config.from_pretrained(str(src))
    assert tok.pad_token_id is tok.eos_token_id is tok.unk_token_id is config.pad_token_id is None
    with pytest.raises(FinetuneError, match=r"no pad token and no eos_token_id, and config.json no pad_token_id.* "
                                            r"the pad must be a token no text ends with") as err:
        pad_token_id(tok, config, src, CLASSIFIER_FAMILIES["gpt"].pad_fallbacks)
    assert "any id works" not in str(err.value)
