"""Reading WebDataset shards: raw samples from a global position of a shard sequence, and decoding.

Plain tar
reading over local paths or ``pipe:`` URLs (object stores), skipping whole shards and the consumed
head of a shard without decoding, and the numpy/json/PIL decoders (no pickle).
"""

from __future__ import annotations

import io
import json
import logging
import subprocess
import tarfile
from collections.abc import Iterator
from typing import Any

import numpy as np

from core.corpus import Manifest, ShardInfo, iter_tar_samples

__all__ = ["read_samples", "decode_sample"]

log = logging.getLogger("pipelines.loading.loader")


def _groups(url: str, skip: int) -> Iterator[tuple[str, dict[str, bytes] | None]]:
    """Yield ``(key, {ext: bytes})`` per sample; the first ``skip`` samples are passed over unread (None)."""
    proc = None
    if url.startswith("pipe:"):
        proc = subprocess.Popen(url[5:], shell=True, stdout=subprocess.PIPE, bufsize=1 << 20)
        fh = proc.stdout
        tf = tarfile.open(fileobj=fh, mode="r|")
    else:
        fh = open(url, "rb")
        tf = tarfile.open(fileobj=fh, mode="r:")
    try:
        yield from iter_tar_samples(tf, skip)
    finally:
        tf.close()
        fh.close()
        if proc is not None:
            proc.kill()
            proc.wait()


def read_samples(m: Manifest, shards: list[ShardInfo], start: int, length: int) -> Iterator[tuple[str, str, Any]]:
    """``length`` raw samples from global position ``start`` of the concatenated ``shards``.

    Yields ``(shard name, key, parts | error string)``; a truncated or unreadable shard yields error
    entries for its missing samples so the count is always exactly ``length``.
    """
    offset = 0
    remaining = length
    for s in shards:
        if remaining <= 0:
            return
        if start >= offset + s.samples:
            offset += s.samples
            continue  # whole shard skipped without opening it
        skip = max(0, start - offset)
        want = min(s.samples - skip, remaining)
        got = 0
        try:
            for key, parts in _groups(m.url(s), skip):
                if parts is None:
                    continue
                yield s.name, key, parts
                got += 1
                if got == want:
                    break
        except (tarfile.TarError, OSError, EOFError) as exc:
            log.warning("Shard %s is unreadable after %d samples: %s", s.name, skip + got, exc)
        for i in range(got, want):
            yield s.name, f"<missing #{skip + i}>", "truncated shard (fewer samples than the manifest lists)"
        remaining -= want
        offset += s.samples
        start = offset


def decode_sample(kind: str, key: str, parts: dict[str, bytes], token_dtype: str = "uint16") -> dict[str, Any]:
    """Raw WebDataset parts -> python/numpy sample (no pickle). Raises ValueError on bad data."""
    if kind in ("bert_pairs", "packed_lm"):
        ext = {"uint16": "u16", "uint32": "u32"}[token_dtype]
        raw = parts.get(f"input_ids.{ext}")
        if raw is None or len(raw) % (2 if ext == "u16" else 4):
            raise ValueError(f"missing or misaligned input_ids.{ext}")
        ids = np.frombuffer(raw, dtype="<u2" if ext == "u16" else "<u4").astype(np.int64)
        out: dict[str, Any] = {"key": key, "input_ids": ids}
        if kind == "bert_pairs":
            meta = json.loads(parts["meta.json"].decode("utf-8"))
            out["len_a"], out["len_b"] = int(meta["len_a"]), int(meta["len_b"])
            out["next_sentence_label"] = int(meta["next_sentence_label"])
            if out["len_a"] + out["len_b"] + 3 != len(ids):
                raise ValueError(f"len_a+len_b+3={out['len_a'] + out['len_b'] + 3} != {len(ids)} tokens")
        return out
    from PIL import Image

    ext = next((e for e in ("jpg", "jpeg", "png", "webp") if e in parts), None)
    if ext is None or "cls" not in parts:
        raise ValueError("image sample needs an image (jpg/png/webp) and a .cls label")
    img = Image.open(io.BytesIO(parts[ext]))
    img.load()
    return {"key": key, "image": img.convert("RGB"), "label": int(parts["cls"].decode("ascii").strip())}
