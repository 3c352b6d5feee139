"""Extractive QA data: SQuAD reading with bad-input accounting, windows, n-best decoding, official EM/F1.

Also holds the helpers `test_qa_finetune.py` imports: a WordPiece tokenizer trained on Python's own
`pydoc_data.topics`, and a cloze-style QA task built from those real paragraphs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from pipelines.finetune.data import FinetuneError
from pipelines.finetune.squad import (
    QAExample,
    decode_predictions,
    exact_match_score,
    f1_score,
    normalize_answer,
    prepare_features,
    read_squad,
    squad_metrics,
    write_squad,
)

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


# --------------------------------------------------------------------------------------------- helpers
def topic_paragraphs() -> list[tuple[str, str]]:
    """(topic, paragraph) for the prose paragraphs of `pydoc_data.topics` (no code blocks or headings)."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        for para in re.split(r"\n\s*\n", topics[name]):
            if len(para) < 200 or any(line.startswith(" ") for line in para.splitlines()) or "***" in para or "===" in para:
                continue
            out.append((name, para))
    return out


def make_tokenizer(out_dir: Path, vocab_size: int = 2000):
    """A BERT-style WordPiece tokenizer trained on the pydoc topics, saved as a fast tokenizer directory."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator([topics[k] for k in sorted(topics)],
                            trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIALS))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tok.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", model_max_length=512)
    fast.save_pretrained(str(out_dir))
    return fast


def cloze_examples(paragraphs: list[tuple[str, str]], *, prefix: str, per_paragraph: int = 3,
                   blank: str = "[MASK]") -> list[QAExample]:
    """A sentence of the paragraph with one word blanked is the question; that word, in place, is the answer.

    The blanked word is the sentence's longest word (>= 4 letters, not its first; the earliest on a
    tie), so the answer is a content word; the model still has to find the sentence in the context.
    """
    out: list[QAExample] = []
    for p, (topic, para) in enumerate(paragraphs):
        made = 0
        for m in re.finditer(r"[^.!?]+[.!?]", para):
            sent, s0 = m.group(0), m.start()
            words = list(re.finditer(r"[A-Za-z]{4,}", sent))[1:]
            if len(sent.split()) < 8 or not words:
                continue
            w = max(words, key=lambda x: (len(x.group(0)), -x.start()))
            question = " ".join((sent[: w.start()] + blank + sent[w.end():]).split())
            out.append(QAExample(f"{prefix}-{p}-{made}", question, para,
                                 [{"text": w.group(0), "answer_start": s0 + w.start()}], False, topic))
            made += 1
            if made >= per_paragraph:
                break
    return out


@pytest.fixture(scope="session")
def qa_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("qa-tok")
    make_tokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _example(qid, context, answers, impossible=False):
    return QAExample(qid, "q?", context, [{"text": a, "answer_start": context.find(a)} for a in answers], impossible, qid)


# --------------------------------------------------------------------------------------------- metrics
def test_normalization_follows_the_official_script():
    assert normalize_answer("The  Cat's\tHat!") == "cats hat"
    assert normalize_answer("an apple, a pear and THE plum.") == "apple pear and plum"
    assert normalize_answer("theory") == "theory"  # articles only as whole words
    assert normalize_answer("...") == ""


def test_em_f1_hand_made_including_multiple_gold_and_unanswerable():
    assert exact_match_score("the Eiffel Tower", "Eiffel tower.") == 1.0
    # pred "big red dog" vs gold "red dog house": 2 common tokens, P = 2/3, R = 2/3
    assert f1_score("big red dog", "red dog house") == pytest.approx(2 / 3)
    assert f1_score("", "") == 1.0 and f1_score("x", "") == 0.0 and f1_score("", "x") == 0.0
    ctx = "Paris is in France. The dog ran home. Nothing here."
    examples = [
        _example("q1", ctx, ["Paris", "France"]),  # multiple gold: max over them
        _example("q2", ctx, ["dog ran home", "The dog"]),
        _example("q3", ctx, [], impossible=True),
        _example("q4", ctx, [], impossible=True),
        _example("q5", ctx, ["Nothing"]),  # no prediction -> scores 0
    ]
    preds = {"q1": "france", "q2": "the dog ran", "q3": "", "q4": "Paris"}
    m = squad_metrics(examples, preds)
    # q2: vs "dog ran home": common {dog, ran} P=1 R=2/3 -> 0.8; vs "The dog": {dog} P=1/2 R=1 -> 2/3; EM 0
    em = [1, 0, 1, 0, 0]
    f1 = [1, 0.8, 1, 0, 0]
    assert m["exact_match"] == pytest.approx(100 * np.mean(em))
    assert m["f1"] == pytest.approx(100 * np.mean(f1))
    assert m["total"] == 5
    assert m["HasAns_exact_match"] == pytest.approx(100 / 3) and m["HasAns_f1"] == pytest.approx(100 * 1.8 / 3)
    assert m["NoAns_exact_match"] == 50.0 and m["NoAns_f1"] == 50.0 and m["NoAns_total"] == 2
    v1 = squad_metrics(examples[:2], preds)
    assert "HasAns_f1" not in v1 and v1["f1"] == pytest.approx(90.0)


# ---------------------------------------------------------------------------------------------- reading
def _squad(path: Path, qas_by_context: list[tuple[str, list[dict]]]) -> Path:
    doc = {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": c, "qas": q} for c, q in qas_by_context]}]}
    path.write_text(json.dumps(doc))
    return path


def test_bad_questions_are_counted_with_file_and_id_then_fail_over_threshold(tmp_path):
    ctx = "Guido van Rossum created Python in 1991."
    good = [{"id": f"g{i}", "question": "who?", "answers": [{"text": "Guido", "answer_start": 0}]} for i in range(150)]
    bad = [
        {"id": "shifted", "question": "when?", "answers": [{"text": "1991", "answer_start": 3}]},
        {"id": "noanswers", "question": "what?"},
        {"id": "v2only", "question": "why?", "answers": [], "is_impossible": True},
    ]
    path = _squad(tmp_path / "train.json", [(ctx, good + bad)])
    examples, report = read_squad(path, max_bad_share=0.05)
    assert len(examples) == 150 and report.total == 153
    assert report.bad["answer_start does not match the context"] == 1
    assert "question id shifted" in report.first_bad["answer_start does not match the context"]
    assert str(path) in report.first_bad["missing field"] and "noanswers" in report.first_bad["missing field"]
    assert "v2only" in report.summary()
    with pytest.raises(FinetuneError, match=r"train\.json.*over the limit of 1\.0%") as err:
        read_squad(path)
    assert "question id shifted" in str(err.value)
    # the same file read as v2.0: the unanswerable question is fine, with an empty gold
    examples, report = read_squad(path, version_2=True, max_bad_share=0.05)
    assert sum(report.bad.values()) == 2 and examples[-1].is_impossible and examples[-1].answers == []


def test_wrong_json_shape_and_invalid_json(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"context": "x"}]))
    with pytest.raises(FinetuneError, match=r"a\.json: wrong JSON shape"):
        read_squad(tmp_path / "a.json")
    (tmp_path / "b.json").write_text('{"data": [')
    with pytest.raises(FinetuneError, match=r"b\.json: not a valid JSON"):
        read_squad(tmp_path / "b.json")
    _squad(tmp_path / "c.json", [("ctx", [])]).write_text(json.dumps({"data": [{"paragraphs": [{"qas": [{}]}]}]}))
    with pytest.raises(FinetuneError, match="paragraph without context"):
        read_squad(tmp_path / "c.json")


def test_write_then_read_round_trip(tmp_path):
    ex = cloze_examples(topic_paragraphs()[:4], prefix="rt")
    path = write_squad(tmp_path / "rt.json", ex)
    back, report = read_squad(path)
    assert not report.bad and [(e.qid, e.answers) for e in back] == [(e.qid, e.answers) for e in ex]


# --------------------------------------------------------------------------------------------- windows
def _long_example(tokenizer, answer="nonlocal"):
    """A real-text context several windows long with the answer near the end."""
    paras = [p for _, p in topic_paragraphs()[:6]]
    context = " ".join(paras)[:1500] + f" The keyword {answer} ends this text."
    assert len(tokenizer(context)["input_ids"]) > 2 * 64
    return QAExample("long", "Which keyword ends this text?", context,
                     [{"text": answer, "answer_start": context.rindex(answer)}], False, "long")


def test_windows_cover_the_context_and_labels_map_back_to_the_answer(qa_tokenizer):
    ex = _long_example(qa_tokenizer)
    feats = prepare_features([ex], qa_tokenizer, max_seq_len=64, doc_stride=16, max_query_len=16)
    assert len(feats) >= 3 and all(len(f["input_ids"]) <= 64 for f in feats)
    covered = sorted({o for f in feats for o in f["offsets"] if o is not None})
    assert covered[0][0] == 0 and covered[-1][1] == len(ex.context.rstrip())
    labelled = prepare_features([ex], qa_tokenizer, max_seq_len=64, doc_stride=16, max_query_len=16, labels=True)
    holding = [f for f in labelled if f["start_position"] > 0]
    assert len(holding) >= 1
    for f in holding:
        s, e = f["start_position"], f["end_position"]
        assert ex.context[f["offsets"][s][0]: f["offsets"][e][1]] == "nonlocal"
    v2 = prepare_features([ex], qa_tokenizer, max_seq_len=64, doc_stride=16, max_query_len=16, labels=True, version_2=True)
    assert len(v2) == len(feats) and sum(f["start_position"] == 0 for f in v2) == len(feats) - len(holding)


def test_v1_trains_on_every_window_and_labels_windows_without_the_answer_at_cls(qa_tokenizer):
    """The standard SQuAD v1.1 recipe (BERT's run_squad, transformers' run_qa): no window is dropped.

    A window that does not hold the answer is labelled [CLS] (0, 0), so the model learns that its
    spans there are not the answer; the decoder takes the best span over all windows and relies on it.
    """
    ex = _long_example(qa_tokenizer)
    feats = prepare_features([ex], qa_tokenizer, max_seq_len=64, doc_stride=16, max_query_len=16)
    labelled = prepare_features([ex], qa_tokenizer, max_seq_len=64, doc_stride=16, max_query_len=16, labels=True)
    assert [f["input_ids"] for f in labelled] == [f["input_ids"] for f in feats]  # every window trained on
    nulls = [f for f in labelled if (f["start_position"], f["end_position"]) == (0, 0)]
    assert len(feats) >= 3 and 1 <= len(nulls) < len(feats)
    for f in nulls:  # exactly the windows whose context slice misses the answer's characters
        a0 = ex.answers[0]["answer_start"]
        ctx = [o for o in f["offsets"] if o is not None]
        assert not (ctx[0][0] <= a0 and ctx[-1][1] >= a0 + len("nonlocal"))


def test_answer_longer_than_any_window_is_counted_bad(qa_tokenizer):
    from pipelines.finetune.data import ReadReport

    ctx = " ".join(p for _, p in topic_paragraphs()[:3])
    ex = QAExample("huge", "what?", ctx, [{"text": ctx[:600], "answer_start": 0}], False, "f.json question id huge")
    report = ReadReport("f.json")
    assert prepare_features([ex], qa_tokenizer, max_seq_len=64, doc_stride=16, labels=True, report=report) == []
    assert report.first_bad == {"answer lies in no window (longer than max_seq_len allows)": "f.json question id huge"}
    with pytest.raises(FinetuneError, match="doc_stride=45"):
        prepare_features([ex], qa_tokenizer, max_seq_len=48, doc_stride=45)


# -------------------------------------------------------------------------------------------- decoding
def _peak_logits(feats, where: dict[int, tuple[int, int, float]]):
    """Low random logits, with start/end peaks of the given height in the given windows."""
    rng = np.random.default_rng(0)
    starts, ends = [], []
    for i, f in enumerate(feats):
        s, e = rng.normal(0, 0.1, len(f["input_ids"])), rng.normal(0, 0.1, len(f["input_ids"]))
        if i in where:
            a, b, h = where[i]
            s[a] += h
            e[b] += h
        starts.append(s)
        ends.append(e)
    return starts, ends


def test_doc_stride_decoding_finds_an_answer_in_the_second_window(qa_tokenizer):
    ex = _long_example(qa_tokenizer)
    # two windows of ~300 context tokens: the answer is in the second and not in the first
    feats = prepare_features([ex], qa_tokenizer, max_seq_len=320, doc_stride=32, max_query_len=16)
    assert len(feats) == 2
    a0 = ex.answers[0]["answer_start"]
    tok = [k for k, o in enumerate(feats[1]["offsets"]) if o is not None and o[0] <= a0 < o[1]]
    assert tok and all(o is None or o[1] <= a0 for o in feats[0]["offsets"])
    k = tok[0]
    c = feats[0]["offsets"].index(next(o for o in feats[0]["offsets"] if o is not None))  # first context token
    # window 1 has a weaker decoy span; window 2 peaks at the answer
    starts, ends = _peak_logits(feats, {0: (c + 2, c + 3, 4.0), 1: (k, k, 8.0)})
    preds, odds = decode_predictions([ex], feats, starts, ends, n_best=5, max_answer_len=10)
    o = feats[1]["offsets"][k]
    assert preds == {"long": ex.context[o[0]: o[1]]} and (o[0], o[1]) == (a0, a0 + len("nonlocal"))
    # a higher-scoring span longer than max_answer_len is not allowed
    starts, ends = _peak_logits(feats, {0: (c + 2, c + 40, 20.0), 1: (k, k, 8.0)})
    preds, _ = decode_predictions([ex], feats, starts, ends, n_best=5, max_answer_len=10)
    assert preds["long"] == "nonlocal"
    preds, _ = decode_predictions([ex], feats, starts, ends, n_best=5, max_answer_len=64)
    assert preds["long"] == ex.context[feats[0]["offsets"][c + 2][0]: feats[0]["offsets"][c + 40][1]]
    # the question tokens are never an answer, however high their logits
    starts, ends = _peak_logits(feats, {0: (2, 3, 50.0), 1: (k, k, 8.0)})
    assert decode_predictions([ex], feats, starts, ends, n_best=5, max_answer_len=10)[0]["long"] == "nonlocal"


def test_v2_null_answer_and_threshold(qa_tokenizer):
    ex = _long_example(qa_tokenizer)
    feats = prepare_features([ex], qa_tokenizer, max_seq_len=320, doc_stride=32, max_query_len=16)
    k = next(k for k, o in enumerate(feats[1]["offsets"]) if o is not None and o[0] == ex.answers[0]["answer_start"])
    starts, ends = _peak_logits(feats, {1: (k, k, 3.0)})
    for s, e in zip(starts, ends, strict=True):  # null (CLS) score 2 * 2.5 = 5 in every window vs best span 6
        s[0] = e[0] = 2.5
    common = dict(n_best=5, max_answer_len=10, version_2=True)
    preds, odds = decode_predictions([ex], feats, starts, ends, **common)
    assert preds["long"] == "nonlocal" and odds["long"] == pytest.approx(5.0 - (6.0 + starts[1][k] - 3.0 + ends[1][k] - 3.0), abs=1e-6)
    starts[0][0] += 2.0  # one window's null score rises; the minimum over windows is what counts
    assert decode_predictions([ex], feats, starts, ends, **common)[0]["long"] == "nonlocal"
    for s in starts:
        s[0] += 1.0  # now null 6 + ... > span: predict no answer
    assert decode_predictions([ex], feats, starts, ends, **common)[0]["long"] == ""
    preds, _ = decode_predictions([ex], feats, starts, ends, null_score_threshold=2.0, **common)
    assert preds["long"] == "nonlocal"
    assert decode_predictions([ex], feats, starts, ends, n_best=5, max_answer_len=10)[0]["long"] == "nonlocal"  # v1.1


def test_v2_best_exact_and_f1_sweep_the_null_threshold_as_the_official_script():
    ctx = "The parser reads tokens from the input stream and builds a tree."
    ex = [QAExample("q1", "What reads tokens?", ctx, [{"text": "The parser", "answer_start": 0}], False, "q1"),
          QAExample("q2", "What is built?", ctx, [{"text": "a tree", "answer_start": ctx.index("a tree")}], False, "q2"),
          QAExample("q3", "Who wrote it?", ctx, [], True, "q3"),
          QAExample("q4", "When?", ctx, [], True, "q4")]
    preds = {"q1": "the parser", "q2": "input stream", "q3": "tokens", "q4": ""}
    odds = {"q1": -1.0, "q2": 2.0, "q3": 0.5, "q4": 3.0}
    m = squad_metrics(ex, preds, version_2=True, null_odds=odds)
    # all "" scores 2/4; answering q1 (odds -1) adds 1 -> 3/4, the best; q3 would then cost 1, q2 adds 0
    assert m["exact_match"] == 50.0 and m["best_exact"] == 75.0 and m["best_exact_thresh"] == -1.0
    # F1: q2 "input stream" vs "a tree" has no token in common; the best is the same sweep
    assert m["best_f1"] == 75.0 and m["best_f1_thresh"] == -1.0
    preds["q2"] = "builds a tree"  # F1 2/3 (normalized "builds tree" vs "tree"), EM 0
    m = squad_metrics(ex, preds, version_2=True, null_odds={**odds, "q2": 0.2, "q3": 2.5})
    # odds order q1 (+1), q2 (+2/3 F1, +0 EM), q3 (-1), q4 (0): F1 peaks at q2's odds, EM at q1's
    assert m["best_f1"] == pytest.approx(100 * (2 + 1 + 2 / 3) / 4) and m["best_f1_thresh"] == 0.2
    assert m["best_exact"] == 75.0 and m["best_exact_thresh"] == -1.0
    assert "best_f1" not in squad_metrics(ex, preds, version_2=True)  # no null odds, nothing to sweep


def test_qa_step_flops_count_real_window_lengths_not_max_positions_and_mlm_head(qa_tokenizer):
    """MFU over 100 % (#20): QA counted every sample at max_position_embeddings with a dense MLM head."""
    from models.bert import BertConfig
    from models.flops import block_matmul_params, training_flops_per_sample
    from pipelines.finetune.qa import QATask, collate_qa

    cfg = BertConfig(vocab_size=30522, hidden_size=384, num_layers=6, num_heads=12, intermediate_size=1536)
    ex = _long_example(qa_tokenizer)
    feats = prepare_features([ex], qa_tokenizer, max_seq_len=64, doc_stride=16, max_query_len=16, labels=True)
    batch = collate_qa([{**f, "valid": True} for f in feats], qa_tokenizer.pad_token_id)
    lengths = [len(f["input_ids"]) for f in feats]
    n, d = block_matmul_params(cfg), cfg.hidden_size
    by_hand = sum(6 * n * L + 12 * cfg.num_layers * d * L * L + 6 * d * 2 * L for L in lengths)
    got = QATask(qa_tokenizer.pad_token_id).batch_flops(batch, cfg)
    assert got == pytest.approx(by_hand)
    assert got < len(feats) * training_flops_per_sample(cfg) / 4  # the old count: 512 positions + a 30k-word head


def test_dev_metrics_split_answer_windows_from_null_windows():
    """A run stuck on [CLS] answers every window at [CLS]: its overall window accuracy is the share of
    null windows, which can beat a run that finds answers; `answer_accuracy` (windows that hold the
    answer) and `null_accuracy` (windows labelled at [CLS]) tell the two apart (issue #31)."""
    import torch

    from pipelines.finetune.qa import QATask

    task = QATask(pad_id=0)
    starts, ends = torch.tensor([0, 0, 0, 3, 5, 0]), torch.tensor([0, 0, 0, 4, 6, 0])  # 3 null windows, 2 with answers, a filler
    batch = {"start_positions": starts, "end_positions": ends,
             "valid": torch.tensor([True, True, True, True, True, False])}  # the last one is an eval filler

    def metrics(start_pred, end_pred):
        logits = [torch.nn.functional.one_hot(torch.tensor(p), 8).float() for p in (start_pred, end_pred)]
        out = {"start_logits": logits[0], "end_logits": logits[1], "per_item_loss": torch.zeros(6)}
        return task.eval_metrics(task.eval_sums(out, batch))

    stuck = metrics([0] * 6, [0] * 6)
    reads = metrics([0, 2, 2, 3, 5, 0], [0, 2, 2, 4, 6, 0])
    assert stuck["null_share"] == pytest.approx(0.6) and stuck["accuracy"] == pytest.approx(0.6)
    assert (stuck["answer_accuracy"], stuck["null_accuracy"]) == (0.0, 1.0)
    assert reads["accuracy"] == pytest.approx(0.6)  # the same overall accuracy ...
    assert reads["answer_accuracy"] == 1.0 and reads["null_accuracy"] == pytest.approx(1 / 3)  # ... not the same run
