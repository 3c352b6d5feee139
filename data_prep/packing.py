"""GPT-style packing: documents joined by the end-of-text token, cut into fixed windows.

As in GPT-2 / Megatron-LM: no padding and no per-document truncation. Each window holds
`seq_len + 1` tokens (inputs = window[:-1], targets = window[1:]); consecutive windows overlap
by one token so every token of the stream is a prediction target exactly once. Only the tail of
a shard's stream shorter than a window is dropped; `kept` reports the share of tokens used.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

__all__ = ["pack_windows"]


def pack_windows(docs: list[np.ndarray], eos_id: int, seq_len: int) -> tuple[Iterator[tuple[int, np.ndarray]], dict[str, int]]:
    """Windows of `docs` (token arrays, in order) and a dict filled with `total`/`kept` tokens.

    Yields `(doc_index, window)` where `doc_index` is the document the window starts in (for a
    stable sample key). The counters are final once the iterator is exhausted.
    """
    counts = {"total": 0, "kept": 0}

    def windows() -> Iterator[tuple[int, np.ndarray]]:
        lengths = np.array([len(d) + 1 for d in docs], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        stream = np.empty(int(starts[-1]), dtype=docs[0].dtype if docs else np.uint32)
        for k, d in enumerate(docs):
            stream[starts[k] : starts[k + 1] - 1] = d
            stream[starts[k + 1] - 1] = eos_id
        counts["total"] = len(stream)
        n = (len(stream) - 1) // seq_len if len(stream) > seq_len else 0
        counts["kept"] = n * seq_len + (1 if n else 0)
        begins = np.arange(n, dtype=np.int64) * seq_len
        doc_index = (np.searchsorted(starts, begins, side="right") - 1).tolist()  # one call for all windows
        for w, begin in enumerate(begins.tolist()):
            yield doc_index[w], stream[begin : begin + seq_len + 1]

    return windows(), counts
