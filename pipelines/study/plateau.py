"""The unigram plateau of a corpus: the loss a model that ignores context reaches (the warmup map's
reference line: a run has made progress past "predict the token frequencies" only below it)."""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["unigram_plateau"]


def unigram_plateau(corpus: str | Path) -> float | None:
    """The loss of a model that ignores context: cross-entropy (nats) of the validation split's targets
    under the training split's token frequencies (add-1/2). Causal LM (``packed_lm``): every next token;
    MLM + NSP (``bert_pairs``): the non-special tokens, plus ln 2 for NSP at chance. None when the corpus
    is not there or of another kind. A run whose final loss is below it has left the plateau."""
    import tarfile

    import numpy as np

    from core.corpus import iter_tar_samples, load_manifest
    from core.records import npy_array

    try:
        m = load_manifest(corpus, check_tokenizer=False)
    except Exception:  # noqa: BLE001 - a moved or foreign corpus only loses the reference line
        return None
    if m.kind not in ("packed_lm", "bert_pairs") or not m.vocab_size or "validation" not in m.splits:
        return None
    counts = {split: np.zeros(m.vocab_size, dtype=np.int64) for split in ("train", "validation")}
    for split, cnt in counts.items():
        for shard in m.shards(split):
            with tarfile.open(m.url(shard), mode="r:") as tar:
                for _key, parts in iter_tar_samples(tar):
                    data = (parts or {}).get("input_ids.npy")
                    if data is None:
                        continue
                    ids = npy_array(data)
                    ids = ids[:, 1:] if m.kind == "packed_lm" and ids.ndim == 2 else ids
                    cnt += np.bincount(ids.ravel().astype(np.int64), minlength=m.vocab_size)[: m.vocab_size]
    if m.kind == "bert_pairs":
        for split in counts.values():
            split[[t for t in m.special_tokens.values() if 0 <= t < m.vocab_size]] = 0
    train, val = counts["train"], counts["validation"]
    if not val.sum():
        return None
    p = (train + 0.5) / (train.sum() + 0.5 * m.vocab_size)
    loss = float(-(val * np.log(p)).sum() / val.sum())
    return loss + (math.log(2) if m.kind == "bert_pairs" else 0.0)
