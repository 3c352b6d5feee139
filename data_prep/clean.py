"""Document normalisation and filters, plus the counters that report what each rule did.

Rules run in a fixed order (NFC -> control characters -> whitespace -> length) on each document
inside Ray workers. Exact dedup is not here: it needs the whole corpus and is done by grouping on
the content hash in the Ray shuffle (`job.py`). Near-dedup signatures (MinHash) and their LSH
banding are here; the banding groupby runs in `job.py` too.
"""

from __future__ import annotations

import hashlib
import re
import sys
import unicodedata
from collections import Counter
from typing import Any

from data_prep.config import CleanConfig

__all__ = ["Stats", "clean_text", "doc_hash", "minhash_signature", "lsh_params", "band_keys"]


class Stats:
    """Mergeable counters: `counts[rule]` and `bad_by_file[path][rule]` (JSON-serialisable)."""

    def __init__(self, counts: dict[str, int] | None = None, bad_by_file: dict[str, dict[str, int]] | None = None):
        self.counts: Counter[str] = Counter(counts or {})
        self.bad_by_file: dict[str, Counter[str]] = {k: Counter(v) for k, v in (bad_by_file or {}).items()}

    def add(self, key: str, n: int = 1) -> None:
        self.counts[key] += n

    def bad(self, path: str, rule: str, n: int = 1) -> None:
        self.counts[f"bad.{rule}"] += n
        self.bad_by_file.setdefault(path, Counter())[rule] += n

    def merge(self, other: Stats) -> Stats:
        self.counts.update(other.counts)
        for path, rules in other.bad_by_file.items():
            self.bad_by_file.setdefault(path, Counter()).update(rules)
        return self

    @property
    def bad_records(self) -> int:
        return sum(v for k, v in self.counts.items() if k.startswith("bad."))

    def to_dict(self) -> dict[str, Any]:
        return {
            "counts": {k: int(v) for k, v in sorted(self.counts.items())},
            "bad_by_file": {p: dict(sorted(r.items())) for p, r in sorted(self.bad_by_file.items())},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Stats:
        return cls(data.get("counts"), data.get("bad_by_file"))


def _char_class(categories: tuple[str, ...], keep: str) -> re.Pattern[str]:
    codes = [c for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) in categories and chr(c) not in keep]
    ranges: list[list[int]] = []
    for c in codes:  # compress into ranges so the character class stays small
        if ranges and ranges[-1][1] == c - 1:
            ranges[-1][1] = c
        else:
            ranges.append([c, c])
    body = "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in ranges)
    return re.compile(f"[{body}]")


_CONTROL = None  # built lazily: scanning all code points takes ~0.3 s
_SPACES = re.compile(r"[^\S\n]+")  # any whitespace except newline
_BLANKS = re.compile(r"\n{3,}")


def _control() -> re.Pattern[str]:
    global _CONTROL
    if _CONTROL is None:
        _CONTROL = _char_class(("Cc", "Cf", "Co", "Cs"), keep="\n\t")
    return _CONTROL


def clean_text(text: str, cfg: CleanConfig, stats: Stats) -> str | None:
    """Normalise one document; None when a filter removes it (the rule is counted in `stats`)."""
    if cfg.nfc:
        normal = unicodedata.normalize("NFC", text)
        if normal != text:
            stats.add("modified.nfc")
        text = normal
    if cfg.strip_control:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        stripped, n = _control().subn("", text)
        if n:
            stats.add("modified.control_chars")
            stats.add("chars_removed.control", n)
        text = stripped
    if cfg.normalize_whitespace:
        lines = [_SPACES.sub(" ", line).strip() for line in text.split("\n")]
        normal = _BLANKS.sub("\n\n", "\n".join(lines)).strip()
        if normal != text.strip():
            stats.add("modified.whitespace")
        text = normal
    if len(text) < cfg.min_chars or not text.strip():
        stats.add("removed.too_short")
        return None
    if cfg.max_chars and len(text) > cfg.max_chars:
        stats.add("removed.too_long")
        return None
    return text


def doc_hash(text: str) -> str:
    """Content hash of a cleaned document: the dedup key, split key and sample-key prefix."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ------------------------------------------------------------------------------------------
# MinHash near-dedup (Broder 1997; LSH banding as in Leskovec et al., Mining of Massive Datasets)
# ------------------------------------------------------------------------------------------


def minhash_signature(text: str, num_perm: int, shingle_words: int) -> bytes:
    """MinHash of the word n-gram shingles of a document, as little-endian uint64 bytes."""
    from datasketch import MinHash  # optional dependency

    words = text.lower().split()
    n = max(1, min(shingle_words, len(words)))
    shingles = {" ".join(words[i : i + n]).encode("utf-8") for i in range(max(1, len(words) - n + 1))}
    mh = MinHash(num_perm=num_perm, seed=1)
    mh.update_batch(sorted(shingles))
    return mh.hashvalues.astype("<u8").tobytes()


def lsh_params(num_perm: int, threshold: float) -> tuple[int, int]:
    """(bands, rows) with bands * rows <= num_perm whose S-curve midpoint is closest to threshold."""
    best = (1, num_perm)
    best_err = float("inf")
    for rows in range(1, num_perm + 1):
        bands = num_perm // rows
        err = abs((1.0 / bands) ** (1.0 / rows) - threshold)
        if err < best_err:
            best, best_err = (bands, rows), err
    return best


def band_keys(signature: bytes, bands: int, rows: int) -> list[str]:
    """One bucket key per band; documents sharing any key are near-duplicate candidates."""
    width = rows * 8
    return [f"{b:03d}:" + hashlib.blake2b(signature[b * width : (b + 1) * width], digest_size=12).hexdigest() for b in range(bands)]
