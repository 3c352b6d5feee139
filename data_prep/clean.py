"""Document normalisation and filters, plus the counters that report what each rule did.

Rules run in a fixed order (NFC -> control characters -> whitespace -> length) on each document
inside Ray workers. Exact dedup is not here: it needs the whole corpus and is done by grouping on
the content hash in the Ray shuffle (`job.py`). Near-dedup signatures (MinHash) and their LSH
banding are here; the banding groupby runs in `job.py` too.
"""

from __future__ import annotations

import functools
import hashlib
import re
import unicodedata
from collections import Counter
from typing import Any

from data_prep.config import CleanConfig

__all__ = ["Stats", "clean_text", "doc_hash", "minhash_signature", "lsh_params", "band_keys"]


class Stats:
    """Mergeable counters: `counts[rule]` and `bad_by_file[path][rule]`, and `first_bad[path]`, where the first bad
    record of a file starts (`sources.Where`: its first byte in a text or JSONL file, its row in a Parquet or Arrow
    one; JSON-serialisable)."""

    def __init__(self, counts: dict[str, int] | None = None, bad_by_file: dict[str, dict[str, int]] | None = None,
                 first_bad: dict[str, list] | None = None):
        self.counts: Counter[str] = Counter(counts or {})
        self.bad_by_file: dict[str, Counter[str]] = {k: Counter(v) for k, v in (bad_by_file or {}).items()}
        self.first_bad: dict[str, tuple[str, int]] = {k: (str(v[0]), int(v[1])) for k, v in (first_bad or {}).items()}

    def add(self, key: str, n: int = 1) -> None:
        self.counts[key] += n

    def bad(self, path: str, rule: str, n: int = 1, at: tuple[str, int] | None = None) -> None:
        self.counts[f"bad.{rule}"] += n
        self.bad_by_file.setdefault(path, Counter())[rule] += n
        if at is not None:
            self._first(path, at)

    def _first(self, path: str, at: tuple[str, int]) -> None:
        self.first_bad[path] = min(at, self.first_bad.get(path, at), key=lambda where: where[1])

    def merge(self, other: Stats) -> Stats:
        self.counts.update(other.counts)
        for path, rules in other.bad_by_file.items():
            self.bad_by_file.setdefault(path, Counter()).update(rules)
        for path, at in other.first_bad.items():
            self._first(path, at)
        return self

    @property
    def bad_records(self) -> int:
        return sum(v for k, v in self.counts.items() if k.startswith("bad."))

    def to_dict(self) -> dict[str, Any]:
        return {
            "counts": {k: int(v) for k, v in sorted(self.counts.items())},
            "bad_by_file": {p: dict(sorted(r.items())) for p, r in sorted(self.bad_by_file.items())},
            "first_bad": {p: list(w) for p, w in sorted(self.first_bad.items())},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Stats:
        return cls(data.get("counts"), data.get("bad_by_file"), data.get("first_bad"))


_ASCII_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # Cc in ASCII, minus tab and newline
_ASCII_CONTROL_BYTES = bytes([*range(0x00, 0x09), *range(0x0B, 0x20), 0x7F])
_OTHER_ASCII_SPACE = "\r\x0b\x0c\x1c\x1d\x1e\x1f"  # whitespace to str.isspace besides " \t\n"
_CONTROL_CATEGORIES = frozenset(("Cc", "Cf", "Co", "Cs"))
_SPACES = re.compile(r"[^\S\n]+")  # any whitespace except newline
_EDGE_SPACES = re.compile(r" ?\n ?")  # after _SPACES, a line's leading/trailing space sits next to "\n"
_BLANKS = re.compile(r"\n{3,}")


@functools.lru_cache(maxsize=65536)
def _is_control(char: str) -> bool:
    return unicodedata.category(char) in _CONTROL_CATEGORIES


def _strip_control(text: str) -> tuple[str, int]:
    """Remove control/format/private-use/surrogate characters (keeps newline and tab); count them.

    ASCII text goes through `bytes.translate` (C speed); for other text the (few) distinct
    non-ASCII characters are looked up by Unicode category once each, instead of running a
    regex class over every code point.
    """
    if text.isascii():
        raw = text.encode("ascii")
        kept = raw.translate(None, _ASCII_CONTROL_BYTES)
        return (text, 0) if len(kept) == len(raw) else (kept.decode("ascii"), len(raw) - len(kept))
    text, n = _ASCII_CONTROL.subn("", text)
    bad = [c for c in set(text) if c > "\x7f" and _is_control(c)]
    if bad:
        n += sum(text.count(c) for c in bad)
        text = text.translate(dict.fromkeys(map(ord, bad)))
    return text, n


def _only_plain_spaces(text: str) -> bool:
    if text.isascii():
        return not any(c in text for c in _OTHER_ASCII_SPACE)
    return not any(c.isspace() and c not in " \t\n" for c in set(text))


def _normalize_whitespace(text: str, plain: bool = False) -> str:
    """Collapse runs of spaces/tabs to one space, trim every line, keep at most one blank line.

    When the only whitespace in the text is space, tab and newline (the usual case), plain
    `str.replace` passes do it several times faster than the regexes. `plain`: the caller knows
    it is (ASCII text after control-character stripping).
    """
    if not (plain or _only_plain_spaces(text)):
        return _BLANKS.sub("\n\n", _EDGE_SPACES.sub("\n", _SPACES.sub(" ", text))).strip()
    text = text.replace("\t", " ")
    while "  " in text:
        text = text.replace("  ", " ")
    text = text.replace(" \n", "\n").replace("\n ", "\n")
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text.strip()


def clean_text(text: str, cfg: CleanConfig, stats: Stats) -> str | None:
    """Normalise one document; None when a filter removes it (the rule is counted in `stats`)."""
    if cfg.nfc and not text.isascii():  # ASCII text is always in NFC
        normal = unicodedata.normalize("NFC", text)
        if normal != text:
            stats.add("modified.nfc")
        text = normal
    if cfg.strip_control:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        stripped, n = _strip_control(text)
        if n:
            stats.add("modified.control_chars")
            stats.add("chars_removed.control", n)
        text = stripped
    if cfg.normalize_whitespace:
        normal = _normalize_whitespace(text, plain=cfg.strip_control and text.isascii())
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
