"""`pretrain inspect CORPUS_OR_SHARD`: counts from the manifest and a few decoded samples.

Decoding uses only numpy `frombuffer`, `json.loads` and PIL, like the training loader.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from core.config import ConfigError
from core.corpus import DataError, Manifest, load_manifest, read_shard, safe_path, verify_shards
from core.corpus_kinds import RAW_PIXELS, corpus_kind, raw_pixels
from data_prep.errors import PrepError
from data_prep.tokenizer import read_tokenizer_file

__all__ = ["inspect_corpus", "decode_sample"]


def _load_tokenizer(m: Manifest):
    """The corpus tokenizer (checked inside the corpus and against the manifest's sha256 by
    ``load_manifest``), or None for a corpus without one (images)."""
    if not corpus_kind(m.kind).tokenized or not (m.tokenizer_dir / "tokenizer.json").is_file():
        return None
    return read_tokenizer_file(m.tokenizer_dir / "tokenizer.json", f"Restore it from the corpus' source, or re-run "
                               f"`pretrain prepare` for {m.root}.")


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


def _read_samples(shard: Path, n: int, tokenizer, class_names: dict[int, str]) -> tuple[int, list[str]]:
    """(samples in ``shard``, the first ``n`` formatted); a file that is not a readable tar shard is a DataError."""
    total, shown = 0, []
    try:
        for key, members in read_shard(shard):
            if total < n:
                shown.extend(_format_sample(key, decode_sample(members, tokenizer), class_names))
            total += 1
    except (tarfile.TarError, EOFError, ValueError, KeyError, OSError) as exc:
        raise DataError(f"{shard} is not a readable shard ({type(exc).__name__}: {exc}): it is cut short, damaged or not "
                        f"a .tar written by `pretrain prepare`. Pass a corpus directory (with manifest.json) or one of "
                        f"its shards; re-copy a damaged shard or re-run `pretrain prepare`.") from None
    return total, shown


def _verify(m: Manifest, shard: Path | None, shown: Path | None) -> None:
    """Every shard of ``m`` (or only ``shard``, when the manifest lists it) is present and of the recorded size;
    the one shown is also checked against its sha256. Hashing the whole corpus (an hour per ~500 GB) is
    training's job, not a quick look's."""
    names = {shown.name} if shown is not None else set()
    if shard is None:
        verify_shards(m, list(m.splits), training=False, hash_only=names)
        return
    for split, infos in m.splits.items():
        mine = [s for s in infos if os.path.abspath(m.root / s.name) == os.path.abspath(shard)]
        if mine:
            verify_shards(dataclasses.replace(m, splits={split: mine}), [split], training=False, hash_only=names)


def inspect_corpus(path: str, n: int = 3) -> str:
    """Counts (from the manifest) and `n` decoded samples of a corpus directory or of one shard.

    Every shard the manifest lists (or the one shard named) is first checked against the manifest with the
    training loader's own check (present, recorded size; the shard shown also its sha256): a damaged
    corpus is reported, not shown as fewer samples."""
    p = Path(path)
    if not p.exists():
        raise PrepError(f"{path} does not exist. Pass a corpus directory (with manifest.json) or one .tar shard.")
    corpus = p if p.is_dir() else p.parent
    m = load_manifest(corpus) if (corpus / "manifest.json").is_file() or p.is_dir() else None
    shard = p if p.is_file() else None
    lines: list[str] = []
    if shard is None and m is not None:
        first = next((s.name for infos in m.splits.values() for s in infos), None)
        shown = safe_path(corpus, first, "shard", corpus / "manifest.json") if first else None
    else:
        shown = shard
    if m is not None:
        _verify(m, shard, shown)
        manifest = m.raw
        tokenized = corpus_kind(manifest["kind"]).tokenized  # an image corpus has no seq_len, tokens or NSP counts
        seq = f"  seq_len {manifest['seq_len']}" if tokenized else ""
        lines.append(f"corpus {corpus}  kind {manifest['kind']}{seq}  schema {manifest['schema_version']}")
        tok = manifest.get("tokenizer")
        if tok:
            lines.append(f"tokenizer {tok['type']} vocab {tok['vocab_size']} sha256 {tok['sha256'][:12]}…  dtype {manifest['token_dtype']}")
        if manifest.get("class_map"):
            lines.append(f"classes {len(manifest['class_map'])}: {manifest['class_map']}")
        for split, info in manifest["splits"].items():
            size = sum(s["bytes"] for s in info["shards"])
            tokens = f"  {info['tokens']:,} tokens" if tokenized else ""
            lines.append(f"{split:<11} {len(info['shards'])} shards  {info['samples']:,} samples{tokens}  {size / 1e6:.1f} MB")
        counts = {k: v for k, v in manifest.get("stats", {}).get("counts", {}).items()
                  if k != "nsp_random" or manifest["kind"] == "bert_pairs"}
        if counts:
            lines.append("cleaning: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    shard = shown
    if shard is not None:
        tokenizer = _load_tokenizer(m) if m is not None else None
        class_names = {v: k for k, v in (m.class_map if m is not None else {}).items()}
        total, shown = _read_samples(shard, n, tokenizer, class_names)
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
    except (PrepError, ConfigError) as exc:  # missing path, damaged corpus: the user's to fix (exit 2)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
