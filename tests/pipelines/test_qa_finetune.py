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


def run_qa_windows(examples: list[QAExample], tokenizer, *, max_length: int, stride: int) -> list[dict]:
    """Training windows as transformers' `run_qa` example makes them, written independently of ours:
    every window kept, one whose context does not hold the whole answer labelled at [CLS] (0, 0)."""
    enc = tokenizer([e.question for e in examples], [e.context for e in examples], truncation="only_second",
                    max_length=max_length, stride=stride, return_overflowing_tokens=True, return_offsets_mapping=True,
                    return_token_type_ids=True)
    windows = []
    for i, k in enumerate(enc["overflow_to_sample_mapping"]):
        a0 = examples[k].answers[0]["answer_start"]
        a1 = a0 + len(examples[k].answers[0]["text"])
        offsets, context = enc["offset_mapping"][i], [j for j, s in enumerate(enc.sequence_ids(i)) if s == 1]
        start = end = 0
        if offsets[context[0]][0] <= a0 and offsets[context[-1]][1] >= a1:
            start = next(j for j in context if offsets[j][1] > a0)
            end = next(j for j in reversed(context) if offsets[j][0] < a1)
        windows.append({"input_ids": enc["input_ids"][i], "token_type_ids": enc["token_type_ids"][i],
                        "start_positions": start, "end_positions": end})
    return windows


def outside_style_release(out: Path, tokenizer) -> Path:
    """A checkpoint shaped like a sentence-embedding BERT released elsewhere (all-MiniLM-L6-v2's config.json):
    `BertModel` weights only (a pooler, no MLM head), dropout 0.1 on hidden states and attention
    probabilities, initializer_range 0.02, LayerNorm eps 1e-12, two token types, a lower-casing
    WordPiece tokenizer; random weights, 2 layers x 32 so the test runs in seconds."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(1)
    BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=128, hidden_dropout_prob=0.1,
                         attention_probs_dropout_prob=0.1, initializer_range=0.02, layer_norm_eps=1e-12,
                         type_vocab_size=2)).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def test_training_steps_equal_a_plain_transformers_loop(cloze, tmp_path):
    """Our QA fine-tuning takes the same steps as the loop a transformers user writes (issues #19, #31).

    The conditions of a checkpoint made elsewhere: dropout on (0.1 on hidden states and attention
    probabilities), linear warmup + linear decay as configured, two epochs with the per-epoch
    evaluation between them, a partial last batch in each (every window trained on each epoch). The
    reference is `BertForQuestionAnswering` from the same release with our initial head +
    `torch.optim.AdamW` with the usual groups (no decay on biases and LayerNorm) + transformers'
    `get_linear_schedule_with_warmup` + `clip_grad_norm_(1.0)`, windows made as `run_qa` makes
    them, batches as a `DataLoader` without `drop_last`, its span loss over the window's tokens
    (ours masks padding out of the softmax: documented, applied to both). Dropout masks are made equal by starting every reference
    forward from the RNG state our forward started from (a global forward hook records it): our
    model and transformers' draw their masks in the same order and shapes, so every logged loss and
    every exported weight must match. Any difference in what the model sees, where dropout acts,
    the labels, the loss averaging, the parameter groups, the schedule, clipping, the train/eval mode
    around the evaluation or the order of batches shows here; seed noise cannot hide it.
    """
    import numpy as np
    from torch.nn.modules.module import register_module_forward_pre_hook
    from transformers import AutoTokenizer, BertForQuestionAnswering, get_linear_schedule_with_warmup

    from models.heads import QuestionAnswering
    from pipelines.finetune.qa import build_qa_model

    base = outside_style_release(tmp_path / "release", cloze["tokenizer"])
    short = [e for e in cloze["train"] if len(cloze["tokenizer"](e.question)["input_ids"]) <= 40]  # no question cut
    train = write_squad(tmp_path / "train.json", short[:200])
    dev = write_squad(tmp_path / "dev.json", cloze["dev"][:20])
    lr, wd, mb, seed, warmup, epochs = 2e-3, 0.01, 12, 3, 5, 2
    cfg = qa_config(base, tmp_path / "run", train, dev, epochs=epochs, **{
        "optim.lr": lr, "optim.weight_decay": wd, "data.micro_batch_size": mb, "schedule.warmup": "linear",
        "schedule.warmup_steps": warmup, "schedule.decay": "linear", "train.seed": seed, "train.log_every": 1})
    rng_at_forward: list[torch.Tensor] = []

    def record_rng(module, _inputs):
        if isinstance(module, QuestionAnswering) and module.training:
            rng_at_forward.append(torch.get_rng_state())

    hook = register_module_forward_pre_hook(record_rng)
    try:
        result = run_finetune(cfg)
    finally:
        hook.remove()
    ours_losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
                   if json.loads(line).get("split") == "train"]

    feats = run_qa_windows(read_squad(train)[0], AutoTokenizer.from_pretrained(str(base)), max_length=96, stride=24)
    ref = BertForQuestionAnswering.from_pretrained(str(base)).train()
    assert ref.config.hidden_dropout_prob == ref.config.attention_probs_dropout_prob == 0.1
    head = build_qa_model(base, "pretrained", seed).qa_outputs  # the head our run started from
    ref.qa_outputs.load_state_dict(head.state_dict())
    no_decay = [p for n, p in ref.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
    decay = [p for n, p in ref.named_parameters() if not (n.endswith("bias") or "LayerNorm" in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}], lr=lr)
    steps = -(-len(feats) // mb)  # the last batch is partial, as a DataLoader's without drop_last
    assert len(feats) % mb, "the data must leave a partial last batch: every window is trained on each epoch"
    assert len(ours_losses) == len(rng_at_forward) == epochs * steps >= 20
    hf_factor = get_linear_schedule_with_warmup(opt, warmup, epochs * steps).lr_lambdas[0]
    # Our schedules number the update being taken from 1 (pipelines/engine/schedules.py), transformers'
    # from 0: our update k is transformers' k + 1 (the first warmup update gets lr/warmup, not 0).
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: hf_factor(k + 1))
    ref_losses, ref_at_step = [], {}
    for epoch in range(epochs):
        order = np.random.default_rng([seed, epoch, 13]).permutation(len(feats))  # MapStyleSource's
        for k in range(steps):
            items = [feats[i] for i in order[k * mb: (k + 1) * mb]]
            width = max(len(f["input_ids"]) for f in items)
            ids = torch.tensor([f["input_ids"] + [0] * (width - len(f["input_ids"])) for f in items])
            types = torch.tensor([f["token_type_ids"] + [0] * (width - len(f["input_ids"])) for f in items])
            mask = (torch.arange(width)[None, :] < torch.tensor([len(f["input_ids"]) for f in items])[:, None]).long()
            torch.set_rng_state(rng_at_forward[len(ref_losses)])  # the dropout masks of our step
            out = ref(input_ids=ids, attention_mask=mask, token_type_ids=types)
            s, e = out.start_logits.masked_fill(mask == 0, -1e4), out.end_logits.masked_fill(mask == 0, -1e4)
            loss = (torch.nn.functional.cross_entropy(s, torch.tensor([f["start_positions"] for f in items]))
                    + torch.nn.functional.cross_entropy(e, torch.tensor([f["end_positions"] for f in items]))) / 2
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            sched.step()
            ref_losses.append(loss.item())
        ref_at_step[len(ref_losses)] = {n: v.clone() for n, v in ref.state_dict().items()}

    # every step drew fresh masks: the RNG was never re-seeded to one state (a mask repeated every step)
    assert len({bytes(s.numpy()) for s in rng_at_forward}) == len(rng_at_forward)
    assert ours_losses == pytest.approx(ref_losses, rel=1e-4, abs=1e-5)
    # A constant added to every logit of a softmax has zero gradient in exact arithmetic: the attention
    # key biases, the span head's bias and the last LayerNorm's bias (it reaches the logits only through
    # the head: the same shift at every position). Adam turns their rounding noise into lr-sized steps,
    # in transformers as in ours, so they are not compared.
    noise_driven = ("attention.self.key.bias", "qa_outputs.bias", "layer.1.output.LayerNorm.bias")
    exported = BertForQuestionAnswering.from_pretrained(result["release_dir"]).state_dict()  # the best epoch
    far = {n: float((exported[n] - v).abs().max()) for n, v in ref_at_step[result["best_step"]].items()
           if not n.endswith(noise_driven) and not torch.allclose(exported[n], v, rtol=1e-3, atol=1e-4)}
    assert not far, far
