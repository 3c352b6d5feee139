"""Corpus format 2: many token samples per tar record, the per-shard index, and safe member parsing.

Why: in format 1 every sample cost two tar members (a 512-byte header plus padding each), so
shards of short samples were ~25x their token payload, and a reader had to walk every header
from the start of a shard to reach a sample. Format 2 groups samples into *records*: the tar
members sharing one key (``KEY.EXT``, as stock WebDataset groups them), each array a ``.npy``
(numpy's format: a small text header, then raw little-endian data; never pickle); each kind's
class in ``core.corpus_kinds`` encodes and decodes its records:

- ``packed_lm``: ``KEY.input_ids.npy``, 2-D ``(n, seq_len + 1)``.
- ``bert_pairs``: ``KEY.input_ids.npy`` (1-D, the samples' ``[CLS] A [SEP] B [SEP]`` one after the
  other), ``KEY.len_a.npy``, ``KEY.len_b.npy`` (per sample) and ``KEY.nsp.npy`` (uint8 labels);
  sample ``i`` is ``len_a[i] + len_b[i] + 3`` tokens long.
- ``images``: a record is one sample, ``KEY.png|jpg`` (or raw ``KEY.pixels.npy``) + ``KEY.cls`` (as in format 1).

Sample ``i`` of record ``KEY`` has the key ``KEY-{i:05d}``. A record closes at ~1 MiB of tokens or
4096 samples, so tar overhead is < 1 % and a record is the unit of random access. Each shard has an
index ``SHARD.idx.npy`` (int64 ``(records, 3)``: byte offset of the record's first header, byte
length of its members, first sample), listed with its sha256 in the manifest: a reader seeks
straight to the record holding any sample. Stock ``webdataset.WebDataset`` still iterates the
shards (a record is then one sample, its arrays decoded by its ``.npy`` handler).
"""

from __future__ import annotations

import io
import re
import tarfile
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from core.corpus_kinds import corpus_kind, kind_of_record

__all__ = [
    "RECORD_BYTES", "RECORD_SAMPLES", "split_member_name", "npy_bytes", "npy_array", "token_records",
    "decode_record", "sample_problem", "expand_record", "parse_members", "index_bytes", "index_array", "index_name", "UnsafeMember",
]

RECORD_BYTES = 1 << 20  # token bytes per record at most (the read unit of random access)
RECORD_SAMPLES = 4096  # samples per record at most
_MEMBER_RE = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # WebDataset: key = path up to the first dot of the basename
_REGULAR = (tarfile.REGTYPE, tarfile.AREGTYPE)


class UnsafeMember(ValueError):
    """A tar member that is not a regular file (symlink, hardlink, device, ...): never followed."""


def split_member_name(name: str) -> tuple[str, str] | None:
    """``(key, extension)`` of a tar member name as WebDataset splits it, or None if it has no extension."""
    match = _MEMBER_RE.match(name)
    return (match.group(1), match.group(2)) if match else None


def npy_bytes(arr: np.ndarray) -> bytes:
    """``arr`` in numpy's ``.npy`` format (version 1.0, little-endian, no pickle)."""
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(arr), version=(1, 0), allow_pickle=False)
    return buf.getvalue()


def npy_array(data: bytes | memoryview) -> np.ndarray:
    """A read-only array view of ``.npy`` bytes; refuses object (pickle) dtypes and short data."""
    fp = io.BytesIO(data)
    version = np.lib.format.read_magic(fp)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(fp)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(fp)
    else:
        raise ValueError(f"unsupported .npy version {version}")
    if dtype.hasobject or fortran:
        raise ValueError("object or Fortran-ordered .npy arrays are not accepted (no pickle)")
    count = int(np.prod(shape, dtype=np.int64))
    if fp.tell() + count * dtype.itemsize > len(data):
        raise ValueError(f".npy array of shape {shape} is truncated")
    return np.frombuffer(data, dtype=dtype, count=count, offset=fp.tell()).reshape(shape)


def token_records(kind: str, samples: Iterable[Any], prefix: str, *, seq_len: int, token_dtype: np.dtype,
                  max_bytes: int = RECORD_BYTES, max_samples: int = RECORD_SAMPLES) -> Iterator[tuple[str, dict[str, bytes], int]]:
    """Group samples into records ``(key, {ext: bytes}, samples)``; key ``{prefix}-{record:06d}``.

    ``samples``: ``packed_lm`` windows (arrays of ``seq_len + 1`` tokens) or ``bert_pairs`` tuples
    ``(input_ids, len_a, len_b, next_sentence_label)``.
    """
    spec = corpus_kind(kind)
    itemsize = np.dtype(token_dtype).itemsize
    batch: list[Any] = []
    size, r = 0, 0

    def emit() -> tuple[str, dict[str, bytes], int]:
        arrays = spec.encode(batch, seq_len=seq_len, token_dtype=token_dtype)
        return f"{prefix}-{r:06d}", {f"{name}.npy": npy_bytes(arr) for name, arr in arrays.items()}, len(batch)

    for s in samples:
        batch.append(s)
        size += spec.sample_tokens(s) * itemsize
        if size >= max_bytes or len(batch) >= max_samples:
            yield emit()
            batch, size, r = [], 0, r + 1
    if batch:
        yield emit()


def _arrays(members: dict[str, Any]) -> dict[str, np.ndarray]:
    return {ext[:-4]: npy_array(data) for ext, data in members.items() if ext.endswith(".npy")}


def decode_record(kind: str, key: str, members: dict[str, Any], *, max_tokens: int = 0,
                  vocab_size: int = 0, sample_type: type[dict] = dict) -> list[dict[str, Any]]:
    """The loader's samples of one token record: ``{key, input_ids (int64)[, len_a, len_b, next_sentence_label]}``.

    ``max_tokens`` / ``vocab_size`` (0: unchecked): a sample longer, or with an id outside ``[0, vocab_size)``,
    gets an ``error`` entry saying why. Checked once per record (a max of the lengths, a min/max of the raw
    token array), sample by sample only when the record fails. ``sample_type``: the dict class of the samples
    (a reader marks them as decoded without copying each); their ``input_ids`` are read-only views of one array.
    """
    if "input_ids.npy" not in members:
        raise ValueError(f"record {key} has no input_ids.npy (members: {', '.join(members)})")
    a = _arrays(members)
    spec = corpus_kind(kind)
    starts, lengths = spec.bounds(a)
    flat = a["input_ids"].reshape(-1).astype(np.int64)
    flat.flags.writeable = False  # samples are views: a reader may cache the record and hand them out again
    out = [sample_type(key=f"{key}-{i:05d}", input_ids=flat[s: s + n])
           for i, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True))]
    spec.decode(out, a)
    raw = a["input_ids"]
    too_long = bool(max_tokens) and len(lengths) > 0 and int(lengths.max()) > max_tokens
    if too_long or (vocab_size and raw.size and (int(raw.min()) < 0 or int(raw.max()) >= vocab_size)):
        for d in out:
            why = sample_problem(d["input_ids"], max_tokens, vocab_size)
            if why:
                d["error"] = why
    return out


def sample_problem(ids: np.ndarray, max_tokens: int = 0, vocab_size: int = 0) -> str:
    """Why a token sample cannot be fed to the model ('' if it can): too long, or an id outside the vocabulary."""
    if max_tokens and len(ids) > max_tokens:
        return f"{len(ids)} tokens, more than the {max_tokens} the model and the corpus' seq_len allow"
    if vocab_size and len(ids):
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            return f"token id {hi if hi >= vocab_size else lo} is outside the vocabulary [0, {vocab_size})"
    return ""


def expand_record(key: str, members: dict[str, bytes]) -> list[tuple[str, dict[str, bytes]]]:
    """A format-2 token record as format-1 style samples ``(key, {"input_ids.u16": ..., "meta.json": ...})``;
    any other group (images, format 1) is returned as it is. What ``pretrain inspect`` shows."""
    if "input_ids.npy" not in members:
        return [(key, members)]
    a = _arrays(members)
    spec = kind_of_record(a)
    starts, lengths = spec.bounds(a)
    ids = a["input_ids"].reshape(-1)
    ext = "input_ids.u16" if ids.dtype.itemsize == 2 else "input_ids.u32"
    out = []
    for i, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
        parts = {ext: ids[s: s + n].astype(ids.dtype.newbyteorder("<")).tobytes(), **spec.meta(a, i)}
        out.append((f"{key}-{i:05d}", parts))
    return out


def parse_members(buf: bytes | memoryview) -> Iterator[tuple[str, memoryview]]:
    """``(name, data)`` of the USTAR members in ``buf`` (a byte range of a shard: whole records).

    Only regular files are accepted; a symlink/hardlink (or any other type) raises ``UnsafeMember``;
    a header that does not parse or data cut short raises ``ValueError`` (a truncated shard).
    """
    view = memoryview(buf)
    pos = 0
    while pos + 512 <= len(view):
        block = bytes(view[pos: pos + 512])
        if block == bytes(512):
            return
        try:
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.HeaderError as exc:
            raise ValueError(f"bad tar header at byte {pos} of the record range: {exc}") from None
        if info.type not in _REGULAR:
            raise UnsafeMember(f"member {info.name!r} is a {_type_name(info)}, not a regular file")
        start, end = pos + 512, pos + 512 + info.size
        if end > len(view):
            raise ValueError(f"member {info.name!r} is cut short ({len(view) - start} of {info.size} bytes)")
        yield info.name, view[start:end]
        pos = end + (-info.size % 512)
    if pos != len(view):
        raise ValueError(f"the record range ends inside a tar header ({len(view) - pos} bytes left)")


def _type_name(info: tarfile.TarInfo) -> str:
    if info.issym():
        return f"symlink to {info.linkname!r}"
    if info.islnk():
        return f"hardlink to {info.linkname!r}"
    return f"member of type {info.type!r}"


def index_name(shard_name: str) -> str:
    """The index sidecar of a shard: ``train-000003.tar`` -> ``train-000003.idx.npy``."""
    return shard_name.removesuffix(".tar") + ".idx.npy"


def index_bytes(rows: list[tuple[int, int, int]]) -> bytes:
    """The ``.idx.npy`` bytes of ``(offset, length, first sample)`` rows."""
    return npy_bytes(np.array(rows, dtype="<i8").reshape(-1, 3))


def index_array(data: bytes, samples: int) -> np.ndarray:
    """Parse and sanity-check an index: (R, 3) int64, offsets and first samples increasing."""
    idx = npy_array(data)
    if idx.ndim != 2 or idx.shape[1] != 3 or idx.dtype.kind != "i":
        raise ValueError(f"an index must be an (R, 3) integer array, got {idx.dtype} {idx.shape}")
    if len(idx) and (idx[0, 2] != 0 or np.any(np.diff(idx[:, 0]) <= 0) or np.any(np.diff(idx[:, 2]) <= 0)
                     or int(idx[-1, 2]) >= max(1, samples) or np.any(idx[:, 1] <= 0) or int(idx[0, 0]) < 0
                     or np.any(idx[:-1, 0] + idx[:-1, 1] > idx[1:, 0])):
        raise ValueError("index rows are not increasing, overlap, or do not match the shard's sample count")
    return idx.astype(np.int64)
