"""Typed configuration of a data-preparation job (`PrepConfig`), loaded like every other config.

`load_prep_config(path, overrides)` is `pipelines.engine.config.load_config(..., cls=PrepConfig)`: YAML
with `extends:`, dotted `key=value` overrides and strict checking, so a typo fails with the
closest valid key instead of being silently ignored.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal

from core.config import ConfigError, load_config, option, to_dict
from core.corpus_kinds import CORPUS_KINDS

__all__ = [
    "SourceConfig",
    "CleanConfig",
    "TokenizerConfig",
    "ImageConfig",
    "PrepConfig",
    "load_prep_config",
    "manifest_config",
]

TEXT_SOURCES = ("text", "jsonl", "parquet", "hf_disk", "hf_load")
IMAGE_SOURCES = ("image_folder", "image_csv")


@dataclass(kw_only=True)
class SourceConfig:
    """One input: a type and a list of paths or globs (relative to the working directory)."""

    type: Literal["text", "jsonl", "parquet", "hf_disk", "hf_load", "image_folder", "image_csv"] = option(
        "text", help="text | jsonl | parquet | hf_disk (save_to_disk dir) | hf_load (load_dataset) | image_folder | image_csv."
    )
    paths: list[str] = option([], help="Files, directories or globs; a directory means every file below it (text/jsonl/parquet).")
    text_mode: Literal["paragraphs", "file"] = option(
        "paragraphs", help="text: `paragraphs` = documents separated by blank lines; `file` = one document per file."
    )
    text_field: str = option("text", help="jsonl/parquet/hf_*: the column holding the document text.")
    builder: Literal["json", "parquet", "text", ""] = option("", help="hf_load: the `datasets.load_dataset` builder.")
    split: str = option("", help="hf_disk/hf_load: split to read from a DatasetDict (default: train).")
    label_field: str = option("label", help="image_csv: column with the class label.")
    path_field: str = option("path", help="image_csv: column with the image path (relative to the CSV).")

    def __post_init__(self) -> None:
        if not self.paths:
            raise ConfigError(f"A `sources` entry of type {self.type!r} has no `paths`. Give at least one file, directory or glob.")
        if self.type == "hf_load" and not self.builder:
            raise ConfigError("A source of type `hf_load` needs `builder: json | parquet | text` (the datasets.load_dataset builder).")


@dataclass(kw_only=True)
class CleanConfig:
    """Normalisation and filtering rules; every rule's effect is counted in the report."""

    nfc: bool = option(True, help="Unicode NFC normalisation.")
    strip_control: bool = option(True, help="Remove control/format characters (keeps newline and tab).")
    normalize_whitespace: bool = option(True, help="Collapse runs of spaces/tabs, trim lines, at most one blank line.")
    min_chars: int = option(20, help="Drop documents shorter than this (after normalisation).")
    max_chars: int = option(2_000_000, help="Drop documents longer than this (0 = no limit).")
    dedup: bool = option(True, help="Exact dedup over the whole corpus by content hash (Ray shuffle).")
    near_dedup: bool = option(False, help="MinHash LSH near-duplicate removal (needs datasketch).")
    near_dedup_threshold: float = option(0.8, help="Estimated Jaccard similarity above which documents are near-duplicates.")
    minhash_perms: int = option(64, help="MinHash permutations (more = more exact, slower).")
    shingle_words: int = option(5, help="Word n-gram size of the MinHash shingles.")


@dataclass(kw_only=True)
class TokenizerConfig:
    """Train a tokenizer on a sample of the cleaned corpus, or reuse one (`path`)."""

    path: str = option("", help="Existing tokenizer directory (tokenizer.json) to reuse; empty = train one.")
    type: Literal["wordpiece", "bpe"] = option("wordpiece", help="wordpiece (BERT) or bpe (byte-level, GPT).")
    vocab_size: int = option(30522, help="Vocabulary size including special tokens.")
    lowercase: bool = option(True, help="wordpiece: lowercase and strip accents (uncased BERT).")
    min_frequency: int = option(2, help="Minimum pair frequency for a merge.")
    sample_bytes: int = option(50_000_000, help="Bytes of input files read to train the tokenizer and size the shards.")


@dataclass(kw_only=True)
class ImageConfig:
    """Image decoding and re-encoding."""

    resize_shorter: int = option(0, help="png/jpeg: resize so the shorter side has this many pixels, bilinear as the "
                                         "release's image processor (0 = keep size). Training refuses a value other "
                                         "than the evaluation's resize (256 for data.image_size 224; 0 always works).")
    format: Literal["png", "jpeg", "raw"] = option(
        "png", help="png | jpeg (encoded; decoded per sample by the loader's CPUs) | raw (uint8 HWC pixels at `size`: "
                    "no decoding; crop, flip and normalisation run on the device; see docs/benchmarks.md).")
    size: int = option(0, help="raw: the recipe's data.image_size (e.g. 224): each image is stored as the model's "
                               "evaluation and the release's processor see it (shorter side to 256 for 224, bilinear, "
                               "centre 224 x 224 crop).")
    jpeg_quality: int = option(90, help="JPEG quality (1-95) of re-encoded images; a JPEG that needs no rotation, "
                                        "mode change or resize is stored as it is.")
    mode: Literal["RGB", "L"] = option("RGB", help="Colour mode images are converted to.")

    def __post_init__(self) -> None:
        if self.format == "raw" and self.size <= 0:
            raise ConfigError("images.format=raw stores pixels at one square size: set images.size to the recipe's "
                              "data.image_size (e.g. images.size=224).")
        if self.format != "raw" and self.size:
            raise ConfigError(f"images.size={self.size} applies to images.format=raw only; for {self.format} use "
                              f"images.resize_shorter.")
        if self.format == "raw" and self.resize_shorter:
            raise ConfigError(f"images.resize_shorter={self.resize_shorter} applies to png and jpeg only; images.format=raw "
                              f"resizes each image to the evaluation's view of images.size={self.size} itself (shorter "
                              f"side {self.size * 256 // 224}, centre crop). Remove images.resize_shorter.")


@dataclass(kw_only=True)
class PrepConfig:
    """A data-preparation job: sources -> clean -> tokenize -> samples -> shards + manifest."""

    kind: str = option("bert_pairs", help="What samples to build: a registered corpus kind (bert_pairs, packed_lm, images).",
                      registry=CORPUS_KINDS)
    output: str = option("", help="Corpus directory to write (manifest.json, tokenizer/, *.tar).")
    sources: list[SourceConfig] = option([], help="Inputs; see SourceConfig.")
    seq_len: int = option(128, help="bert_pairs: max sequence length incl. [CLS]/[SEP]; packed_lm: window length.")
    seed: int = option(0, help="Seed of every random choice (NSP pairs, short sequences).")
    short_seq_prob: float = option(0.1, help="bert_pairs: probability of a shorter target length (BERT: 0.1).")
    nsp_random_prob: float = option(0.5, help="bert_pairs: probability that segment B is random (NotNext).")
    dupe_factor: int = option(1, help="bert_pairs: passes over each document with different random pairings.")
    validation_fraction: float = option(0.02, help="Share of documents (by hash) in the validation split.")
    shard_target_mb: float = option(256.0, help="Target size of a shard in MB (approximate).")
    max_bad_fraction: float = option(0.01, help="Fail when more than this share of input records is bad.")
    num_workers: int = option(0, help="Ray workers for the parallel stages (0 = all CPUs). Does not change the output.")
    input_range_mb: float = option(
        64.0, help="Text (paragraphs), JSONL and Parquet files bigger than this are read as several ranges (cut at a "
        "paragraph, line or row-group boundary), one task each, and finer when that gives fewer than 4 pieces per "
        "worker (at least 1 MB then). 0 = one task per file. Does not change the output."
    )
    progress: bool = option(True, help="Show progress bars (map and reduce tasks done) while the job runs.")
    worker_malloc: str = option(
        "auto", help="Allocator preloaded into the Ray tasks: auto (tcmalloc, mimalloc or Ray's jemalloc, the first found; "
        "1.2-1.5x faster tokenizing), system, or a library path. Does not change the output."
    )
    overwrite: bool = option(False, help="Replace a corpus in `output` built with another config (refused otherwise; "
                                         "the same config resumes it). Only the files prepare wrote there are removed.")
    clean: CleanConfig = option(help="Cleaning rules.", default_factory=CleanConfig)
    tokenizer: TokenizerConfig = option(help="Tokenizer.", default_factory=TokenizerConfig)
    images: ImageConfig = option(help="Image processing.", default_factory=ImageConfig)

    def __post_init__(self) -> None:
        if not self.output:
            raise ConfigError("PrepConfig needs `output`: the corpus directory to write, e.g. output=data/corpus.")
        if not self.sources:
            raise ConfigError("PrepConfig needs at least one entry in `sources`, e.g. [{type: text, paths: [docs/*.txt]}].")
        image_kind = self.kind == "images"
        for src in self.sources:
            if (src.type in IMAGE_SOURCES) != image_kind:
                raise ConfigError(
                    f"Source type {src.type!r} does not fit kind {self.kind!r}: images need image_folder/image_csv "
                    f"sources, text kinds need text/jsonl/parquet/hf_disk/hf_load."
                )
        if self.kind == "bert_pairs" and self.seq_len < 8:
            raise ConfigError(f"seq_len={self.seq_len} is too short for BERT pairs; use at least 8 (BERT: 128 or 512).")
        if self.kind == "packed_lm" and self.seq_len < 1:
            raise ConfigError(f"seq_len must be positive, got {self.seq_len}.")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ConfigError(f"validation_fraction must be in [0, 1), got {self.validation_fraction}.")
        if not 0.0 <= self.nsp_random_prob <= 1.0 or not 0.0 <= self.short_seq_prob <= 1.0:
            raise ConfigError("nsp_random_prob and short_seq_prob must be probabilities in [0, 1].")
        if self.input_range_mb < 0:
            raise ConfigError(f"input_range_mb must be >= 0 (0 = never split an input file), got {self.input_range_mb}.")
        if self.shard_target_mb <= 0:
            raise ConfigError(f"shard_target_mb must be positive, got {self.shard_target_mb}.")
        if self.dupe_factor < 1:
            raise ConfigError(f"dupe_factor must be >= 1, got {self.dupe_factor}.")


def load_prep_config(path: str | None, overrides: typing.Iterable[str] = ()) -> PrepConfig:
    """Load a `PrepConfig` from YAML plus `key=value` overrides (raises `ConfigError`)."""
    return load_config(path, overrides, cls=PrepConfig)


# Fields that change how the job runs but not what it writes: left out of the manifest and of
# shard fingerprints so that 1 or 8 workers give byte-identical corpora.
_EXECUTION_ONLY = ("output", "num_workers", "input_range_mb", "progress", "worker_malloc", "overwrite")


def manifest_config(cfg: PrepConfig) -> dict[str, Any]:
    """The resolved config as recorded in manifest.json (execution-only fields removed)."""
    data = to_dict(cfg)
    for key in _EXECUTION_ONLY:
        data.pop(key, None)
    return data


def replace(cfg: PrepConfig, **changes: Any) -> PrepConfig:
    return dataclasses.replace(cfg, **changes)
