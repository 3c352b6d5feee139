"""Weighted mixtures of corpora (``data.corpora``): a deterministic, sample-level interleave.

Slot ``q`` of a rank's sample sequence takes the next sample of the corpus furthest behind its share,

    i*(q) = argmax_i  w_i (q + 1) - n_i(q)        (ties: the lowest i)

where ``n_i(q)`` counts the slots given to corpus ``i`` before ``q`` — the rule of Megatron-LM's
``build_blending_indices``. At every ``q`` each corpus is within one sample of ``w_i q``, so a mixture
is exact at any scale and any micro-batch (a batch of 32 at weights 0.3 / 0.7 holds 9-10 / 22-23).

Each corpus is read by its own ``StreamingSource`` (its own epochs, shuffle and loader workers):
a small corpus is repeated as often as its weight asks, a big one is read only as far as the run
goes. Those sources hand over plain samples in micro-batch lots; the blend fills each batch slot by
slot and collates it here, each sample keeping its own corpus epoch for the task's per-sample
randomness. The position is one integer per corpus, ``n_i``: on resume corpus ``i``'s source seeks
to its batch ``n_i // mb`` and drops the first ``n_i % mb`` samples of it, so a resumed run goes on
with the very next sample of every corpus.

Changing the weights of a run between a checkpoint and its resume is allowed (a curriculum): the
counts then restart their comparison from the resume point (``origin``), so the new mixture holds
from there on, without a burst that pays back the old one.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from core.corpus import DataError, Manifest

log = logging.getLogger(__name__)

__all__ = ["BlendedSource", "blend_schedule", "check_blendable", "tag_samples"]


def tag_samples(samples: list[dict[str, Any]], *, epoch: int, train: bool) -> list[dict[str, Any]]:
    """The collate of a blended corpus's own source: plain samples, each marked with its epoch
    (module level: loader workers pickle it)."""
    return [{**s, "epoch": epoch} for s in samples]


def blend_schedule(weights: list[float], counts: list[int], slots: int) -> list[int]:
    """The corpus of each of the next ``slots`` slots, from per-corpus counts ``counts`` (updated in place)."""
    out = []
    q = sum(counts)
    for _ in range(slots):
        q += 1
        best = max(range(len(weights)), key=lambda i: (weights[i] * q - counts[i], -i))
        counts[best] += 1
        out.append(best)
    return out


def check_blendable(manifests: list[Manifest], names: list[str]) -> None:
    """Refuse corpora that cannot share a model: another kind, sequence length, token type, tokenizer or class map."""
    first = manifests[0]
    for m, name in zip(manifests[1:], names[1:], strict=True):
        for what, a, b in (
            ("kind", first.kind, m.kind),
            ("sequence length", first.seq_len, m.seq_len),
            ("token dtype", first.token_dtype, m.token_dtype),
            ("tokenizer (sha256 of tokenizer.json)", (first.raw.get("tokenizer") or {}).get("sha256"),
             (m.raw.get("tokenizer") or {}).get("sha256")),
            ("class map", first.class_map, m.class_map),
        ):
            if a != b:
                raise DataError(
                    f"data.corpora: corpus {name!r} ({m.path}) has another {what} than corpus {names[0]!r} "
                    f"({first.path}): {b!r} vs {a!r}. A mixture needs corpora prepared alike: re-run `pretrain prepare` "
                    f"for {m.root} with tokenizer.path={first.tokenizer_dir} and the same kind and seq_len."
                )


@dataclass
class _Corpus:
    name: str
    weight: float
    source: Any  # a StreamingSource whose collate is ``tag_samples``
    consumed: int = 0  # n_i: samples of this corpus handed to batches on this rank
    origin: int = 0  # n_i when the current weights took effect
    buffer: deque = field(default_factory=deque)
    stream: Iterator[list[dict[str, Any]]] | None = None
    skip: int = 0  # samples of the next fetched lot already consumed before a resume


class BlendedSource:
    """Batches that interleave several corpora by weight; the trainer's data source for ``data.corpora``.

    The same interface as ``StreamingSource`` (``batches``, ``state_dict``, ``load_state_dict``,
    ``rewind``, ``batches_per_epoch``). ``sources``: ``(name, weight, source)``, each source built with
    ``collate=tag_samples``; ``collate`` is the task's.
    """

    def __init__(self, sources: list[tuple[str, float, Any]], collate: Callable[..., dict[str, Any]], *,
                 micro_batch_size: int, train: bool = True):
        total = sum(w for _, w, _ in sources)
        if not sources or total <= 0 or any(w <= 0 for _, w, _ in sources):
            raise DataError("data.corpora needs at least one corpus and every weight > 0 (they are normalised to sum to 1).")
        if len({n for n, _, _ in sources}) != len(sources):
            raise DataError(f"data.corpora: names must differ, got {[n for n, _, _ in sources]}. Set `name:` on each entry.")
        self.corpora = [_Corpus(n, w / total, s) for n, w, s in sources]
        self.collate, self.mb, self.train = collate, micro_batch_size, train
        # blended batches before the corpus that runs out first (relative to its weight) ends its first epoch
        self.batches_per_epoch = max(1, int(min(c.source.batches_per_epoch * c.source.mb / c.weight for c in self.corpora)) // self.mb)
        self.samples_seen = 0

    # ------------------------------------------------------------------------------------- reading
    def _weights_and_counts(self) -> tuple[list[float], list[int]]:
        return [c.weight for c in self.corpora], [c.consumed - c.origin for c in self.corpora]

    def batches(self, limit: int | None = None) -> Iterator[dict[str, Any]]:
        """Blended batches from the current position; each corpus advances by the samples it gave."""
        if limit is None:  # training: one endless stream per corpus, kept across calls
            for c in self.corpora:
                c.stream = c.stream or c.source.batches()
        else:  # evaluation reads a fixed count: each corpus reads no further than the blend will take
            weights, counts = self._weights_and_counts()
            picks = blend_schedule(weights, counts, limit * self.mb)
            for i, c in enumerate(self.corpora):
                missing = max(0, picks.count(i) - len(c.buffer))
                lots = -(-(missing + c.skip) // c.source.mb) if missing else 0
                c.stream = c.source.batches(limit=lots) if lots else iter(())
        produced = 0
        try:
            while limit is None or produced < limit:
                weights, counts = self._weights_and_counts()
                samples = [self._take(self.corpora[i]) for i in blend_schedule(weights, counts, self.mb)]
                produced += 1
                self.samples_seen += self.mb
                yield self.collate(samples, epoch=0, train=self.train)
        finally:  # stop the corpora's loader workers now (they would block interpreter exit) and keep the position
            for c in self.corpora:
                if c.stream is not None:
                    c.stream.close()
                self._seek(c)

    def _take(self, c: _Corpus) -> dict[str, Any]:
        while not c.buffer:
            lot = next(c.stream)
            c.buffer.extend(lot[c.skip:])
            c.skip = 0
        c.consumed += 1
        s = c.buffer.popleft()
        return {**s, "key": f"{c.name}/{s['key']}"}

    # ------------------------------------------------------------------------------------ position
    def _seek(self, c: _Corpus) -> None:
        """Position corpus ``c``'s source at its sample ``c.consumed`` (batch granularity plus a skip)."""
        src = c.source
        lots, c.skip = divmod(c.consumed, src.mb)
        src.epoch, src.batch_in_epoch = divmod(lots, src.batches_per_epoch)
        src.samples_seen = lots * src.mb
        c.buffer.clear()
        c.stream = None

    def rewind(self) -> None:
        """Back to the start (evaluation reads the same batches every time)."""
        for c in self.corpora:
            c.consumed = c.origin = 0
            self._seek(c)
        self.samples_seen = 0

    def state_dict(self) -> dict[str, Any]:
        per = {c.name: c.consumed for c in self.corpora}
        epochs = {c.name: c.consumed / max(1, c.source.batches_per_epoch * c.source.mb) for c in self.corpora}
        return {
            "blend": [{"name": c.name, "weight": c.weight, "consumed": c.consumed, "origin": c.origin} for c in self.corpora],
            "samples_seen": self.samples_seen, "consumed": per, "corpus_epochs": epochs,
            "epoch": int(min(epochs.values())), "micro_batch_size": self.mb,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = {e["name"]: e for e in state.get("blend") or []}
        if not saved:
            raise DataError("The checkpoint's data position is for a single corpus (data.corpus), not a mixture "
                            "(data.corpora). Resume with the data settings of the checkpoint's config.yaml.")
        self.samples_seen = int(state.get("samples_seen", 0))
        reweighted = False
        for c in self.corpora:
            e = saved.get(c.name)
            if e is None:
                log.warning("Corpus %r is new to this run: it starts at its first sample.", c.name)
                c.consumed, reweighted = 0, True
            else:
                c.consumed, c.origin = int(e["consumed"]), int(e["origin"])
                reweighted |= abs(float(e["weight"]) - c.weight) > 1e-9
        gone = sorted(set(saved) - {c.name for c in self.corpora})
        if gone:
            log.warning("Corpora %s of the checkpoint are not in data.corpora any more; the mixture goes on without them.", gone)
        if reweighted or gone:
            log.warning("The mixture changed since the checkpoint; the new weights hold from sample %d on.", self.samples_seen)
            for c in self.corpora:
                c.origin = c.consumed
        for c in self.corpora:
            self._seek(c)
