"""WebDataset shard writing and per-shard completion records (the format itself is ``core.corpus``
and ``core.records``).

Tar files are written byte-reproducibly (fixed mtime/owner/mode, members in record order) to a
temporary name in the corpus directory and renamed when complete, so a crash never leaves a
half-written file under a final name. The writer notes each record's byte range and first
sample: that is the shard's index, written next to it as ``NAME.idx.npy`` (atomically, before the
shard is renamed). Next to each finished shard a small record `.state/NAME.json` stores the
shard's and the index's sha256 and the fingerprint of its inputs; a rerun skips a shard whose
record fingerprint matches and whose bytes (and index) still hash to the recorded sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from core.files import atomic_write_bytes, atomic_write_text, sha256_file
from core.records import index_bytes, index_name

__all__ = ["STATE_DIR", "write_shard", "write_shard_tmp", "commit_shard", "load_record", "save_record"]

STATE_DIR = ".state"


_BLOCK = 512
_RECORD = 20 * _BLOCK  # tarfile pads the archive to a multiple of its record size
_WRITE_BYTES = 4 << 20  # members are gathered and written (and hashed) in chunks of this size


def _header_template() -> tuple[bytes, int]:
    """A USTAR header as `tarfile` writes ours (mode 644, uid/gid 0, mtime 0, empty names/size)."""
    info = tarfile.TarInfo("")
    info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = 0, 0, 0o644, 0, 0, "", ""
    head = bytearray(info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape"))
    head[124:136] = b"\0" * 12  # size field: filled per member
    head[148:156] = b" " * 8  # checksum field counts as spaces
    return bytes(head), sum(head)


_TEMPLATE, _TEMPLATE_SUM = _header_template()


def _member_header(name: str, size: int) -> bytes:
    """The exact header `tarfile` (USTAR) writes for member `name` of `size` bytes, built directly.

    `tarfile.addfile` costs ~50 us per member (TarInfo copies, field validation); shards of
    small samples have hundreds of thousands of members.
    """
    raw = name.encode("utf-8", "surrogateescape")
    if len(raw) > 100 or not name.isascii():  # needs USTAR's prefix field: let tarfile do it
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = size, 0, 0o644, 0, 0, "", ""
        return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")
    size_field = b"%011o\0" % size
    chksum = _TEMPLATE_SUM + sum(raw) + sum(size_field)
    return b"".join((raw, _TEMPLATE[len(raw) : 124], size_field, _TEMPLATE[136:148], b"%06o\0 " % chksum, _TEMPLATE[156:]))


def write_shard(path: str | os.PathLike, records: Iterable[tuple]) -> dict[str, Any]:
    """Write records as a tar at `path` (and its index) atomically; return bytes/sha256/samples/index."""
    tmp, info = write_shard_tmp(path, records)
    commit_shard(tmp, path, info)
    return info


def write_shard_tmp(path: str | os.PathLike, records: Iterable[tuple]) -> tuple[Path, dict[str, Any]]:
    """Write the tar to a temporary name next to `path`; `commit_shard` makes it durable and final.

    `records`: `(key, {ext: bytes})` (one sample each) or `(key, {ext: bytes}, samples)` (a format-2
    token record). The bytes are those of `tarfile` in USTAR format with fixed metadata (checked by
    the tests), written in large chunks and hashed on the way; `info["index_rows"]` holds the
    index `(offset, length, first sample)` per record. Split in two so a caller can fsync one
    shard in a background thread while it builds the next.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    sha, size, count = hashlib.sha256(), 0, 0
    rows: list[tuple[int, int, int]] = []
    parts: list[bytes] = []
    pending = 0
    try:
        with open(tmp, "wb") as fh:

            def flush() -> None:
                nonlocal pending, size
                chunk = b"".join(parts)
                sha.update(chunk)
                fh.write(chunk)
                size += len(chunk)
                parts.clear()
                pending = 0

            for rec in records:
                key, members = rec[0], rec[1]
                if "." in key:
                    raise ValueError(f"sample key {key!r} contains a dot")
                begin = size + pending
                for ext, data in members.items():
                    parts.append(_member_header(f"{key}.{ext}", len(data)))
                    parts.append(data)
                    pad = -len(data) % _BLOCK
                    if pad:
                        parts.append(bytes(pad))
                    pending += _BLOCK + len(data) + pad
                rows.append((begin, size + pending - begin, count))
                count += rec[2] if len(rec) > 2 else 1
                if pending >= _WRITE_BYTES:
                    flush()
            end = size + pending + 2 * _BLOCK  # two zero blocks close the archive
            parts.append(bytes(2 * _BLOCK + (-end % _RECORD)))
            flush()
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp, {"bytes": size, "sha256": sha.hexdigest(), "samples": count, "index_rows": rows}


def commit_shard(tmp: Path, path: str | os.PathLike, info: dict[str, Any]) -> None:
    """Write the index, fsync the temporary shard, then rename it to its final name (a crash leaves
    no partial shard). Replaces `info["index_rows"]` by the manifest's `index` entry."""
    path = Path(path)
    rows = info.pop("index_rows", [])
    idx = index_bytes(rows)
    info["index"] = {"name": index_name(path.name), "sha256": hashlib.sha256(idx).hexdigest(), "bytes": len(idx),
                     "records": len(rows)}
    try:
        atomic_write_bytes(path.with_name(info["index"]["name"]), idx)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
    index = Path(corpus) / str((rec.get("index") or {}).get("name", "-"))
    if not index.is_file() or sha256_file(index) != rec["index"].get("sha256"):
        return None
    return rec if sha256_file(shard) == rec.get("sha256") else None


def save_record(corpus: str | os.PathLike, name: str, record: dict[str, Any]) -> None:
    atomic_write_text(_record_path(corpus, name), json.dumps(record, sort_keys=True))
