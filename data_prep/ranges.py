"""Split big input files into ranges that separate map tasks read, so one large file uses every worker.

A range is the file entry plus `span = [start, end)`: byte offsets for text in `paragraphs` mode
and JSONL, row-group indices for Parquet. Byte cuts are placed where the whole-file reader
(`data_prep.sources`) would separate two records anyway: JSONL at a line start, paragraphs right
after a blank line, so a document is never cut and the ranges of a file yield exactly the
documents one whole-file read yields. Shards depend only on the set of documents (each shard
sorts its documents by content hash), so splitting changes no output byte. Text in `file` mode
(one document per file) and `datasets` Arrow caches are read whole.

The driver finds the cuts by reading a few lines after each nominal offset (a whole scan only
for a file without any blank line); it never reads the documents themselves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

from data_prep.config import SourceConfig

__all__ = ["range_bytes_for", "split_entries", "text_cuts", "MIN_AUTO_RANGE_BYTES"]

MIN_AUTO_RANGE_BYTES = 1_000_000  # the job never splits finer than this on its own (a config may ask for smaller)
_RANGES_PER_WORKER = 4  # pieces per worker the job aims for when the corpus has few, big files


def range_bytes_for(max_range_mb: float, total_bytes: int, workers: int) -> int:
    """Target range size: `max_range_mb`, or smaller when needed for ~4 pieces per worker (0 = no splitting)."""
    if max_range_mb <= 0:
        return 0
    configured = max(1, int(max_range_mb * 1e6))
    return min(configured, max(MIN_AUTO_RANGE_BYTES, math.ceil(total_bytes / (_RANGES_PER_WORKER * max(1, workers)))))


def split_entries(entries: Sequence[dict[str, Any]], sources: Sequence[SourceConfig], range_bytes: int) -> list[dict[str, Any]]:
    """`entries` with every splittable file bigger than `range_bytes` replaced by its ranges (in file order)."""
    out: list[dict[str, Any]] = []
    for e in entries:
        splitter = _SPLITTERS.get(_split_mode(sources[int(e["source"])])) if range_bytes > 0 and e["size"] > range_bytes else None
        spans = _safe_spans(splitter, str(e["path"]), int(e["size"]), range_bytes) if splitter else []
        if len(spans) < 2:
            out.append(e)
            continue
        out.extend({**e, "span": [a, b], "size": size} for a, b, size in spans)
    return out


def _split_mode(src: SourceConfig) -> str:
    if src.type == "text":
        return "paragraphs" if src.text_mode == "paragraphs" else ""
    return {"jsonl": "lines", "parquet": "row_groups"}.get(src.type, "")


def _safe_spans(splitter: Callable[[str, int, int], list[tuple[int, int, int]]], path: str, size: int, range_bytes: int):
    """The file's spans, or [] (read whole) when the driver cannot open or parse it: the reader then counts it once."""
    try:
        return splitter(path, size, range_bytes)
    except (OSError, ValueError):  # pyarrow's ArrowInvalid is a ValueError
        return []


def text_cuts(fh: BinaryIO, size: int, range_bytes: int, paragraphs: bool) -> list[int]:
    """Offsets 0 < c1 < ... < size where the file may be cut: the first record boundary at or after each k * range_bytes.

    A boundary is a line start (`paragraphs=False`), or the end of a blank line that itself starts
    at a line start (`paragraphs=True`: no document spans it).
    """
    cuts = [0]
    for k in range(1, math.ceil(size / range_bytes)):
        nominal = k * range_bytes
        if nominal <= cuts[-1]:
            continue  # the previous cut already passed this offset (a long paragraph)
        fh.seek(nominal - 1)
        fh.readline()  # through the first newline at or after nominal - 1: now at a line start >= nominal
        pos = fh.tell()
        if paragraphs:
            for line in fh:
                pos += len(line)
                if not line.strip():
                    break
        if pos >= size:
            break
        cuts.append(pos)
    return [*cuts, size]


def _text_spans(paragraphs: bool) -> Callable[[str, int, int], list[tuple[int, int, int]]]:
    def spans(path: str, size: int, range_bytes: int) -> list[tuple[int, int, int]]:
        with open(path, "rb") as fh:
            cuts = text_cuts(fh, size, range_bytes, paragraphs)
        return [(a, b, b - a) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]

    return spans


def _row_group_spans(path: str, size: int, range_bytes: int) -> list[tuple[int, int, int]]:
    """Runs of consecutive row groups of about `range_bytes` compressed bytes each."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    if meta.num_row_groups < 2 or meta.num_rows == 0:
        return []
    sizes = [sum(meta.row_group(g).column(c).total_compressed_size for c in range(meta.num_columns)) for g in range(meta.num_row_groups)]
    spans, start, acc = [], 0, 0
    for g, s in enumerate(sizes):
        acc += s
        if acc >= range_bytes or g == len(sizes) - 1:
            spans.append((start, g + 1, acc))
            start, acc = g + 1, 0
    return spans


_SPLITTERS: dict[str, Callable[[str, int, int], list[tuple[int, int, int]]]] = {
    "paragraphs": _text_spans(paragraphs=True),
    "lines": _text_spans(paragraphs=False),
    "row_groups": _row_group_spans,
}
