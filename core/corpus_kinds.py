"""One class per corpus kind: how its samples become a record, and a record (or a format-1 sample) samples again.

A corpus kind (the manifest's ``kind``) fixes what a sample holds and how it is stored:

- ``packed_lm``: windows of ``seq_len + 1`` tokens (the last one only a label); a record is one
  2-D ``input_ids`` array ``(n, seq_len + 1)``.
- ``bert_pairs``: ``[CLS] A [SEP] B [SEP]`` with ``len_a``, ``len_b`` and the NSP label; a record is
  the samples' tokens one after the other plus ``len_a``, ``len_b`` and ``nsp`` arrays.
- ``images``: an image and its class; a record is one sample: ``KEY.png|jpg`` (encoded) or
  ``KEY.pixels.npy`` (``images.format: raw``: uint8 height x width x channels, the model's square
  as its evaluation and the release's processor see it, ``core.families.vit.eval_view``), + ``KEY.cls``.
  The manifest's ``images`` entry records the format and the one resize prepare made (``resize``;
  raw: its ``crop`` and ``shape``), which ``core.families.vit.stored_geometry_problem`` checks.

``data_prep`` encodes with it, ``core.records`` and the loader decode and validate with it, and the
release card reads what a run over it "saw" (tokens or images). A new kind is one subclass and one
``register_corpus_kind``; the record layout is pinned in ``core.records`` and docs/interfaces.md.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from core.registry import Registry

__all__ = ["CORPUS_KINDS", "RAW_PIXELS", "raw_pixels", "CorpusKind", "PackedLM", "BertPairs", "Images", "register_corpus_kind", "unregister_corpus_kind",
           "registered_corpus_kind", "corpus_kind", "corpus_kind_names", "kind_of_record"]


RAW_PIXELS = "pixels.npy"  # member extension of a raw (pre-resized uint8) image


def _len_dtype(seq_len: int) -> str:
    return "<u2" if seq_len < 65536 else "<u4"


def _token_ids(parts: dict[str, Any], token_dtype: str) -> np.ndarray:
    ext = {"uint16": "u16", "uint32": "u32"}[token_dtype]
    raw = parts.get(f"input_ids.{ext}")
    if raw is None or len(raw) % (2 if ext == "u16" else 4):
        raise ValueError(f"missing or misaligned input_ids.{ext}")
    return np.frombuffer(raw, dtype="<u2" if ext == "u16" else "<u4").astype(np.int64)


class CorpusKind:
    """A corpus kind: ``encode`` (samples -> record arrays), ``decode`` (record arrays -> samples),
    ``decode_parts`` (one format-1 / image sample), ``validate`` (a decoded sample is consistent)."""

    name = ""
    tokenized = True  # token records and a tokenizer (False: images, one sample per record)
    seen = "tokens"  # what a run over it counts as "seen" (release card, progress)
    label_tokens = 0  # tokens a sample holds beyond ``seq_len`` (packed_lm: the last window token, a label only)
    sentences = False  # data_prep tokenizes each document sentence by sentence (NSP needs the boundaries)
    record_arrays: frozenset[str] = frozenset()  # the ``.npy`` arrays of its format-2 record

    def max_tokens(self, positions: int) -> int:
        """Tokens a sample may hold for a model with ``positions`` positions (0: unchecked)."""
        return positions + self.label_tokens if positions else 0

    def sample_tokens(self, sample: Any) -> int:
        """Tokens of one built sample (sizes a record)."""
        raise NotImplementedError

    def encode(self, batch: list[Any], *, seq_len: int, token_dtype: Any) -> dict[str, np.ndarray]:
        """The arrays of one record holding ``batch`` (built samples, in order)."""
        raise NotImplementedError

    def bounds(self, arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Per-sample start offsets and lengths into the record's flat ``input_ids``; ValueError if the arrays disagree."""
        raise NotImplementedError

    def decode(self, samples: list[dict[str, Any]], arrays: dict[str, np.ndarray]) -> None:
        """Add the kind's own fields (beyond ``key``, ``input_ids``) to a record's decoded samples."""

    def meta(self, arrays: dict[str, np.ndarray], i: int) -> dict[str, bytes]:
        """Format-1 style extra members of sample ``i`` of a record (what ``pretrain inspect`` shows)."""
        return {}

    def decode_parts(self, key: str, parts: dict[str, Any], token_dtype: str) -> dict[str, Any]:
        """One format-1 sample (or an image record) -> the loader's sample; ValueError on bad data."""
        out = {"key": key, "input_ids": _token_ids(parts, token_dtype)}
        self.validate(out)
        return out

    def validate(self, sample: dict[str, Any]) -> None:
        """Raise ValueError if a decoded sample's fields disagree with each other."""

    def manifest_fields(self, prep_config: dict[str, Any]) -> dict[str, Any]:
        """Top-level manifest entries that say how this kind's samples are stored (from the prep config)."""
        return {}


class PackedLM(CorpusKind):
    name = "packed_lm"
    label_tokens = 1
    record_arrays = frozenset({"input_ids"})

    def sample_tokens(self, sample):
        return len(sample)

    def encode(self, batch, *, seq_len, token_dtype):
        return {"input_ids": np.stack(batch).astype(token_dtype, copy=False)}

    def bounds(self, arrays):
        ids = arrays["input_ids"]
        if ids.ndim != 2:
            raise ValueError(f"a packed_lm record holds a 2-D input_ids array, got {ids.ndim}-D")
        n, w = ids.shape
        return np.arange(n, dtype=np.int64) * w, np.full(n, w, dtype=np.int64)


class BertPairs(CorpusKind):
    name = "bert_pairs"
    sentences = True
    record_arrays = frozenset({"input_ids", "len_a", "len_b", "nsp"})

    def sample_tokens(self, sample):
        return len(sample[0])

    def encode(self, batch, *, seq_len, token_dtype):
        ld = _len_dtype(seq_len)
        return {
            "input_ids": np.concatenate([b[0] for b in batch]).astype(token_dtype, copy=False),
            "len_a": np.array([b[1] for b in batch], dtype=ld),
            "len_b": np.array([b[2] for b in batch], dtype=ld),
            "nsp": np.array([b[3] for b in batch], dtype="<u1"),
        }

    def bounds(self, arrays):
        ids = arrays["input_ids"]
        missing = sorted(self.record_arrays - set(arrays))
        if missing or ids.ndim != 1:
            raise ValueError(f"a bert_pairs record holds 1-D input_ids, len_a, len_b and nsp arrays (missing {missing})")
        lengths = arrays["len_a"].astype(np.int64) + arrays["len_b"].astype(np.int64) + 3
        if not (len(arrays["len_a"]) == len(arrays["len_b"]) == len(arrays["nsp"])) or int(lengths.sum()) != len(ids):
            raise ValueError(f"record arrays disagree: {len(ids)} tokens, lengths sum to {int(lengths.sum())}")
        return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64), lengths

    def decode(self, samples, arrays):
        for d, la, lb, y in zip(samples, arrays["len_a"].tolist(), arrays["len_b"].tolist(), arrays["nsp"].tolist(),
                                strict=True):
            d["len_a"], d["len_b"], d["next_sentence_label"] = la, lb, y

    def meta(self, arrays, i):
        return {"meta.json": b'{"len_a": %d, "len_b": %d, "next_sentence_label": %d}' % (
            arrays["len_a"][i], arrays["len_b"][i], arrays["nsp"][i])}

    def decode_parts(self, key, parts, token_dtype):
        out: dict[str, Any] = {"key": key, "input_ids": _token_ids(parts, token_dtype)}
        meta = json.loads(bytes(parts["meta.json"]).decode("utf-8"))
        out["len_a"], out["len_b"] = int(meta["len_a"]), int(meta["len_b"])
        out["next_sentence_label"] = int(meta["next_sentence_label"])
        if out["len_a"] + out["len_b"] + 3 != len(out["input_ids"]):
            raise ValueError(f"len_a+len_b+3={out['len_a'] + out['len_b'] + 3} != {len(out['input_ids'])} tokens")
        return out

    def validate(self, sample):
        if sample["len_a"] + sample["len_b"] + 3 != len(sample["input_ids"]):
            raise ValueError(f"len_a+len_b+3 != {len(sample['input_ids'])} tokens")


class Images(CorpusKind):
    name = "images"
    tokenized = False
    seen = "images"

    def manifest_fields(self, prep_config):
        from core.families.vit import eval_resize

        images = prep_config.get("images") or {}
        fmt = str(images.get("format", "png"))
        entry: dict[str, Any] = {"format": fmt}
        if fmt == "raw":
            side = int(images["size"])
            entry.update(shape=[side, side, 1 if images.get("mode") == "L" else 3], dtype="uint8", layout="HWC",
                         resize={"shortest_edge": eval_resize(side), "resample": "bilinear"}, crop=side)
        else:
            shorter = int(images.get("resize_shorter") or 0)
            entry["resize"] = {"shortest_edge": shorter, "resample": "bilinear"} if shorter else None
        return {"images": entry}

    def decode_parts(self, key, parts, token_dtype):
        if "cls" not in parts:
            raise ValueError("image sample needs an image (jpg/png/webp or pixels.npy) and a .cls label")
        label = int(bytes(parts["cls"]).decode("ascii").strip())
        if RAW_PIXELS in parts:  # stored as the model needs it: no decode; crop/flip/normalise run on the device
            return {"key": key, "pixels": raw_pixels(parts[RAW_PIXELS]), "label": label}
        from PIL import Image

        ext = next((e for e in ("jpg", "jpeg", "png", "webp") if e in parts), None)
        if ext is None:
            raise ValueError("image sample needs an image (jpg/png/webp or pixels.npy) and a .cls label")
        img = Image.open(io.BytesIO(parts[ext]))
        img.load()
        return {"key": key, "image": img.convert("RGB"), "label": label}


def raw_pixels(data: Any) -> np.ndarray:
    """A raw image member -> uint8 (height, width, channels); ValueError if cut short or not such an array."""
    buf = io.BytesIO(bytes(data))
    arr = np.lib.format.read_array(buf, allow_pickle=False)
    if buf.tell() != len(buf.getbuffer()):
        raise ValueError(f"a raw image has {len(buf.getbuffer()) - buf.tell()} bytes past its {arr.shape} pixels")
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] not in (1, 3):
        raise ValueError(f"a raw image holds uint8 (height, width, 1 or 3) pixels, got {arr.dtype} {arr.shape}")
    return arr


_KINDS: Registry[CorpusKind] = Registry("corpus kind", key="kind")
CORPUS_KINDS = _KINDS  #: what a prep config's ``kind`` names (``data_prep.config``)


def register_corpus_kind(kind: CorpusKind) -> CorpusKind:
    return _KINDS.register(kind.name, kind)  # an empty or taken name is refused (ValueError)


def unregister_corpus_kind(name: str) -> None:
    _KINDS.unregister(name)


@contextmanager
def registered_corpus_kind(kind: CorpusKind) -> Iterator[CorpusKind]:
    """``kind`` registered for the ``with`` block only (a test's toy kind)."""
    register_corpus_kind(kind)
    try:
        yield kind
    finally:
        unregister_corpus_kind(kind.name)


def corpus_kind(name: str) -> CorpusKind:
    """The registered corpus kind ``name`` (ValueError lists the known ones)."""
    if name not in _KINDS:
        raise ValueError(f"Unknown corpus kind {name!r}; known: {', '.join(corpus_kind_names())}.")
    return _KINDS[name]


def corpus_kind_names() -> tuple[str, ...]:
    return tuple(_KINDS)


def kind_of_record(arrays: dict[str, np.ndarray]) -> CorpusKind:
    """The token kind whose record arrays are exactly ``arrays``' (a record read without its manifest)."""
    for kind in _KINDS.values():
        if kind.tokenized and kind.record_arrays == set(arrays):
            return kind
    raise ValueError(f"no corpus kind has a record of the arrays {sorted(arrays)}")


for _kind in (BertPairs(), PackedLM(), Images()):
    register_corpus_kind(_kind)
