"""Reading shards: raw samples at a position of a shard sequence, by seek or by one streaming pass.

One ``ShardReader`` per loader worker (per stream) keeps what makes consecutive windows cheap:

- local format-2 shards: the index (``SHARD.idx.npy``, sha256-checked) gives the byte range of the
  records holding any sample; one ``seek`` + ``read`` per window, the window's last record kept
  decoded for the next window, so a pass reads each byte about once;
- local format-1 shards (deprecated): the member offsets are scanned once per shard, then the same;
- ``pipe:`` URLs (from ``data.url_prefix`` only): one sequential pass per worker span, the stream kept
  open between windows (re-opened only when a later epoch goes back). Bytes are hashed while read;
  the worker that reaches a shard's end compares size and sha256 with the manifest and stops the
  run on a mismatch.

Bad data yields error strings in the sample's slot (the loader replaces and counts them); a
symlink/hardlink member or a wrong index is a ``DataError`` naming the shard. No pickle anywhere:
numpy ``.npy`` (object dtypes refused), json and PIL.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import subprocess
import tarfile
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.corpus import DataError, Manifest, ShardInfo, iter_tar_samples
from core.corpus_kinds import corpus_kind
from core.records import UnsafeMember, decode_record, index_array, parse_members, sample_problem, split_member_name

__all__ = ["ShardReader", "read_samples", "decode_sample", "Decoded", "SampleLimits"]

log = logging.getLogger("pipelines.loading.loader")
_KEEP_RECORDS = 4  # decoded records kept per reader (a window's last record is the next one's first)
_KEEP_FILES = 8


class Decoded(dict):
    """A sample already decoded from a format-2 record (``decode_sample`` passes it through)."""


@dataclass(frozen=True)
class SampleLimits:
    """What a token sample may hold: at most ``max_tokens`` ids, each in ``[0, vocab_size)`` (0: unchecked).

    Built from the model (``of_model``: its positions and embedding rows) and narrowed by the corpus
    (``for_corpus``: its seq_len and tokenizer vocabulary), so a crafted or mislabelled shard is a bad
    sample naming its shard instead of an ``IndexError`` (a device-side assert on GPU) deep in the model.
    Format-2 records are checked as a whole where they are decoded (``core.records.decode_record``: one
    max of the lengths, one min/max of the record's token array); format-1 samples one min/max each.
    """

    max_tokens: int = 0
    vocab_size: int = 0
    image_shape: tuple[int, int, int] | None = None  # a raw-pixel images corpus: every sample's (h, w, c)

    @classmethod
    def of_model(cls, model: Any, kind: str) -> SampleLimits:
        """A model's limits for samples of corpus ``kind`` (a causal LM reads ``seq_len + 1`` tokens, one as the last label)."""
        config = getattr(model, "config", None)
        positions = int(getattr(config, "max_position_embeddings", 0) or 0)
        return cls(corpus_kind(kind).max_tokens(positions), int(getattr(config, "vocab_size", 0) or 0))

    def for_corpus(self, m: Manifest) -> SampleLimits:
        """These limits narrowed by corpus ``m``'s own (its ``seq_len``, its tokenizer's vocabulary)."""
        kind = corpus_kind(m.kind)
        if not kind.tokenized:
            return SampleLimits(image_shape=m.image_shape)
        seq = kind.max_tokens(m.seq_len)
        return SampleLimits(min((v for v in (self.max_tokens, seq) if v), default=0),
                            min((v for v in (self.vocab_size, m.vocab_size) if v), default=0))

    def checked_record(self, samples: list[Decoded]) -> list[tuple[str, Any]]:
        """A decoded format-2 record (``decode_record(..., sample_type=Decoded)``) as ``(key, Decoded)``; a sample ``decode_record`` found over a limit
        becomes an error entry (a bad sample, counted and named with its shard)."""
        return [(d["key"], d["error"]) if "error" in d else (d["key"], d) for d in samples]

    def check(self, sample: dict[str, Any]) -> None:
        """Raise ValueError (a bad sample) if ``sample``'s ``input_ids`` break a limit: one min/max per sample."""
        pixels = sample.get("pixels")
        if pixels is not None and pixels.shape != self.image_shape:
            raise ValueError(f"raw image of shape {pixels.shape}, the manifest records {self.image_shape}")
        ids = sample.get("input_ids")
        if ids is not None and (self.max_tokens or self.vocab_size):
            why = sample_problem(ids, self.max_tokens, self.vocab_size)
            if why:
                raise ValueError(why)


class _Hashing(io.RawIOBase):
    """A read-only stream that hashes and counts what passes through it."""

    def __init__(self, raw: Any):
        self.raw, self.sha, self.count = raw, hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self.raw.read(len(b))
        n = len(data)
        b[:n] = data
        self.sha.update(data)
        self.count += n
        return n


class _Pipe:
    """One streaming pass over a ``pipe:`` shard: a shell command the user configured, read once."""

    def __init__(self, url: str):
        self.proc = subprocess.Popen(url[5:], shell=True, stdout=subprocess.PIPE, bufsize=1 << 20)
        self.stream = _Hashing(self.proc.stdout)
        self.tar = tarfile.open(fileobj=io.BufferedReader(self.stream, 1 << 20), mode="r|")
        self.groups = iter_tar_samples(self.tar)
        self.pos = 0  # next sample of the shard
        self.pending: list[tuple[str, Any]] = []  # decoded samples of the current record from `pos` on

    def close(self) -> None:
        self.tar.close()
        self.proc.stdout.close()  # type: ignore[union-attr]
        self.proc.kill()
        self.proc.wait()


class ShardReader:
    """Reads sample ranges of one manifest's shards for one worker (see the module docstring)."""

    def __init__(self, m: Manifest, *, verify: bool = True, limits: SampleLimits | None = None):
        self.m, self.verify = m, verify
        self.limits = (limits or SampleLimits()).for_corpus(m)
        self.token_records = m.version[0] >= 2 and corpus_kind(m.kind).tokenized
        self.indexes: dict[str, Any] = {}
        self.v1_members: dict[str, list[tuple[str, list[tuple[str, int, int]]]]] = {}  # format 1: (ext, data offset, size) per record
        self.records: OrderedDict[tuple[str, int], list[tuple[str, Any]]] = OrderedDict()
        self.files: OrderedDict[str, Any] = OrderedDict()
        self.pipes: dict[str, _Pipe] = {}

    def close(self) -> None:
        for fh in self.files.values():
            fh.close()
        for p in self.pipes.values():
            p.close()
        self.files.clear()
        self.pipes.clear()

    # ---- one shard ---------------------------------------------------------------------------

    def read(self, s: ShardInfo, skip: int, want: int) -> list[tuple[str, Any]]:
        """Samples ``skip .. skip+want`` of shard ``s`` as ``(key, parts | Decoded | error string)``."""
        url = self.m.url(s)
        try:
            if url.startswith("pipe:"):
                got = self._read_pipe(s, url, skip, want)
            else:
                got = self._read_local(s, url, skip, want)
        except DataError:
            raise
        except UnsafeMember as exc:
            raise DataError(f"Shard {url} of {self.m.path} holds an unsafe tar member: {exc}. Links are never followed; "
                            f"the shard is damaged or crafted. Remove it or re-run `pretrain prepare`.") from None
        except (tarfile.TarError, OSError, EOFError, ValueError) as exc:
            log.warning("Shard %s is unreadable after sample %d: %s", s.name, skip, exc)
            got = []
        for i in range(len(got), want):
            got.append((f"<missing #{skip + i}>", "truncated shard (fewer samples than the manifest lists)"))
        return got

    def _file(self, url: str) -> Any:
        fh = self.files.pop(url, None) or open(url, "rb")
        self.files[url] = fh
        while len(self.files) > _KEEP_FILES:
            self.files.popitem(last=False)[1].close()
        return fh

    def _index(self, s: ShardInfo, url: str) -> np.ndarray:
        """(R, 3) rows (offset, length, first sample): the format-2 sidecar, or a scan of a format-1 shard."""
        if s.name in self.indexes:
            return self.indexes[s.name]
        if self.m.version[0] >= 2:
            if not s.index:
                raise DataError(f"{self.m.path} lists shard {s.name} without an index (format 2 needs one). Re-run `pretrain prepare`.")
            path = self.m.root / s.index["name"]
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() != s.index.get("sha256"):
                raise DataError(f"{path} does not match the sha256 {self.m.path} records for it: the index is corrupt "
                                f"or was replaced. Restore it or re-run `pretrain prepare`.")
            try:
                idx = index_array(data, s.samples)
                end = int(idx[-1, 0] + idx[-1, 1]) if len(idx) else 0
                if s.bytes and end > s.bytes:
                    raise ValueError(f"its rows reach byte {end}, past the shard's {s.bytes} bytes")
            except ValueError as exc:
                raise DataError(f"{path} (index of {s.name} in {self.m.path}) is invalid: {exc}. Re-run `pretrain prepare`.") from None
        else:
            idx = self._scan_v1(s.name, url)
        self.indexes[s.name] = idx
        return idx

    def _scan_v1(self, name: str, url: str) -> np.ndarray:
        """Index a format-1 shard once by walking its headers (seeking over the data): per record the
        data range of its members, which are then sliced out of one read like format-2 records."""
        rows: list[list[int]] = []
        members: list[tuple[str, list[tuple[str, int, int]]]] = []
        key = None
        try:
            with tarfile.open(url, mode="r:") as tf:
                for member in tf:
                    if member.issym() or member.islnk():
                        raise UnsafeMember(f"member {member.name!r} is a link to {member.linkname!r}")
                    parsed = split_member_name(member.name) if member.isfile() else None
                    if parsed is None:
                        continue
                    if parsed[0] != key:
                        key = parsed[0]
                        rows.append([member.offset_data, 0, len(rows)])
                        members.append((key, []))
                    rows[-1][1] = member.offset_data + member.size - rows[-1][0]
                    members[-1][1].append((parsed[1], member.offset_data, member.size))
        except tarfile.ReadError as exc:  # truncated: keep what was indexed
            log.warning("Shard %s: header scan stopped: %s", url, exc)
        self.v1_members[name] = members
        return np.array(rows, dtype=np.int64).reshape(-1, 3)

    def _read_local(self, s: ShardInfo, url: str, skip: int, want: int) -> list[tuple[str, Any]]:
        idx = self._index(s, url)
        firsts = idx[:, 2]
        r0 = max(0, int(np.searchsorted(firsts, skip, side="right")) - 1)
        r1 = int(np.searchsorted(firsts, skip + want, side="left"))
        out: list[tuple[str, Any]] = []
        r = r0
        while r < r1:
            if (s.name, r) in self.records:
                samples = self.records[(s.name, r)]
                r += 1
            else:  # read the run of uncached records in one go
                stop = r + 1
                while stop < r1 and (s.name, stop) not in self.records:
                    stop += 1
                samples = []
                for j, got in enumerate(self._load_records(s, url, idx, r, stop)):
                    self._keep(s.name, r + j, got)
                    samples.extend(got)
                r = stop
            out.extend(samples)
        offset = int(firsts[r0]) if len(firsts) else 0
        return out[skip - offset: skip - offset + want]

    def _load_records(self, s: ShardInfo, url: str, idx: np.ndarray, a: int, b: int) -> list[list[tuple[str, Any]]]:
        """Records ``a .. b-1`` of a local shard, read with one seek; cut-short records become error entries."""
        fh = self._file(url)
        size = os.fstat(fh.fileno()).st_size  # rows past the end (a truncated or crafted shard) read as cut short
        start = min(int(idx[a, 0]), size)
        fh.seek(start)
        buf = memoryview(fh.read(min(int(idx[b - 1, 0] + idx[b - 1, 1]), size) - start))
        out = []
        for r in range(a, b):
            n = (int(idx[r + 1, 2]) if r + 1 < len(idx) else s.samples) - int(idx[r, 2])
            lo = int(idx[r, 0]) - start
            try:
                if s.name in self.v1_members:
                    key, parts = self.v1_members[s.name][r]
                    groups = [(key, {ext: _cut(buf, off - start, size) for ext, off, size in parts})]
                else:
                    groups = _group(parse_members(buf[lo: lo + int(idx[r, 1])]))
                out.append(self._samples_of(groups, n))
            except UnsafeMember:
                raise
            except ValueError as exc:
                out.append([(f"<record {r}>", f"unreadable record {r}: {exc}")] * n)
        return out

    def _samples_of(self, groups: list[tuple[str, dict[str, Any]]], n: int) -> list[tuple[str, Any]]:
        """The samples of one record (one key group), checked against the count the index promises."""
        if len(groups) != 1:
            raise ValueError(f"a record has {len(groups)} keys")
        key, parts = groups[0]
        if not self.token_records:
            got: list[tuple[str, Any]] = [(key, {k: bytes(v) for k, v in parts.items()})]
        else:
            got = self.limits.checked_record(self._decode_record(key, parts))
        if len(got) != n:
            raise ValueError(f"record {key} holds {len(got)} samples, the index says {n}")
        return got

    def _decode_record(self, key: str, parts: dict[str, Any]) -> list[dict[str, Any]]:
        return decode_record(self.m.kind, key, parts, max_tokens=self.limits.max_tokens, vocab_size=self.limits.vocab_size,
                             sample_type=Decoded)

    def _keep(self, name: str, r: int, samples: list[tuple[str, Any]]) -> None:
        self.records[(name, r)] = samples
        while len(self.records) > _KEEP_RECORDS:
            self.records.popitem(last=False)

    # ---- pipe: one streaming pass ------------------------------------------------------------

    def _read_pipe(self, s: ShardInfo, url: str, skip: int, want: int) -> list[tuple[str, Any]]:
        p = self.pipes.get(s.name)
        if p is None or p.pos > skip:
            if p is not None:
                p.close()
            p = self.pipes[s.name] = _Pipe(url)
        out: list[tuple[str, Any]] = []
        try:
            while len(out) < want:
                if not p.pending:
                    key, parts = next(p.groups)
                    if self.token_records:
                        p.pending = self.limits.checked_record(self._decode_record(key, parts or {}))
                    else:
                        p.pending = [(key, parts or {})]
                take = p.pending[: skip + want - p.pos]
                for i, item in enumerate(take):
                    if p.pos + i >= skip:
                        out.append(item)
                p.pos += len(take)
                p.pending = p.pending[len(take):]
        except StopIteration:
            pass
        except BaseException:
            p.close()
            self.pipes.pop(s.name, None)
            raise
        if p.pos >= s.samples:
            self._finish(s, url, p)
        return out

    def _finish(self, s: ShardInfo, url: str, p: _Pipe) -> None:
        """The end of a streamed shard: read to EOF, then compare size and sha256 with the manifest."""
        try:
            for _ in p.groups:
                pass
            while p.stream.read(1 << 20):
                pass
        finally:
            p.close()
            self.pipes.pop(s.name, None)
        problem = ""
        if s.bytes and p.stream.count != s.bytes:
            problem = f"streamed {p.stream.count} bytes, the manifest records {s.bytes}"
        elif self.verify and s.sha256 and p.stream.sha.hexdigest() != s.sha256:
            problem = "its sha256 differs from the one the manifest records"
        if problem:
            raise DataError(f"Shard {s.name} streamed from {url!r}: {problem} ({self.m.path}). It is truncated, corrupt or "
                            f"was replaced: re-copy it or re-run `pretrain prepare`.")


def _cut(buf: memoryview, lo: int, size: int) -> memoryview:
    if lo + size > len(buf):
        raise ValueError(f"member data cut short ({max(0, len(buf) - lo)} of {size} bytes)")
    return buf[lo: lo + size]


def _group(members: Iterator[tuple[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    groups: list[tuple[str, dict[str, Any]]] = []
    for name, data in members:
        parsed = split_member_name(name)
        if parsed is None:
            continue
        if not groups or groups[-1][0] != parsed[0]:
            groups.append((parsed[0], {}))
        groups[-1][1][parsed[1]] = data
    return groups


def read_samples(m: Manifest, shards: list[ShardInfo], start: int, length: int,
                 reader: ShardReader | None = None) -> Iterator[tuple[str, str, Any]]:
    """``length`` raw samples from global position ``start`` of the concatenated ``shards``.

    Yields ``(shard name, key, parts | Decoded | error string)``; a truncated or unreadable shard
    yields error entries for its missing samples so the count is always exactly ``length``.
    """
    own = reader is None
    reader = reader or ShardReader(m)
    try:
        offset, remaining = 0, length
        for s in shards:
            if remaining <= 0:
                return
            if start >= offset + s.samples:
                offset += s.samples
                continue  # whole shard skipped without opening it
            skip = max(0, start - offset)
            want = min(s.samples - skip, remaining)
            for key, parts in reader.read(s, skip, want):
                yield s.name, key, parts
            remaining -= want
            offset += s.samples
            start = offset
    finally:
        if own:
            reader.close()


def decode_sample(kind: str, key: str, parts: Any, token_dtype: str = "uint16") -> dict[str, Any]:
    """Raw WebDataset parts (or a ``Decoded`` record sample) -> python/numpy sample (no pickle), as corpus
    ``kind``'s class (``core.corpus_kinds``) decodes and validates it. Raises ValueError on bad data."""
    spec = corpus_kind(kind)
    if isinstance(parts, Decoded):
        spec.validate(parts)
        return dict(parts)  # its input_ids: a read-only view of a cached record (``decode_record``)
    return spec.decode_parts(key, parts, token_dtype)
