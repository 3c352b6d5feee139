"""WebDataset shard writing and per-shard completion records (the format itself is ``core.corpus``).

Tar files are written byte-reproducibly (fixed mtime/owner/mode, members in sample order) to a
temporary name in the corpus directory and renamed when complete, so a crash never leaves a
half-written file under a final name. Next to each finished shard a small record
`.state/NAME.json` stores the shard's sha256 and the fingerprint of its inputs; a rerun skips a
shard whose record fingerprint matches and whose bytes still hash to the recorded sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from core.files import atomic_write_text, sha256_file

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


def write_shard(path: str | os.PathLike, samples: Iterable[tuple[str, dict[str, bytes]]]) -> dict[str, Any]:
    """Write `(key, {ext: bytes})` samples as a tar at `path` atomically; return bytes/sha256/samples."""
    tmp, info = write_shard_tmp(path, samples)
    commit_shard(tmp, path)
    return info


def write_shard_tmp(path: str | os.PathLike, samples: Iterable[tuple[str, dict[str, bytes]]]) -> tuple[Path, dict[str, Any]]:
    """Write the tar to a temporary name next to `path`; `commit_shard` makes it durable and final.

    The bytes are those of `tarfile` in USTAR format with fixed metadata (checked by the tests),
    written in large chunks and hashed on the way. Split in two so a caller can fsync one shard
    in a background thread while it builds the next.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    sha, size, count = hashlib.sha256(), 0, 0
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

            for key, members in samples:
                if "." in key:
                    raise ValueError(f"sample key {key!r} contains a dot")
                for ext, data in members.items():
                    parts.append(_member_header(f"{key}.{ext}", len(data)))
                    parts.append(data)
                    pad = -len(data) % _BLOCK
                    if pad:
                        parts.append(bytes(pad))
                    pending += _BLOCK + len(data) + pad
                count += 1
                if pending >= _WRITE_BYTES:
                    flush()
            end = size + pending + 2 * _BLOCK  # two zero blocks close the archive
            parts.append(bytes(2 * _BLOCK + (-end % _RECORD)))
            flush()
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp, {"bytes": size, "sha256": sha.hexdigest(), "samples": count}


def commit_shard(tmp: Path, path: str | os.PathLike) -> None:
    """fsync the temporary file, then rename it to its final name (a crash leaves no partial shard)."""
    try:
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
    return rec if sha256_file(shard) == rec.get("sha256") else None


def save_record(corpus: str | os.PathLike, name: str, record: dict[str, Any]) -> None:
    atomic_write_text(_record_path(corpus, name), json.dumps(record, sort_keys=True))
