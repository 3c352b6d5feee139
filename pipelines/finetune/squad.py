"""Extractive question answering data: SQuAD JSON → windows → spans → predictions → EM/F1.

- `read_squad` reads SQuAD v1.1 / v2.0 JSON (``data → paragraphs → qas → answers``); bad questions
  (answer_start not matching the context, missing fields, wrong shapes) are counted with the file
  and question id and skipped; more than ``max_bad_share`` of them fails the run (then the file,
  or qa.version_2, is probably wrong).
- `prepare_features` tokenizes (question, context) pairs into windows of ``max_seq_len`` tokens
  overlapping by ``doc_stride`` tokens (BERT §4.2/4.3: long contexts are read with a sliding
  window) and keeps each context token's character offsets so a token span maps back to text.
- `decode_predictions` picks the best span over all windows from the n-best start/end logits,
  with a maximum answer length and, for v2, the null answer (BERT §4.3: predict "" when
  s_null - best non-null span score > threshold, s_null = start[CLS] + end[CLS]).
- `squad_metrics` is the official evaluation: normalized exact match and token F1, max over the
  gold answers, in percent; v2 scores an unanswerable question against the empty string.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.files import atomic_write_text
from pipelines.finetune.data import FinetuneError, ReadReport, over_the_limit, require_file

__all__ = [
    "QAExample", "read_squad", "check_bad_share", "prepare_features", "decode_predictions",
    "normalize_answer", "exact_match_score", "f1_score", "squad_metrics", "gold_answers", "write_squad",
]


@dataclass
class QAExample:
    qid: str
    question: str
    context: str
    answers: list[dict[str, Any]]  # [{"text", "answer_start"}], checked against the context; [] if unanswerable
    is_impossible: bool
    where: str  # "FILE question id QID", for messages


# --------------------------------------------------------------------------------------------- reading
def read_squad(path: str | Path, *, version_2: bool = False, max_bad_share: float = 0.01) -> tuple[list[QAExample], ReadReport]:
    """Questions of a SQuAD-format file, the bad ones counted in the report (see module docstring)."""
    path = Path(path)
    require_file(path, "QA data file")
    try:
        doc = json.loads(path.read_text(encoding="utf-8-sig"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FinetuneError(f"{path}: not a valid JSON file ({exc}). QA data must be SQuAD JSON "
                            f"({{\"data\": [{{\"paragraphs\": [{{\"context\", \"qas\"}}]}}]}}).") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise FinetuneError(f"{path}: wrong JSON shape: expected an object with a \"data\" list of articles (SQuAD "
                            f"format: data → paragraphs → qas → answers). A .jsonl file belongs to classification.")
    report = ReadReport(str(path))
    examples: list[QAExample] = []
    seen: set[str] = set()
    for ai, article in enumerate(doc["data"]):
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            report.total += 1
            report.add_bad("article without a paragraphs list", f"{path} data[{ai}]")
            continue
        for pi, para in enumerate(paragraphs):
            qas = para.get("qas") if isinstance(para, dict) else None
            context = para.get("context") if isinstance(para, dict) else None
            if not isinstance(qas, list) or not isinstance(context, str):
                report.total += max(1, len(qas) if isinstance(qas, list) else 1)
                report.add_bad("paragraph without context or qas", f"{path} data[{ai}].paragraphs[{pi}]")
                continue
            for qi, qa in enumerate(qas):
                report.total += 1
                ex = _read_question(qa, context, version_2, path, f"data[{ai}].paragraphs[{pi}].qas[{qi}]", report, seen)
                if ex is not None:
                    examples.append(ex)
    check_bad_share(report, max_bad_share, hint="fix the file, or set qa.version_2 to match it")
    if not examples:
        raise FinetuneError(f"{path}: no usable question. Check that it is SQuAD JSON and qa.version_2 matches it.")
    return examples, report


def _read_question(qa: Any, context: str, version_2: bool, path: Path, at: str, report: ReadReport,
                   seen: set[str]) -> QAExample | None:
    if not isinstance(qa, dict) or not isinstance(qa.get("id"), (str, int)) or not isinstance(qa.get("question"), str):
        report.add_bad("missing field", f"{path} {at} (no id or question)")
        return None
    qid = str(qa["id"])
    where = f"{path} question id {qid}"
    if qid in seen:
        report.add_bad("duplicate question id", where)
        return None
    seen.add(qid)
    if not qa["question"].strip() or not context.strip():
        report.add_bad("empty question or context", where)
        return None
    impossible = bool(qa.get("is_impossible", False))
    if impossible and not version_2:
        report.add_bad("unanswerable question in a v1.1 run (qa.version_2=false)", where)
        return None
    answers = qa.get("answers", [] if impossible else None)
    if not isinstance(answers, list):
        report.add_bad("missing field", f"{where} (no answers list)")
        return None
    checked = []
    if not impossible:
        if not answers:
            report.add_bad("answerable question without answers", where)
            return None
        for a in answers:
            if not isinstance(a, dict) or not isinstance(a.get("text"), str) or not isinstance(a.get("answer_start"), int):
                report.add_bad("missing field", f"{where} (an answer lacks text or an integer answer_start)")
                return None
            start, text = a["answer_start"], a["text"]
            if not text.strip() or start < 0 or context[start: start + len(text)] != text:
                report.add_bad("answer_start does not match the context", f"{where} (answer {text!r} at {start})")
                return None
            checked.append({"text": text, "answer_start": start})
    return QAExample(qid, qa["question"].strip(), context, checked, impossible, where)


def check_bad_share(report: ReadReport, max_bad_share: float, *, hint: str) -> None:
    if report.bad_share > max_bad_share:
        raise FinetuneError(f"{report.summary()}. That is {over_the_limit(report.bad_share, max_bad_share)} of the "
                            f"questions, over the limit of "
                            f"{max_bad_share:.1%} (data.max_bad_share): {hint}.")


def write_squad(path: str | Path, examples: list[QAExample], *, version_2: bool = False, title: str = "qa") -> Path:
    """Examples → a SQuAD-format JSON file (one paragraph per distinct context, in order)."""
    paragraphs: dict[str, list[dict[str, Any]]] = {}
    for ex in examples:
        qa: dict[str, Any] = {"id": ex.qid, "question": ex.question, "answers": ex.answers}
        if version_2:
            qa["is_impossible"] = ex.is_impossible
        paragraphs.setdefault(ex.context, []).append(qa)
    doc = {"version": "v2.0" if version_2 else "1.1",
           "data": [{"title": title, "paragraphs": [{"context": c, "qas": q} for c, q in paragraphs.items()]}]}
    path = Path(path)
    atomic_write_text(path, json.dumps(doc, ensure_ascii=False))
    return path


# ------------------------------------------------------------------------------------------- features
def _truncate_question(tokenizer: Any, question: str, max_query_len: int) -> str:
    """Cut the question after ``max_query_len`` tokens (by character offset, so the text stays intact)."""
    enc = tokenizer(question, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    return question if len(offsets) <= max_query_len else question[: offsets[max_query_len - 1][1]]


def prepare_features(examples: list[QAExample], tokenizer: Any, *, max_seq_len: int, doc_stride: int,
                     max_query_len: int = 64, labels: bool = False, version_2: bool = False,
                     report: ReadReport | None = None) -> list[dict[str, Any]]:
    """Windows `[CLS] question [SEP] context-slice [SEP]` with char offsets for context tokens (None elsewhere).

    With ``labels``: every window gets token ``start_position``/``end_position``. A window that does
    not hold the whole answer is labelled null ([CLS], index 0), for v1.1 as for v2 (BERT's SQuAD
    recipe, transformers' `run_qa`): the model learns "not in this window", which is what lets the
    decoder compare span scores across the windows of a long context. (Dropping those windows for
    v1.1 left the model never seeing a window without the answer; its spans in such windows then
    outscored the right one, and it trained on fewer windows: F1 far below transformers' Trainer.)
    An answerable question whose answer lies in no window (an answer longer than a window) is
    counted in ``report`` and contributes no window.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise FinetuneError("QA fine-tuning needs a fast tokenizer (tokenizer.json) for offset mappings; "
                            "the release directory has only a slow one.")
    if not examples:
        return []
    questions = [_truncate_question(tokenizer, ex.question, max_query_len) for ex in examples]
    longest_q = max(len(tokenizer(q, add_special_tokens=False)["input_ids"]) for q in questions)
    room = max_seq_len - longest_q - 3  # [CLS] q [SEP] c [SEP]
    if room <= doc_stride:
        raise FinetuneError(
            f"{examples[0].where}: data.max_seq_len={max_seq_len} leaves {room} context tokens per window after a "
            f"{longest_q}-token question, not more than qa.doc_stride={doc_stride}; raise data.max_seq_len or lower "
            f"qa.doc_stride / qa.max_query_len.")
    enc = tokenizer(questions, [ex.context for ex in examples], truncation="only_second", max_length=max_seq_len,
                    stride=doc_stride, return_overflowing_tokens=True, return_offsets_mapping=True,
                    return_token_type_ids=True, padding=False)
    features: list[dict[str, Any]] = []
    found = np.zeros(len(examples), dtype=bool)
    for i, example_index in enumerate(enc["overflow_to_sample_mapping"]):
        seq_ids = enc.sequence_ids(i)
        offsets = [tuple(o) if s == 1 else None for o, s in zip(enc["offset_mapping"][i], seq_ids, strict=True)]
        feat = {"input_ids": enc["input_ids"][i], "token_type_ids": enc["token_type_ids"][i],
                "offsets": offsets, "example_index": int(example_index)}
        if labels:
            ex = examples[example_index]
            span = None if ex.is_impossible else _token_span(offsets, ex.answers[0])
            found[example_index] |= span is not None or ex.is_impossible
            feat["start_position"], feat["end_position"] = span or (0, 0)
        features.append(feat)
    if labels:
        features = [f for f in features if found[f["example_index"]]]  # no window holds the answer: bad, skipped
        for k in np.flatnonzero(~found) if report is not None else ():
            report.add_bad("answer lies in no window (longer than max_seq_len allows)", examples[k].where)
    return features


def _token_span(offsets: list[tuple[int, int] | None], answer: dict[str, Any]) -> tuple[int, int] | None:
    """First/last token of the answer's characters, or None when the window does not cover all of them."""
    a0 = answer["answer_start"]
    a1 = a0 + len(answer["text"])
    ctx = [k for k, o in enumerate(offsets) if o is not None]
    if not ctx or offsets[ctx[0]][0] > a0 or offsets[ctx[-1]][1] < a1:
        return None
    start = next(k for k in ctx if offsets[k][1] > a0)
    end = next(k for k in reversed(ctx) if offsets[k][0] < a1)
    return start, end


# ------------------------------------------------------------------------------------------- decoding
def decode_predictions(examples: list[QAExample], features: list[dict[str, Any]], start_logits: list[np.ndarray],
                       end_logits: list[np.ndarray], *, n_best: int = 20, max_answer_len: int = 30,
                       version_2: bool = False, null_score_threshold: float = 0.0) -> tuple[dict[str, str], dict[str, float]]:
    """({question id: answer text}, {question id: null score - best span score}) over all windows.

    Per window the ``n_best`` highest start and end logits are paired; a pair counts when both
    tokens are context tokens, start <= end and the span has at most ``max_answer_len`` tokens;
    its score is start + end logit and its text is the context slice between their offsets.
    """
    by_example: dict[int, list[int]] = {}
    for f, feat in enumerate(features):
        by_example.setdefault(feat["example_index"], []).append(f)
    predictions: dict[str, str] = {}
    null_odds: dict[str, float] = {}
    for e, ex in enumerate(examples):
        best_score, best_text, null_score = -np.inf, "", np.inf
        for f in by_example.get(e, []):
            offsets = features[f]["offsets"]
            s_log = np.asarray(start_logits[f], dtype=np.float64)[: len(offsets)]
            e_log = np.asarray(end_logits[f], dtype=np.float64)[: len(offsets)]
            null_score = min(null_score, s_log[0] + e_log[0])
            for s in np.argsort(-s_log)[:n_best]:
                for t in np.argsort(-e_log)[:n_best]:
                    if offsets[s] is None or offsets[t] is None or t < s or t - s + 1 > max_answer_len:
                        continue
                    score = s_log[s] + e_log[t]
                    if score > best_score:
                        best_score, best_text = score, ex.context[offsets[s][0]: offsets[t][1]]
        null_odds[ex.qid] = float(null_score - best_score) if np.isfinite(best_score) else float("inf")
        if version_2 and null_odds[ex.qid] > null_score_threshold:
            best_text = ""
        predictions[ex.qid] = best_text
    return predictions, null_odds


# -------------------------------------------------------------------------------------------- metrics
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """The official SQuAD normalization: lower-case, drop punctuation, drop a/an/the, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match_score(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
    """Token F1 after normalization; if either side is empty it is 1 iff both are (v2 script rule)."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def gold_answers(example: QAExample) -> list[str]:
    """Gold texts as the official v2 script keeps them: non-empty after normalization, else [""] (no answer)."""
    texts = [a["text"] for a in example.answers if normalize_answer(a["text"])]
    return texts or [""]


def squad_metrics(examples: list[QAExample], predictions: dict[str, str], *, version_2: bool = False,
                  null_odds: dict[str, float] | None = None) -> dict[str, float]:
    """exact_match / f1 in percent, max over gold answers; a missing prediction scores 0.

    For v2 (or when any question is unanswerable) also ``HasAns_*`` / ``NoAns_*`` over the two subsets,
    and with ``null_odds`` ({question id: null score - best span score}, higher = more likely no
    answer, the official script's "na_prob") ``best_exact`` / ``best_f1`` with their thresholds:
    the score had every question whose null odds exceed the threshold been answered "".
    """
    em: dict[str, float] = {}
    f1: dict[str, float] = {}
    for ex in examples:
        if ex.qid not in predictions:
            em[ex.qid] = f1[ex.qid] = 0.0
            continue
        golds, pred = gold_answers(ex), predictions[ex.qid]
        em[ex.qid] = max(exact_match_score(pred, g) for g in golds)
        f1[ex.qid] = max(f1_score(pred, g) for g in golds)

    def summary(ids: list[str], prefix: str = "") -> dict[str, float]:
        n = len(ids)
        return {f"{prefix}exact_match": 100.0 * sum(em[i] for i in ids) / max(n, 1),
                f"{prefix}f1": 100.0 * sum(f1[i] for i in ids) / max(n, 1), f"{prefix}total": float(n)}

    out = summary([ex.qid for ex in examples])
    if version_2 or any(ex.is_impossible for ex in examples):
        out.update(summary([ex.qid for ex in examples if not ex.is_impossible], "HasAns_"))
        out.update(summary([ex.qid for ex in examples if ex.is_impossible], "NoAns_"))
        if null_odds is not None:
            for name, raw in (("exact", em), ("f1", f1)):
                out[f"best_{name}"], out[f"best_{name}_thresh"] = _best_threshold(examples, predictions, raw, null_odds)
    return out


def _best_threshold(examples: list[QAExample], predictions: dict[str, str], raw: dict[str, float],
                    null_odds: dict[str, float]) -> tuple[float, float]:
    """The official v2 script's ``find_best_thresh``: sweep the threshold over the sorted null odds.

    Starting from "every question answered \"\"" (score = number of unanswerable questions), each
    question in order of rising null odds switches to its prediction: + its score if answerable,
    - 1 if unanswerable and the prediction is not empty.
    """
    has_ans = {ex.qid: not ex.is_impossible for ex in examples}
    score = best = float(sum(not v for v in has_ans.values()))
    thresh = 0.0
    for qid in sorted(null_odds, key=lambda q: null_odds[q]):
        if qid not in raw:
            continue
        score += raw[qid] if has_ans[qid] else (-1.0 if predictions.get(qid) else 0.0)
        if score > best:
            best, thresh = score, null_odds[qid]
    return 100.0 * best / max(len(raw), 1), float(thresh)
