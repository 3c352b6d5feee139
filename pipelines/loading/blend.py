"""Weighted mixtures of corpora (``data.corpora``): which corpus each global sample slot takes.

Slot ``q`` of the global sample sequence takes the next sample of the corpus furthest behind its share,

    i*(q) = argmax_i  w_i (q + 1) - n_i(q)        (ties: the lowest i)

where ``n_i(q)`` counts the slots given to corpus ``i`` before ``q`` — the rule of Megatron-LM's
``build_blending_indices``. At every ``q`` each corpus is within one sample of ``w_i q``, so a mixture
is exact at any scale and in every global batch (a batch of 32 at weights 0.3 / 0.7 holds 9-10 /
22-23). The slot is global, not per rank, so the mixture does not depend on the world size either;
the sample a slot gets is sample ``n_i(q)`` of corpus ``i``'s own endless sequence
(``loader.CorpusSequence``): a small corpus is repeated as often as its weight asks, a big one is
read only as far as the run goes.

Changing the weights (or the corpora) of a run between a checkpoint and its resume is allowed (a
curriculum): the comparison then restarts at the resume point (``origin``), so the new mixture holds
from there on, without a burst that pays back the old one.
"""

from __future__ import annotations

import logging
from typing import Any

from core.corpus import DataError, Manifest

log = logging.getLogger(__name__)

__all__ = ["SlotCursor", "check_blendable"]


class SlotCursor:
    """Global slot -> ``(corpus, index in that corpus's sequence)`` for slots taken in increasing order.

    Every process (each rank, each loader worker) runs its own cursor from the same state; the rule
    is plain float64 arithmetic in a fixed order, so all of them agree.
    """

    def __init__(self, weights: list[float], *, slot: int = 0, counts: list[int] | None = None,
                 origin_slot: int | None = None, origin_counts: list[int] | None = None):
        self.weights = list(weights)
        self.slot = slot
        self.counts = list(counts) if counts is not None else [slot] + [0] * (len(weights) - 1)
        self.origin_slot = slot if origin_slot is None else origin_slot
        self.origin_counts = list(self.counts if origin_counts is None else origin_counts)

    def take(self, start: int, n: int) -> list[tuple[int, int]]:
        """Skip to global slot ``start`` and assign the ``n`` slots from there."""
        if start < self.slot:
            raise RuntimeError(f"internal: slot {start} requested after slot {self.slot}; slots go forward only")
        if len(self.weights) == 1:
            first = self.counts[0] + start - self.slot
            self.slot, self.counts[0] = start + n, first + n
            return [(0, first + i) for i in range(n)]
        self._advance(start - self.slot, None)
        out: list[tuple[int, int]] = []
        self._advance(n, out)
        return out

    def _advance(self, n: int, out: list[tuple[int, int]] | None) -> None:
        w, c, c0, k = self.weights, self.counts, self.origin_counts, len(self.weights)
        for _ in range(n):
            q = self.slot - self.origin_slot + 1
            best, score = 0, w[0] * q - (c[0] - c0[0])
            for i in range(1, k):
                s = w[i] * q - (c[i] - c0[i])
                if s > score:
                    best, score = i, s
            if out is not None:
                out.append((best, c[best]))
            c[best] += 1
            self.slot += 1

    def state(self) -> dict[str, Any]:
        return {"slot": self.slot, "counts": list(self.counts), "weights": list(self.weights),
                "origin_slot": self.origin_slot, "origin_counts": list(self.origin_counts)}

    @classmethod
    def from_state(cls, s: dict[str, Any]) -> SlotCursor:
        return cls(s["weights"], slot=s["slot"], counts=s["counts"], origin_slot=s["origin_slot"], origin_counts=s["origin_counts"])

    @classmethod
    def resumed(cls, saved: dict[str, Any], names: list[str], weights: list[float], position: int) -> SlotCursor:
        """The cursor of a checkpoint (``saved``, with its corpus ``names``) for this run's corpora and weights."""
        old = dict(zip(saved.get("names") or names, saved["counts"], strict=True))
        same = list(old) == names and all(abs(a - b) < 1e-12 for a, b in zip(saved["weights"], weights, strict=True))
        if same:
            return cls.from_state(saved)
        for name in names:
            if name not in old:
                log.warning("Corpus %r is new to this run: it starts at its first sample.", name)
        gone = sorted(set(old) - set(names))
        if gone:
            log.warning("Corpora %s of the checkpoint are not in data.corpora any more; the mixture goes on without them.", gone)
        log.warning("The mixture changed since the checkpoint; the new weights hold from global sample %d on.", position)
        counts = [int(old.get(n, 0)) for n in names]
        return cls(weights, slot=saved["slot"], counts=counts, origin_slot=saved["slot"], origin_counts=counts)


def _raw_storage(m: Manifest) -> Any:
    """The manifest's ``images`` entry of a raw-pixel corpus (one uint8 batch needs one stored shape and
    view); None for an encoded one (decoded per sample, any size)."""
    return m.raw.get("images") if m.image_shape else None


def check_blendable(manifests: list[Manifest], names: list[str]) -> None:
    """Refuse corpora that cannot share a model: another kind, sequence length, token type, tokenizer, class map
    or raw-pixel storage."""
    first = manifests[0]
    for m, name in zip(manifests[1:], names[1:], strict=True):
        for what, a, b in (
            ("kind", first.kind, m.kind),
            ("sequence length", first.seq_len, m.seq_len),
            ("token dtype", first.token_dtype, m.token_dtype),
            ("tokenizer (sha256 of tokenizer.json)", (first.raw.get("tokenizer") or {}).get("sha256"),
             (m.raw.get("tokenizer") or {}).get("sha256")),
            ("class map", first.class_map, m.class_map),
            ("raw-pixel storage (images.format=raw, images.size, the prepare that wrote it)", _raw_storage(first),
             _raw_storage(m)),
        ):
            if a != b:
                alike = ("the same images settings (and this version of the code)" if first.kind == "images" else
                         f"tokenizer.path={first.tokenizer_dir} and the same kind and seq_len")
                raise DataError(
                    f"data.corpora: corpus {name!r} ({m.path}) has another {what} than corpus {names[0]!r} "
                    f"({first.path}): {b!r} vs {a!r}. A mixture needs corpora prepared alike: re-run `pretrain prepare` "
                    f"for {m.root} with {alike}."
                )
