"""Tiny synthetic corpora in the documented shard format (docs/interfaces.md), for trainer tests.

Format 2 (token records + index, written with the project's own writer) by default; ``version=1``
writes the deprecated one-sample-per-record format with stock ``webdataset.TarWriter``.

Token sequences follow a learnable rule (each word = previous + a per-sentence stride over a small
vocabulary) so a 2-layer model's loss visibly falls within a few dozen steps. A real WordPiece
tokenizer.json is written so exported models load with ``transformers`` and ``pipeline``.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import webdataset as wds

from core.records import token_records
from data_prep.shards import write_shard

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SPECIAL_NAMES = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]"}
WORDS = [
    "the", "a", "cat", "dog", "sat", "ran", "on", "mat", "red", "blue", "big", "small", "house", "tree", "bird",
    "flew", "over", "under", "green", "river", "stone", "hill", "sun", "moon", "star", "light", "dark", "old",
    "new", "road", "city", "town", "boat", "sea", "wind", "rain", "snow", "fire", "wood", "iron", "gold",
    "king", "queen", "child", "book", "song", "word", "time", "day", "night",
]
N_WORDS = len(WORDS)


def write_tokenizer(out: Path, vocab_size: int = 0) -> tuple[dict, int]:
    """A WordPiece tokenizer.json (+ HF config files) over SPECIALS + WORDS + a few '##' pieces, padded
    with ``[unusedN]`` tokens to ``vocab_size`` when that is larger (a real model's embedding size)."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    tokens = SPECIALS + WORDS + ["##s", "##ed", "##ing"]
    tokens += [f"[unused{i}]" for i in range(vocab_size - len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    tok.decoder = decoders.WordPiece()
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512, "do_lower_case": True,
        "model_input_names": ["input_ids", "token_type_ids", "attention_mask"], **SPECIAL_NAMES,
    }))
    (out / "special_tokens_map.json").write_text(json.dumps(SPECIAL_NAMES))
    info = {
        "path": "tokenizer",
        "sha256": hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest(),
        "vocab_size": len(vocab), "type": "wordpiece",
        "special_tokens": {name: vocab[t] for name, t in SPECIAL_NAMES.items()},
    }
    return info, len(vocab)


def _sentence(rng: np.random.Generator, n: int, start: int | None = None, stride: int | None = None) -> np.ndarray:
    start = int(rng.integers(0, N_WORDS)) if start is None else start
    stride = int(rng.integers(1, 4)) if stride is None else stride
    return (len(SPECIALS) + (start + stride * np.arange(n, dtype=np.int64)) % N_WORDS).astype(np.int64)


def _write_shards(root: Path, split: str, sizes: list[int], make_sample, version: int = 2, kind: str = "", seq_len: int = 0) -> dict:
    shards, total_tokens = [], 0
    index = 0
    for si, n in enumerate(sizes):
        name = f"{split}-{si:06d}.tar"
        tokens = 0
        samples = []
        for _ in range(n):
            key = f"{hashlib.sha1(f'{split}{index}'.encode()).hexdigest()[:12]}-{index:06d}"
            sample, t = make_sample(index)
            samples.append((key, sample))
            tokens += t
            index += 1
        if version == 1:
            with wds.TarWriter(str(root / name)) as sink:
                for key, sample in samples:
                    sink.write({"__key__": key, **sample})
            data = (root / name).read_bytes()
            entry = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        else:
            entry = write_shard(root / name, _records(kind, samples, name, seq_len))
        shards.append({"name": name, "samples": n, "tokens": tokens, **{k: entry[k] for k in entry if k != "samples"}})
        total_tokens += tokens
    return {"shards": shards, "samples": sum(sizes), "tokens": total_tokens}


def _records(kind: str, samples: list, name: str, seq_len: int):
    """Format-2 records of v1-style sample dicts (token kinds: a few records per shard, to cross record edges)."""
    if kind == "images":
        return samples
    tuples = []
    for _, sample in samples:
        ids = np.frombuffer(sample["input_ids.u16"], dtype="<u2")
        if kind == "packed_lm":
            tuples.append(ids)
        else:
            meta = json.loads(sample["meta.json"])
            tuples.append((ids, meta["len_a"], meta["len_b"], meta["next_sentence_label"]))
    records = list(token_records(kind, tuples, name.removesuffix(".tar"), seq_len=seq_len, token_dtype=np.dtype("<u2"), max_samples=16))
    return records


def _manifest(root: Path, kind: str, seq_len: int, tok_info: dict | None, splits: dict, class_map: dict | None = None,
              version: int = 2) -> Path:
    manifest = {
        "schema_version": f"{version}.0", "kind": kind, "seq_len": seq_len, "token_dtype": "uint16",
        "tokenizer": tok_info or {}, "class_map": class_map or {}, "prep_config": {"source": "tests/pipelines/corpus_fixtures.py"},
        "splits": splits, "stats": {},
    }
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return root


def make_bert_corpus(root: str | Path, *, train_sizes=(48, 40, 40), val_sizes=(32,), seq_len: int = 32, seed: int = 0,
                     version: int = 2, vocab_size: int = 0) -> Path:
    """``bert_pairs`` corpus: [CLS] A [SEP] B [SEP]; B continues A (label 0) or is random (label 1).
    ``vocab_size``: pad the tokenizer to this size (the samples still use only the first few ids)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tok_info, _ = write_tokenizer(root / "tokenizer", vocab_size)

    def make(split_seed):
        def sample(i):
            rng = np.random.default_rng([seed, split_seed, i])
            la = int(rng.integers(4, (seq_len - 3) // 2 + 1))
            lb = int(rng.integers(3, seq_len - 3 - la + 1))
            start, stride = int(rng.integers(0, N_WORDS)), int(rng.integers(1, 4))
            a = _sentence(rng, la, start, stride)
            label = int(rng.random() < 0.5)
            if label == 0:  # B continues A's progression
                b = _sentence(rng, lb, start + stride * la, stride)
            else:
                b = _sentence(rng, lb)
            ids = np.r_[[2], a, [3], b, [3]].astype("<u2")
            return {"input_ids.u16": ids.tobytes(), "meta.json": json.dumps({"len_a": la, "len_b": lb, "next_sentence_label": label}).encode()}, len(ids)
        return sample

    splits = {"train": _write_shards(root, "train", list(train_sizes), make(1), version, "bert_pairs", seq_len),
              "validation": _write_shards(root, "validation", list(val_sizes), make(2), version, "bert_pairs", seq_len)}
    return _manifest(root, "bert_pairs", seq_len, tok_info, splits, version=version)


def make_gpt_corpus(root: str | Path, *, train_sizes=(48, 40, 40), val_sizes=(32,), seq_len: int = 32, seed: int = 0,
                    version: int = 2, vocab_size: int = 0) -> Path:
    """``packed_lm`` corpus: windows of seq_len+1 tokens of stride progressions (``vocab_size``: as for BERT)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tok_info, _ = write_tokenizer(root / "tokenizer", vocab_size)

    def make(split_seed):
        def sample(i):
            rng = np.random.default_rng([seed, split_seed, i])
            ids = np.concatenate([_sentence(rng, 11) for _ in range(seq_len // 11 + 2)])[: seq_len + 1].astype("<u2")
            return {"input_ids.u16": ids.tobytes()}, len(ids)
        return sample

    splits = {"train": _write_shards(root, "train", list(train_sizes), make(1), version, "packed_lm", seq_len),
              "validation": _write_shards(root, "validation", list(val_sizes), make(2), version, "packed_lm", seq_len)}
    return _manifest(root, "packed_lm", seq_len, tok_info, splits, version=version)


def make_image_corpus(root: str | Path, *, train_sizes=(48, 40), val_sizes=(32,), size: int | tuple[int, int] = 40,
                      classes: int = 4, seed: int = 0, version: int = 2) -> Path:
    """``images`` corpus: PNGs (``size`` square, or (width, height)) whose dominant colour channel (or brightness) is the class."""
    from PIL import Image

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    palette = np.array([[200, 40, 40], [40, 200, 40], [40, 40, 200], [200, 200, 200]], dtype=np.float32)

    def make(split_seed):
        def sample(i):
            rng = np.random.default_rng([seed, split_seed, i])
            label = i % classes
            w, h = (size, size) if isinstance(size, int) else size
            arr = np.clip(palette[label] + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
            buf = io.BytesIO()
            Image.fromarray(arr).save(buf, format="PNG")
            return {"png": buf.getvalue(), "cls": str(label).encode()}, 1
        return sample

    splits = {"train": _write_shards(root, "train", list(train_sizes), make(1), version, "images"),
              "validation": _write_shards(root, "validation", list(val_sizes), make(2), version, "images")}
    return _manifest(root, "images", 0, None, splits, class_map={f"class{c}": c for c in range(classes)}, version=version)
