"""WebDataset shard writing and reading, checksums, the manifest and per-shard completion records.

Tar files are written byte-reproducibly (fixed mtime/owner/mode, members in sample order) to a
temporary name in the corpus directory and renamed when complete, so a crash never leaves a
half-written file under a final name. Next to each finished shard a small record
`.state/NAME.json` stores the shard's sha256 and the fingerprint of its inputs; a rerun skips a
shard whose record fingerprint matches and whose bytes still hash to the recorded sha256.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from data_prep.errors import PrepError
from pipelines.config import atomic_write_text

__all__ = [
    "SCHEMA_VERSION",
    "write_shard",
    "read_shard",
    "sha256_file",
    "shard_name",
    "load_record",
    "save_record",
    "write_manifest",
    "read_manifest",
]

SCHEMA_VERSION = "1.0"
STATE_DIR = ".state"


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:06d}.tar"


class _HashingWriter(io.RawIOBase):
    """File wrapper that hashes and counts what passes through it."""

    def __init__(self, fh):
        self.fh, self.sha, self.size = fh, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.size

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.fh.write(data)


def write_shard(path: str | os.PathLike, samples: Iterable[tuple[str, dict[str, bytes]]]) -> dict[str, Any]:
    """Write `(key, {ext: bytes})` samples as a tar at `path` atomically; return bytes/sha256/samples."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    count = 0
    try:
        with open(tmp, "wb") as raw:
            hw = _HashingWriter(raw)
            with tarfile.open(fileobj=hw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
                for key, members in samples:
                    if "." in key:
                        raise ValueError(f"sample key {key!r} contains a dot")
                    for ext, data in members.items():
                        info = tarfile.TarInfo(f"{key}.{ext}")
                        info.size, info.mtime, info.mode = len(data), 0, 0o644
                        info.uid = info.gid = 0
                        info.uname = info.gname = ""
                        tar.addfile(info, io.BytesIO(data))
                    count += 1
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {"bytes": hw.size, "sha256": hw.sha.hexdigest(), "samples": count}


def read_shard(path: str | os.PathLike) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Samples of a shard in file order, members grouped by key (what WebDataset does)."""
    key: str | None = None
    members: dict[str, bytes] = {}
    with tarfile.open(path, mode="r") as tar:
        for info in tar:
            if not info.isfile():
                continue
            base = os.path.basename(info.name)
            k, _, ext = base.partition(".")
            if k != key and key is not None:
                yield key, members
                members = {}
            key = k
            members[ext] = tar.extractfile(info).read()  # type: ignore[union-attr]
    if key is not None:
        yield key, members


def sha256_file(path: str | os.PathLike) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def _record_path(corpus: str | os.PathLike, name: str) -> Path:
    return Path(corpus) / STATE_DIR / f"{name}.json"


def load_record(corpus: str | os.PathLike, name: str, fingerprint: str) -> dict[str, Any] | None:
    """The completion record of shard `name` if it matches `fingerprint` and the file's sha256."""
    rec_path = _record_path(corpus, name)
    shard = Path(corpus) / name
    if not rec_path.is_file() or not shard.is_file():
        return None
    try:
        rec = json.loads(rec_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if rec.get("fingerprint") != fingerprint or rec.get("bytes") != shard.stat().st_size:
        return None
    return rec if sha256_file(shard) == rec.get("sha256") else None


def save_record(corpus: str | os.PathLike, name: str, record: dict[str, Any]) -> None:
    atomic_write_text(_record_path(corpus, name), json.dumps(record, sort_keys=True))


def write_manifest(corpus: str | os.PathLike, manifest: dict[str, Any]) -> None:
    atomic_write_text(Path(corpus) / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def read_manifest(corpus: str | os.PathLike) -> dict[str, Any]:
    """Load and version-check a corpus manifest."""
    path = Path(corpus) / "manifest.json"
    if not path.is_file():
        raise PrepError(f"{corpus} has no manifest.json: it is not a finished corpus. Run `pretrain prepare CONFIG` to (re)build it.")
    manifest = json.loads(path.read_text())
    major = str(manifest.get("schema_version", "0")).split(".")[0]
    if major != SCHEMA_VERSION.split(".")[0]:
        raise PrepError(
            f"{path} has schema_version {manifest.get('schema_version')!r}; this code reads {SCHEMA_VERSION}. "
            f"Re-run data preparation with this version of pretrain."
        )
    return manifest
