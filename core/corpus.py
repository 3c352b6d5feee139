"""The corpus format, written by ``data_prep`` and read by the training loader: one definition.

A corpus directory holds ``manifest.json``, ``tokenizer/`` and WebDataset tar shards named
``{split}-{index:06d}.tar``. A sample is the group of consecutive tar members that share a key
(``KEY.EXT``), exactly as stock WebDataset groups them. The manifest (see docs/interfaces.md)
records the schema version, the corpus kind, the tokenizer (path, sha256, vocab, special ids), the
token dtype, the class map, and per split the shards with their sample/token counts, bytes and
sha256. A reader refuses an unknown major schema version with a clear error.

Torch-free: the writer side (Ray tasks) and ``pretrain inspect`` import it cheaply.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from core.config import ConfigError
from core.files import atomic_write_text, sha256_file

__all__ = [
    "SCHEMA_VERSION",
    "SCHEMA_MAJOR",
    "KINDS",
    "SHARD_FILE_RE",
    "DataError",
    "ShardInfo",
    "Manifest",
    "shard_name",
    "split_member_name",
    "iter_tar_samples",
    "read_shard",
    "tokenizer_sha256",
    "load_manifest",
    "read_manifest",
    "write_manifest",
    "verify_shards",
]

SCHEMA_VERSION = "1.0"
SCHEMA_MAJOR = int(SCHEMA_VERSION.split(".")[0])
KINDS = ("bert_pairs", "packed_lm", "images")
SHARD_FILE_RE = re.compile(r"^(train|validation)-\d{6}\.tar$")
_MEMBER_RE = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # WebDataset: key = path up to the first dot of the basename


class DataError(ConfigError):
    """A corpus problem found before training (missing shard, checksum, schema); printed without traceback."""


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:06d}.tar"


def split_member_name(name: str) -> tuple[str, str] | None:
    """``(key, extension)`` of a tar member name as WebDataset splits it, or None if it has no extension."""
    match = _MEMBER_RE.match(name)
    return (match.group(1), match.group(2)) if match else None


def iter_tar_samples(tar: tarfile.TarFile, skip: int = 0) -> Iterator[tuple[str, dict[str, bytes] | None]]:
    """Yield ``(key, {ext: bytes})`` per sample in file order; the first ``skip`` samples are passed over unread (None)."""
    key, parts, seen = None, {}, 0
    for member in tar:
        if not member.isfile():
            continue
        parsed = split_member_name(member.name)
        if parsed is None:
            continue
        k, ext = parsed
        if k != key:
            if key is not None:
                yield key, (parts if seen > skip else None)
            key, parts, seen = k, {}, seen + 1
        if seen > skip:
            parts[ext] = tar.extractfile(member).read()  # type: ignore[union-attr]
    if key is not None:
        yield key, (parts if seen > skip else None)


def read_shard(path: str | os.PathLike | IO[bytes]) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Every sample of a local shard in file order, members grouped by key (what WebDataset does)."""
    with tarfile.open(path, mode="r:") if not hasattr(path, "read") else tarfile.open(fileobj=path, mode="r|") as tar:
        for key, parts in iter_tar_samples(tar):
            yield key, parts or {}


@dataclass
class ShardInfo:
    name: str
    samples: int
    sha256: str = ""
    bytes: int = 0
    url: str = ""  # optional `pipe:` or path override (object stores); default: corpus_dir/name


@dataclass
class Manifest:
    """The parsed ``manifest.json`` of a corpus directory (see docs/interfaces.md)."""

    root: Path
    raw: dict[str, Any]
    kind: str
    seq_len: int
    token_dtype: str
    vocab_size: int
    special_tokens: dict[str, int]
    class_map: dict[str, int]
    splits: dict[str, list[ShardInfo]] = field(default_factory=dict)

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / str(self.raw.get("tokenizer", {}).get("path", "tokenizer"))

    def shards(self, split: str) -> list[ShardInfo]:
        if split not in self.splits:
            raise DataError(
                f"Corpus {self.root}/manifest.json has no split {split!r} (has: {', '.join(self.splits)}). "
                f"Set data.eval_split to one of those or re-run `pretrain prepare` with that split."
            )
        return self.splits[split]

    def url(self, shard: ShardInfo) -> str:
        return shard.url or str(self.root / shard.name)


def tokenizer_sha256(tok_dir: Path) -> str:
    """sha256 of ``tokenizer.json`` (the file that fixes the id <-> token mapping)."""
    return sha256_file(tok_dir / "tokenizer.json")


def read_manifest(corpus: str | os.PathLike) -> dict[str, Any]:
    """The raw ``manifest.json`` mapping of a corpus, after the schema-version check."""
    root = Path(corpus)
    path = root / "manifest.json"
    if not str(corpus):
        raise DataError("data.corpus is empty. Set it to a corpus directory written by `pretrain prepare`.")
    if not path.is_file():
        raise DataError(
            f"{path} does not exist: {root} is not a finished corpus. "
            f"Point at a directory written by `pretrain prepare` (or run it to build one)."
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path} is not valid JSON ({exc}). Re-run `pretrain prepare` to rewrite it.") from None
    if not isinstance(raw, dict):
        raise DataError(f"{path} must hold a JSON object, found {type(raw).__name__}. Re-run `pretrain prepare`.")
    version = str(raw.get("schema_version", ""))
    if not version or version.split(".")[0] != str(SCHEMA_MAJOR):
        raise DataError(
            f"{path} has schema_version {version!r}; this reader understands {SCHEMA_MAJOR}.x. "
            f"Re-run `pretrain prepare` with this version of the code."
        )
    return raw


def write_manifest(corpus: str | os.PathLike, manifest: dict[str, Any]) -> None:
    """Write ``manifest.json`` atomically (the last file a prep job writes)."""
    atomic_write_text(Path(corpus) / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def load_manifest(corpus: str | Path, *, kind: str | None = None, check_tokenizer: bool = True) -> Manifest:
    """Parse and validate ``CORPUS/manifest.json``; refuse an unknown schema, kind or tokenizer mismatch."""
    root = Path(corpus)
    path = root / "manifest.json"
    raw = read_manifest(corpus)
    if raw.get("kind") not in KINDS:
        raise DataError(f"{path}: kind {raw.get('kind')!r} is not one of {', '.join(KINDS)}.")
    if kind is not None and raw["kind"] != kind:
        raise DataError(
            f"{path} holds a {raw['kind']!r} corpus but the task needs {kind!r}. "
            f"Choose the matching train.task or a corpus prepared for it."
        )
    tok = raw.get("tokenizer") or {}
    m = Manifest(
        root=root,
        raw=raw,
        kind=raw["kind"],
        seq_len=int(raw.get("seq_len") or 0),
        token_dtype=str(raw.get("token_dtype", "uint16")),
        vocab_size=int(tok.get("vocab_size") or 0),
        special_tokens={str(k): int(v) for k, v in (tok.get("special_tokens") or {}).items()},
        class_map={str(k): int(v) for k, v in (raw.get("class_map") or {}).items()},
    )
    for split, info in (raw.get("splits") or {}).items():
        m.splits[split] = [
            ShardInfo(str(s["name"]), int(s["samples"]), str(s.get("sha256", "")), int(s.get("bytes", 0)), str(s.get("url", "")))
            for s in info.get("shards", [])
        ]
    if m.kind != "images" and check_tokenizer:
        tdir = m.tokenizer_dir
        if not (tdir / "tokenizer.json").is_file():
            raise DataError(f"{tdir}/tokenizer.json is missing (manifest {path}). Re-run `pretrain prepare`.")
        want = str(tok.get("sha256", ""))
        if want and tokenizer_sha256(tdir) != want:
            raise DataError(
                f"{tdir}/tokenizer.json does not match the sha256 recorded in {path}: the token ids in the shards "
                f"were made with another tokenizer. Restore the original tokenizer or re-run `pretrain prepare`."
            )
    return m


def verify_shards(m: Manifest, splits: list[str], *, checksums: bool = True, rank: int = 0, world: int = 1) -> None:
    """Fail before training if a shard is missing, or (on this rank's share) its sha256 differs."""
    for split in splits:
        for i, s in enumerate(m.shards(split)):
            url = m.url(s)
            if url.startswith("pipe:"):
                continue  # remote: cannot be checked without reading it
            p = Path(url)
            if not p.is_file():
                raise DataError(
                    f"Shard {p} listed in {m.root}/manifest.json (split {split}) is missing. "
                    f"Restore it or re-run `pretrain prepare`."
                )
            if checksums and s.sha256 and i % world == rank and sha256_file(p) != s.sha256:
                raise DataError(
                    f"Shard {p} has a different sha256 than {m.root}/manifest.json records: it is corrupt or was "
                    f"replaced. Re-copy it or re-run `pretrain prepare` (or set data.verify_checksums=false to "
                    f"train anyway with on_bad_sample handling)."
                )
