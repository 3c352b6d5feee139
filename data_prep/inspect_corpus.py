"""`pretrain inspect CORPUS_OR_SHARD`: counts from the manifest and a few decoded samples.

Decoding uses only numpy `frombuffer`, `json.loads` and PIL, like the training loader.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from core.corpus import DataError, read_manifest, read_shard, safe_path
from core.corpus_kinds import RAW_PIXELS, raw_pixels
from core.files import OutsideError, inside
from data_prep.errors import PrepError

__all__ = ["inspect_corpus", "decode_sample"]


def _inside(corpus: Path, file: Path, what: str) -> bool:
    """True if ``file`` lies inside ``corpus``; a link out is refused (a DataError naming it)."""
    try:
        inside(corpus, os.path.abspath(file), what=what)  # ``file`` is already under ``corpus``: not joined again
    except OutsideError as exc:
        raise DataError(str(exc)) from None
    return True


def _load_tokenizer(corpus: Path):
    file = corpus / "tokenizer" / "tokenizer.json"
    if not file.is_file() or not _inside(corpus, file, "the corpus tokenizer"):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file))


def decode_sample(members: dict[str, bytes], tokenizer=None) -> dict[str, Any]:
    """A readable view of one sample: token ids (and text), NSP fields, or image size and label."""
    out: dict[str, Any] = {}
    for ext, data in members.items():
        if ext.startswith("input_ids."):
            ids = np.frombuffer(data, dtype="<u2" if ext.endswith("u16") else "<u4")
            out["num_tokens"] = len(ids)
            out["input_ids"] = ids.tolist()
            if tokenizer is not None:
                meta = json.loads(members["meta.json"]) if "meta.json" in members else None
                if meta:  # [CLS] A [SEP] B [SEP]
                    a = ids[1 : 1 + meta["len_a"]].tolist()
                    b = ids[2 + meta["len_a"] : 2 + meta["len_a"] + meta["len_b"]].tolist()
                    out["text_a"] = tokenizer.decode(a)
                    out["text_b"] = tokenizer.decode(b)
                else:
                    out["text"] = tokenizer.decode(ids.tolist(), skip_special_tokens=False)
        elif ext == "meta.json":
            meta = json.loads(data)
            out.update(meta)
            out["segment_boundary"] = meta["len_a"] + 2  # first token of B (token type 1)
        elif ext in ("png", "jpg", "jpeg"):
            from PIL import Image

            with Image.open(io.BytesIO(data)) as im:
                out["image_size"] = list(im.size)
                out["image_mode"] = im.mode
            out["format"] = ext
        elif ext == RAW_PIXELS:
            h, w, c = raw_pixels(data).shape
            out.update(image_size=[w, h], image_mode="RGB" if c == 3 else "L", format="raw")
        elif ext == "cls":
            out["label"] = int(data.decode("ascii"))
    return out


def _format_sample(key: str, s: dict[str, Any], class_names: dict[int, str]) -> list[str]:
    lines = [f"  sample {key}"]
    if "label" in s:
        name = class_names.get(s["label"], "?")
        lines.append(f"    image {s.get('image_size')} {s.get('image_mode')} {s.get('format')}  label {s['label']} ({name})")
    if "num_tokens" in s:
        lines.append(f"    tokens {s['num_tokens']}")
    if "next_sentence_label" in s:
        nsp = "NotNext (random B)" if s["next_sentence_label"] else "IsNext"
        lines.append(f"    NSP {s['next_sentence_label']} = {nsp}; segment A {s['len_a']} tokens, B {s['len_b']} tokens, B starts at {s['segment_boundary']}")
    if "text_a" in s:
        lines.append(f"    A: {s['text_a'][:300]}")
        lines.append(f"    B: {s['text_b'][:300]}")
    if "text" in s:
        lines.append(f"    text: {s['text'][:400]!r}")
    return lines


def inspect_corpus(path: str, n: int = 3) -> str:
    """Counts (from the manifest) and `n` decoded samples of a corpus directory or of one shard."""
    p = Path(path)
    if not p.exists():
        raise PrepError(f"{path} does not exist. Pass a corpus directory (with manifest.json) or one .tar shard.")
    corpus = p if p.is_dir() else p.parent
    manifest = read_manifest(corpus) if (corpus / "manifest.json").is_file() or p.is_dir() else None
    lines: list[str] = []
    if manifest:
        lines.append(f"corpus {corpus}  kind {manifest['kind']}  seq_len {manifest['seq_len']}  schema {manifest['schema_version']}")
        tok = manifest.get("tokenizer")
        if tok:
            lines.append(f"tokenizer {tok['type']} vocab {tok['vocab_size']} sha256 {tok['sha256'][:12]}…  dtype {manifest['token_dtype']}")
        if manifest.get("class_map"):
            lines.append(f"classes {len(manifest['class_map'])}: {manifest['class_map']}")
        for split, info in manifest["splits"].items():
            size = sum(s["bytes"] for s in info["shards"])
            lines.append(f"{split:<11} {len(info['shards'])} shards  {info['samples']:,} samples  {info['tokens']:,} tokens  {size / 1e6:.1f} MB")
        counts = manifest.get("stats", {}).get("counts", {})
        if counts:
            lines.append("cleaning: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    shard = p if p.is_file() else None
    if shard is None and manifest:
        first = next((s["name"] for info in manifest["splits"].values() for s in info["shards"]), None)
        shard = safe_path(corpus, first, "shard", corpus / "manifest.json") if first else None
    if shard is not None:
        tokenizer = _load_tokenizer(corpus)
        class_names = {v: k for k, v in (manifest or {}).get("class_map", {}).items()}
        total = 0
        shown: list[str] = []
        for key, members in read_shard(shard):
            if total < n:
                shown.extend(_format_sample(key, decode_sample(members, tokenizer), class_names))
            total += 1
        lines.append(f"shard {shard.name}: {total} samples; first {min(n, total)}:")
        lines.extend(shown)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m data_prep.inspect_corpus")
    parser.add_argument("path")
    parser.add_argument("-n", type=int, default=3)
    args = parser.parse_args(argv)
    try:
        print(inspect_corpus(args.path, args.n))
    except PrepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
