"""Sentence segmentation and next-sentence-prediction pairs, following the BERT recipe.

Devlin et al. 2019 (BERT, Sec. 3.1 and App. A.2; `create_pretraining_data.py` of the original
release): per document, fill a chunk of consecutive sentences up to a target length of
max_seq_len - 3 (with probability 0.1 a random shorter target, so the model also sees short
inputs), split it at a random sentence boundary into A and B; with probability 0.5 replace B by
a span starting at a random sentence of another document (NotNext) and give the unused
sentences back; truncate the longer side at a random end until the pair fits. Masking is *not*
done here: the loader masks dynamically (RoBERTa-style), so every epoch sees fresh masks.

One deliberate difference: the original forces NotNext whenever a chunk holds one sentence,
which skews the classes on corpora of short documents. We draw the label first and, for IsNext
with a one-sentence chunk, take the next sentence as B (or split a lone sentence at a random
token), so the NSP classes stay at 50 %.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from itertools import chain

import numpy as np

__all__ = ["split_sentences", "create_pairs", "Pair"]

# End of sentence: . ! ? (optionally followed by closing quotes/brackets) then whitespace and an
# upper-case letter, digit or opening quote; or a blank line / a line break before a list item.
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])|\n\s*\n|\n(?=\s*(?:[-*+•]|\d+[.)])\s)")
_ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "Mr.", "Mrs.", "Dr.", "cf.", "Fig.", "No.")


def split_sentences(text: str) -> list[str]:
    """A light rule-based sentence splitter (no model, no download), good enough for NSP."""
    out: list[str] = []
    start = 0
    for m in _SENTENCE_END.finditer(text):
        piece = text[start : m.start() + len(m.group(0)) - len(m.group(0).lstrip("\"')]"))]
        if piece.rstrip().endswith(_ABBREVIATIONS):
            continue  # "e.g. Foo" is not a sentence boundary
        if piece.strip():
            out.append(piece.strip())
        start = m.end()
    tail = text[start:].strip()
    if tail:
        out.append(tail)
    return out


Pair = tuple[np.ndarray, int, int, int]  # (input_ids, len_a, len_b, next_sentence_label)


def _truncate_pair(a: list[int], b: list[int], max_tokens: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """Trim the longer segment, from the front or the back at random, until the pair fits.

    One random draw per removed token (as in the original); the trimming itself is index
    arithmetic and two slices.
    """
    a_lo, a_hi, b_lo, b_hi = 0, len(a), 0, len(b)
    while (a_hi - a_lo) + (b_hi - b_lo) > max_tokens:
        if a_hi - a_lo > b_hi - b_lo:
            if rng.random() < 0.5:
                a_lo += 1
            else:
                a_hi -= 1
        elif rng.random() < 0.5:
            b_lo += 1
        else:
            b_hi -= 1
    return a[a_lo:a_hi], b[b_lo:b_hi]


def _flat(sentences) -> list[int]:
    """Token ids of consecutive sentences (numpy arrays or lists) as one Python list."""
    return list(chain.from_iterable(s.tolist() if isinstance(s, np.ndarray) else s for s in sentences))


def _random_span(docs: list[list[np.ndarray]], doc_index: int, target: int, rng: random.Random) -> list[int] | None:
    other = doc_index
    for _ in range(10):  # as in the original: a few tries to draw a different (non-empty) document
        other = rng.randrange(len(docs))
        if other != doc_index and any(len(s) for s in docs[other]):
            break
    else:
        return None
    sentences = [s for s in docs[other] if len(s)]
    span: list[int] = []
    for sent in sentences[rng.randrange(len(sentences)) :]:
        span.extend(sent.tolist() if isinstance(sent, np.ndarray) else sent)
        if len(span) >= target:
            break
    return span


def create_pairs(
    docs: list[list[np.ndarray]],
    doc_index: int,
    *,
    max_seq_len: int,
    cls_id: int,
    sep_id: int,
    rng: random.Random,
    short_seq_prob: float = 0.1,
    random_next_prob: float = 0.5,
    dtype: np.dtype | str = np.int64,
) -> Iterator[Pair]:
    """NSP pairs of one document (`docs[doc_index]` = its sentences as token-id arrays or lists).

    `input_ids` come out as arrays of `dtype` (the shard writer passes the shard's token dtype).
    """
    doc = [s for s in docs[doc_index] if len(s)]
    max_tokens = max_seq_len - 3  # room for [CLS] A [SEP] B [SEP]
    target = max_tokens
    if rng.random() < short_seq_prob:
        target = rng.randint(2, max_tokens)
    chunk: list[np.ndarray] = []
    length = 0
    i = 0
    while i < len(doc):
        chunk.append(doc[i])
        length += len(doc[i])
        if i == len(doc) - 1 or length >= target:
            is_random = rng.random() < random_next_prob
            if not is_random and len(chunk) == 1 and i + 1 < len(doc):
                i += 1  # IsNext needs a continuation: take the next sentence as B
                chunk.append(doc[i])
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            a = _flat(chunk[:a_end])
            b: list[int] | None
            if is_random:
                b = _random_span(docs, doc_index, max(1, target - len(a)), rng)
                if b is None:  # a one-document shard: fall back to the real continuation
                    is_random = False
                else:
                    i -= len(chunk) - a_end  # unused sentences go back to the document
            if not is_random:
                b = _flat(chunk[a_end:])
                if not b and len(a) >= 2:  # a lone sentence: split it at a random token
                    cut = rng.randint(1, len(a) - 1)
                    a, b = a[:cut], a[cut:]
            if a and b:
                a, b = _truncate_pair(a, b, max_tokens, rng)
                ids = np.array([cls_id, *a, sep_id, *b, sep_id], dtype=dtype)
                yield ids, len(a), len(b), int(is_random)
            chunk, length = [], 0
        i += 1
