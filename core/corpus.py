"""The corpus format, written by ``data_prep`` and read by the training loader: one definition.

A corpus directory holds ``manifest.json``, ``tokenizer/``, WebDataset tar shards named
``{split}-{index:06d}.tar`` and (format 2) their index sidecars ``{split}-{index:06d}.idx.npy``.
The group of consecutive tar members that share a key (``KEY.EXT``, as stock WebDataset groups
them) is a *record*: one sample in format 1 and for images, many token samples in format 2 (see
``core.records``). The manifest (see docs/interfaces.md) records the schema version, the corpus
kind, the tokenizer (path, sha256, vocab, special ids), the token dtype, the class map, and per
split the shards with their sample/token counts, bytes, sha256 and index. A reader refuses an
unknown major schema version, and reads 1.x with a deprecation warning.

Trust: a manifest is data, possibly someone else's. Its shard, index and tokenizer paths must be
relative and stay inside the corpus (no absolute paths, ``..`` or symlinks pointing out), and it
may not name URLs: ``pipe:`` commands come only from the user's own ``data.url_prefix``.

Torch-free: the writer side (Ray tasks) and ``pretrain inspect`` import it cheaply.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from core.config import ConfigError
from core.corpus_kinds import corpus_kind, corpus_kind_names
from core.files import OutsideError, atomic_write_text, sha256_file, tree_inside
from core.records import UnsafeMember, expand_record, index_name, split_member_name

__all__ = [
    "SCHEMA_VERSION",
    "SCHEMA_MAJOR",
    "KINDS",
    "SHARD_FILE_RE",
    "DataError",
    "ShardInfo",
    "Manifest",
    "shard_name",
    "index_name",
    "safe_path",
    "split_member_name",
    "iter_tar_samples",
    "read_shard",
    "tokenizer_sha256",
    "load_manifest",
    "read_manifest",
    "write_manifest",
    "verify_shards",
]

SCHEMA_VERSION = "2.0"
SCHEMA_MAJOR = int(SCHEMA_VERSION.split(".")[0])
READABLE_MAJORS = (1, 2)  # 1.x: one sample per record, no index (deprecated, still trains)
KINDS = corpus_kind_names()  # the built-in kinds; a manifest is checked against the registry (core.corpus_kinds)
SHARD_FILE_RE = re.compile(r"^(train|validation)-\d{6}\.(tar|idx\.npy)$")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._/-]*$")
log = logging.getLogger(__name__)


class DataError(ConfigError):
    """A corpus problem found before training (missing shard, checksum, schema); printed without traceback."""


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:06d}.tar"


def safe_path(root: Path, name: str, what: str, manifest: Path) -> Path:
    """``root/name`` for a path read from a manifest, refused unless it is relative and stays inside ``root``."""
    parts = Path(name).parts
    if (not name or not _SAFE_NAME.match(name) or Path(name).is_absolute() or ".." in parts):
        raise DataError(
            f"{manifest} names {what} {name!r}: paths in a manifest must be relative to the corpus, without '..' "
            f"(letters, digits, '_', '-', '.', '/'). The manifest is damaged or not from `pretrain prepare`; "
            f"do not train on it, re-run `pretrain prepare`."
        )
    path = root / name
    if os.path.lexists(path):
        real, top = os.path.realpath(path), os.path.realpath(root)
        if os.path.commonpath([real, top]) != top:
            raise DataError(
                f"{path} (named as {what} in {manifest}) is a symlink to {real}, outside the corpus {top}. "
                f"Copy the file into the corpus instead of linking it, or re-run `pretrain prepare`."
            )
    return path


def iter_tar_samples(tar: tarfile.TarFile, skip: int = 0) -> Iterator[tuple[str, dict[str, bytes] | None]]:
    """Yield ``(key, {ext: bytes})`` per record in file order; the first ``skip`` are passed over unread (None).

    Symlink and hardlink members raise ``UnsafeMember`` (never followed, never skipped silently).
    """
    key, parts, seen = None, {}, 0
    for member in tar:
        if member.issym() or member.islnk():
            raise UnsafeMember(f"member {member.name!r} is a link to {member.linkname!r}, not a regular file")
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
    """Every sample of a shard in file order as format-1 style ``(key, {ext: bytes})`` (format-2 token
    records are expanded into their samples), what ``pretrain inspect`` and tests read."""
    with tarfile.open(path, mode="r:") if not hasattr(path, "read") else tarfile.open(fileobj=path, mode="r|") as tar:
        for key, parts in iter_tar_samples(tar):
            yield from expand_record(key, parts or {})


@dataclass
class ShardInfo:
    name: str
    samples: int
    sha256: str = ""
    bytes: int = 0
    index: dict[str, Any] = field(default_factory=dict)  # format 2: {name, sha256, bytes, records}


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
    image_shape: tuple[int, int, int] | None = None  # images stored raw: (height, width, channels) uint8; None: encoded
    splits: dict[str, list[ShardInfo]] = field(default_factory=dict)
    version: tuple[int, int] = (SCHEMA_MAJOR, 0)
    url_prefix: str = ""  # the user's own (config/CLI): `pipe:CMD ` or a directory; never from the manifest

    @property
    def path(self) -> Path:
        return self.root / "manifest.json"

    @property
    def tokenizer_dir(self) -> Path:
        """The tokenizer directory, refused unless it and every file in it lie inside the corpus (no link out)."""
        d = safe_path(self.root, str((self.raw.get("tokenizer") or {}).get("path", "tokenizer")), "the tokenizer path", self.path)
        try:
            tree_inside(self.root, os.path.abspath(d), what=f"the tokenizer of {self.path}", links=False)
            return d
        except OutsideError as exc:
            raise DataError(f"{exc} A corpus is read only from inside itself; do not train on it as it is.") from None

    def shards(self, split: str) -> list[ShardInfo]:
        if split not in self.splits:
            raise DataError(
                f"Corpus {self.root}/manifest.json has no split {split!r} (has: {', '.join(self.splits)}). "
                f"Set data.eval_split to one of those or re-run `pretrain prepare` with that split."
            )
        return self.splits[split]

    def url(self, shard: ShardInfo) -> str:
        """Where to read ``shard``: the corpus directory, or ``data.url_prefix`` + name (``{name}`` is
        replaced where present; in a ``pipe:`` command the name is shell-quoted)."""
        prefix = self.url_prefix
        if not prefix:
            return str(self.root / shard.name)
        name = shlex.quote(shard.name) if prefix.startswith("pipe:") else shard.name
        return prefix.replace("{name}", name) if "{name}" in prefix else prefix + name


def tokenizer_sha256(tok_dir: Path) -> str:
    """sha256 of ``tokenizer.json`` (the file that fixes the id <-> token mapping)."""
    return sha256_file(tok_dir / "tokenizer.json")


def read_manifest(corpus: str | os.PathLike) -> dict[str, Any]:
    """The raw ``manifest.json`` mapping of a corpus, after the schema-version check."""
    root = Path(corpus)
    path = root / "manifest.json"
    if not str(corpus):
        raise DataError("data.corpus is empty. Set it to a corpus directory written by `pretrain prepare`.")
    if root.is_file():  # root/manifest.json "does not exist" would send the user looking inside a file
        fix = (f"the folder holding it, {root.parent}" if root.name == "manifest.json"
               else "the directory `pretrain prepare` wrote (it holds manifest.json and the shards)")
        raise DataError(f"{root} is a file, not a corpus directory. Point at {fix}.")
    if not path.is_file():
        where = "" if root.is_absolute() else f" (relative to the current directory, {Path.cwd()})"
        raise DataError(
            f"{path} does not exist{where}: {root} is not a finished corpus. "
            f"Point at a directory written by `pretrain prepare` (or run it to build one)."
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path} is not valid JSON ({exc}). Re-run `pretrain prepare` to rewrite it.") from None
    if not isinstance(raw, dict):
        raise DataError(f"{path} must hold a JSON object, found {type(raw).__name__}. Re-run `pretrain prepare`.")
    version = str(raw.get("schema_version", ""))
    if not version or version.split(".")[0] not in {str(v) for v in READABLE_MAJORS}:
        raise DataError(
            f"{path} has schema_version {version!r}; this reader understands "
            f"{' and '.join(f'{v}.x' for v in READABLE_MAJORS)}. Re-run `pretrain prepare` with this version of the code."
        )
    return raw


def write_manifest(corpus: str | os.PathLike, manifest: dict[str, Any]) -> None:
    """Write ``manifest.json`` atomically (the last file a prep job writes)."""
    atomic_write_text(Path(corpus) / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def load_manifest(corpus: str | Path, *, kind: str | None = None, check_tokenizer: bool = True, url_prefix: str = "") -> Manifest:
    """Parse and validate ``CORPUS/manifest.json``; refuse an unknown schema, kind, tokenizer mismatch,
    paths leaving the corpus and URLs inside the manifest. ``url_prefix`` is the user's ``data.url_prefix``."""
    root = Path(corpus)
    path = root / "manifest.json"
    raw = read_manifest(corpus)
    major, _, minor = str(raw["schema_version"]).partition(".")
    version = (int(major), int(minor or 0) if (minor or "0").isdigit() else 0)
    if version[0] < SCHEMA_MAJOR:
        log.warning("%s is corpus format %s, which is deprecated: it trains, but its shards are much larger than "
                    "format 2's and have no index (each is scanned once per loader worker). Re-run `pretrain prepare` to write format %s.", path, raw["schema_version"], SCHEMA_VERSION)
    if raw.get("kind") not in corpus_kind_names():
        raise DataError(f"{path}: kind {raw.get('kind')!r} is not one of {', '.join(corpus_kind_names())}.")
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
        version=version,
        url_prefix=url_prefix,
    )
    m.image_shape = _image_shape(raw, path)
    for split, info in (raw.get("splits") or {}).items():
        m.splits[split] = [_shard_info(s, root, path, version[0]) for s in info.get("shards", [])]
    if corpus_kind(m.kind).tokenized and check_tokenizer:
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


def _image_shape(raw: dict[str, Any], path: Path) -> tuple[int, int, int] | None:
    """The (height, width, channels) of a raw-pixel images corpus; None for encoded images (and corpora
    written before the ``images`` entry existed, all encoded)."""
    images = raw.get("images") or {}
    if images.get("format") != "raw":
        return None
    shape = images.get("shape")
    if (not isinstance(shape, list) or len(shape) != 3 or not all(isinstance(v, int) and v > 0 for v in shape)
            or shape[2] not in (1, 3) or images.get("dtype") != "uint8" or images.get("layout") != "HWC"):
        raise DataError(f"{path}: images.format is raw but its shape/dtype/layout ({shape}, {images.get('dtype')}, "
                        f"{images.get('layout')}) is not [height, width, 1|3], uint8, HWC. Re-run `pretrain prepare`.")
    return (shape[0], shape[1], shape[2])


def _shard_info(s: dict[str, Any], root: Path, path: Path, major: int) -> ShardInfo:
    """One manifest shard entry, checked: no URL, a safe relative name, a safe index name (format 2)."""
    name = str(s.get("name", ""))
    if "url" in s:
        raise DataError(
            f"{path} gives shard {name!r} a url ({str(s['url'])[:80]!r}). A manifest may not name URLs or commands "
            f"(a `pipe:` URL is a shell command); shards are read from the corpus directory. To stream them, remove "
            f"the url fields and set data.url_prefix in your own config, e.g. data.url_prefix='pipe:cat /mnt/corpus/'."
        )
    safe_path(root, name, "shard", path)
    index = dict(s.get("index") or {})
    if major >= 2 and index:
        safe_path(root, str(index.get("name", "")), f"the index of shard {name}", path)
    return ShardInfo(name, int(s["samples"]), str(s.get("sha256", "")), int(s.get("bytes", 0)), index)


def verify_shards(m: Manifest, splits: list[str], *, checksums: bool = True, rank: int = 0, world: int = 1,
                  training: bool = True, hash_only: set[str] | None = None) -> None:
    """Fail before training if a shard is missing, or (on this rank's share) its size or sha256 differs.

    Streamed shards (``pipe:``) are verified while they are read instead (``pipelines.loading.shard_io``).
    ``training=False`` (``pretrain inspect``) leaves out the ``data.verify_checksums`` way round, a training option;
    ``hash_only`` (shard names) limits the sha256 to those (inspect hashes the shard it shows, not the corpus).
    """
    anyway = " (or set data.verify_checksums=false to train anyway; data.max_bad_share then bounds the bad samples)"
    for split in splits:
        for i, s in enumerate(m.shards(split)):
            url = m.url(s)
            if url.startswith("pipe:"):
                continue  # hashed while streaming
            p = Path(url)
            if not p.is_file():
                raise DataError(
                    f"Shard {p} listed in {m.root}/manifest.json (split {split}) is missing. "
                    f"Restore it or re-run `pretrain prepare`."
                )
            if checksums and s.bytes and p.stat().st_size != s.bytes:
                raise DataError(
                    f"Shard {p} has {p.stat().st_size} bytes but {m.root}/manifest.json records {s.bytes}: it is truncated "
                    f"or was replaced. Re-copy it or re-run `pretrain prepare`{anyway if training else ''}."
                )
            hashed = i % world == rank and (hash_only is None or s.name in hash_only)
            if checksums and s.sha256 and hashed and sha256_file(p) != s.sha256:
                raise DataError(
                    f"Shard {p} has a different sha256 than {m.root}/manifest.json records: it is corrupt or was "
                    f"replaced. Re-copy it or re-run `pretrain prepare`{anyway if training else ''}."
                )
