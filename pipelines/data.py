"""Corpus manifest -> seekable, rank-balanced streams of WebDataset samples.

The data position is a pure function of ``(epoch, batches consumed by each rank)``, so a checkpoint
stores two integers and resume *seeks* instead of replaying the stream:

1. Epoch order: the split's shards are permuted with ``rng(seed, epoch)``; concatenating their
   samples (manifest counts) gives the epoch's global sample sequence of length T.
2. Balance: every rank gets ``nb = T // (world * micro_batch)`` batches; the tail of the permuted
   sequence is dropped (a different tail every epoch). Equal counts mean no rank waits at the end
   of an epoch for a rank that has no data (the uneven-shards hang).
3. Layout: rank r owns the contiguous range ``[r*nb*mb, (r+1)*nb*mb)``. Within it, DataLoader
   worker w serves rank batches ``b % W == w`` and owns a contiguous span of that range, so each
   worker reads ~1/(world*W) of the bytes. A resumed loader rotates worker ids so that its first
   batch is the next one due.
4. Shuffle: block shuffle. Each worker's span is cut into windows of ``shuffle_buffer`` samples,
   each permuted by ``rng(seed, epoch, window start)``. Seeking costs at most one window re-read;
   the trade-off against a rolling buffer is that samples only mix within a window (plus the
   per-epoch shard permutation).

Bad samples (undecodable, truncated shard) keep their slot: with ``on_bad_sample=skip`` they are
replaced by another sample of the same window (deterministically), counted, and logged with the
shard and key, so counts stay equal and nothing hangs. Decoding uses numpy/json/PIL only.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import re
import subprocess
import tarfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipelines.config import ConfigError

__all__ = [
    "DataError",
    "Manifest",
    "ShardInfo",
    "load_manifest",
    "verify_shards",
    "StreamingSource",
    "MapStyleSource",
    "epoch_layout",
    "shard_order",
    "read_samples",
    "decode_sample",
]

log = logging.getLogger(__name__)
SCHEMA_MAJOR = 1
KINDS = ("bert_pairs", "packed_lm", "images")
_KEY_RE = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")


class DataError(ConfigError):
    """A corpus problem found before training (missing shard, checksum, schema); printed without traceback."""


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


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tokenizer_sha256(tok_dir: Path) -> str:
    """sha256 of ``tokenizer.json`` (the file that fixes the id <-> token mapping)."""
    return _sha256_file(tok_dir / "tokenizer.json")


def load_manifest(corpus: str | Path, *, kind: str | None = None, check_tokenizer: bool = True) -> Manifest:
    """Parse and validate ``CORPUS/manifest.json``; refuse an unknown schema, kind or tokenizer mismatch."""
    root = Path(corpus)
    path = root / "manifest.json"
    if not str(corpus):
        raise DataError("data.corpus is empty. Set it to a corpus directory written by `pretrain prepare`.")
    if not path.is_file():
        raise DataError(f"{path} does not exist. Point data.corpus at a directory written by `pretrain prepare`.")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path} is not valid JSON ({exc}). Re-run `pretrain prepare` to rewrite it.") from None
    version = str(raw.get("schema_version", ""))
    if not version or version.split(".")[0] != str(SCHEMA_MAJOR):
        raise DataError(
            f"{path} has schema_version {version!r}; this reader understands {SCHEMA_MAJOR}.x. "
            f"Re-run `pretrain prepare` with this version of the code."
        )
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
            if checksums and s.sha256 and i % world == rank and _sha256_file(p) != s.sha256:
                raise DataError(
                    f"Shard {p} has a different sha256 than {m.root}/manifest.json records: it is corrupt or was "
                    f"replaced. Re-copy it or re-run `pretrain prepare` (or set data.verify_checksums=false to "
                    f"train anyway with on_bad_sample handling)."
                )


# --------------------------------------------------------------------------------------------
# Reading tar shards (local path or `pipe:` command) without decoding skipped samples
# --------------------------------------------------------------------------------------------


def _open_stream(url: str):
    if url.startswith("pipe:"):
        proc = subprocess.Popen(url[5:], shell=True, stdout=subprocess.PIPE, bufsize=1 << 20)
        return proc.stdout, tarfile.open(fileobj=proc.stdout, mode="r|"), proc
    fh = open(url, "rb")
    return fh, tarfile.open(fileobj=fh, mode="r:"), None


def _groups(url: str, skip: int) -> Iterator[tuple[str, dict[str, bytes] | None]]:
    """Yield ``(key, {ext: bytes})`` per sample; the first ``skip`` samples are passed over unread (None)."""
    fh, tf, proc = _open_stream(url)
    try:
        key, parts, seen = None, {}, 0
        for member in tf:
            if not member.isfile():
                continue
            match = _KEY_RE.match(member.name)
            if not match:
                continue
            k, ext = match.group(1), match.group(2)
            if k != key:
                if key is not None:
                    yield key, (parts if seen > skip else None)
                key, parts, seen = k, {}, seen + 1
            if seen > skip:
                parts[ext] = tf.extractfile(member).read()
        if key is not None:
            yield key, (parts if seen > skip else None)
    finally:
        tf.close()
        fh.close()
        if proc is not None:
            proc.kill()
            proc.wait()


def read_samples(m: Manifest, shards: list[ShardInfo], start: int, length: int) -> Iterator[tuple[str, str, Any]]:
    """``length`` raw samples from global position ``start`` of the concatenated ``shards``.

    Yields ``(shard name, key, parts | error string)``; a truncated or unreadable shard yields error
    entries for its missing samples so the count is always exactly ``length``.
    """
    offset = 0
    remaining = length
    for s in shards:
        if remaining <= 0:
            return
        if start >= offset + s.samples:
            offset += s.samples
            continue  # whole shard skipped without opening it
        skip = max(0, start - offset)
        want = min(s.samples - skip, remaining)
        got = 0
        try:
            for key, parts in _groups(m.url(s), skip):
                if parts is None:
                    continue
                yield s.name, key, parts
                got += 1
                if got == want:
                    break
        except (tarfile.TarError, OSError, EOFError) as exc:
            log.warning("Shard %s is unreadable after %d samples: %s", s.name, skip + got, exc)
        for i in range(got, want):
            yield s.name, f"<missing #{skip + i}>", "truncated shard (fewer samples than the manifest lists)"
        remaining -= want
        offset += s.samples
        start = offset


def decode_sample(kind: str, key: str, parts: dict[str, bytes], token_dtype: str = "uint16") -> dict[str, Any]:
    """Raw WebDataset parts -> python/numpy sample (no pickle). Raises ValueError on bad data."""
    if kind in ("bert_pairs", "packed_lm"):
        ext = {"uint16": "u16", "uint32": "u32"}[token_dtype]
        raw = parts.get(f"input_ids.{ext}")
        if raw is None or len(raw) % (2 if ext == "u16" else 4):
            raise ValueError(f"missing or misaligned input_ids.{ext}")
        ids = np.frombuffer(raw, dtype="<u2" if ext == "u16" else "<u4").astype(np.int64)
        out: dict[str, Any] = {"key": key, "input_ids": ids}
        if kind == "bert_pairs":
            meta = json.loads(parts["meta.json"].decode("utf-8"))
            out["len_a"], out["len_b"] = int(meta["len_a"]), int(meta["len_b"])
            out["next_sentence_label"] = int(meta["next_sentence_label"])
            if out["len_a"] + out["len_b"] + 3 != len(ids):
                raise ValueError(f"len_a+len_b+3={out['len_a'] + out['len_b'] + 3} != {len(ids)} tokens")
        return out
    from PIL import Image

    ext = next((e for e in ("jpg", "jpeg", "png", "webp") if e in parts), None)
    if ext is None or "cls" not in parts:
        raise ValueError("image sample needs an image (jpg/png/webp) and a .cls label")
    img = Image.open(io.BytesIO(parts[ext]))
    img.load()
    return {"key": key, "image": img.convert("RGB"), "label": int(parts["cls"].decode("ascii").strip())}


# --------------------------------------------------------------------------------------------
# Epoch layout (pure functions of seed, epoch and topology)
# --------------------------------------------------------------------------------------------


def shard_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(n))
    return [int(i) for i in np.random.default_rng([seed, epoch, 7]).permutation(n)]


def epoch_layout(total: int, world: int, workers: int, mb: int) -> tuple[int, list[int]]:
    """``(batches per rank, batches per worker)`` for one epoch; workers = max(1, num_workers)."""
    nb = total // (world * mb)
    return nb, [max(0, math.ceil((nb - w) / workers)) for w in range(workers)]


def _worker_batches_done(start_batch: int, w: int, workers: int) -> int:
    """Rank batches b < start_batch with b % workers == w."""
    return max(0, math.ceil((start_batch - w) / workers))


class _EpochStream(IterableDataset):
    """One rank's batches of one epoch, from ``start_batch`` on; collated inside the worker."""

    def __init__(self, src: StreamingSource, epoch: int, start_batch: int):
        self.src, self.epoch, self.start_batch = src, epoch, start_batch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        src, W = self.src, max(1, self.src.num_workers)
        info = get_worker_info()
        w = ((info.id if info else 0) + self.start_batch) % W  # rotate: first batch is the one due
        order = [src.shards[i] for i in shard_order(len(src.shards), src.seed, self.epoch, src.shuffle)]
        nb, per_worker = epoch_layout(src.total, src.world, W, src.mb)
        span_start = src.rank * nb * src.mb + src.mb * sum(per_worker[:w])
        span_len = per_worker[w] * src.mb
        pos = _worker_batches_done(self.start_batch, w, W) * src.mb
        window = src.window if src.shuffle and src.window > 1 else src.mb
        k = pos // window
        samples: list[dict[str, Any]] = []
        while k * window < span_len:
            lo, hi = k * window, min((k + 1) * window, span_len)
            block = self._window(order, span_start + lo, hi - lo)
            for sample in block[max(0, pos - lo):]:
                samples.append(sample)
                if len(samples) == src.mb:
                    yield src.collate(samples, epoch=self.epoch, train=src.train)
                    samples = []
            k += 1

    def _window(self, order: list[ShardInfo], start: int, length: int) -> list[dict[str, Any]]:
        src = self.src
        decoded: list[dict[str, Any] | None] = []
        bad = 0
        for shard, key, parts in read_samples(src.manifest, order, start, length):
            try:
                if isinstance(parts, str):
                    raise ValueError(parts)
                decoded.append(decode_sample(src.manifest.kind, key, parts, src.manifest.token_dtype))
            except Exception as exc:  # noqa: BLE001 - any decode failure is a bad sample by policy
                if src.on_bad_sample == "fail":
                    raise DataError(
                        f"Bad sample {key} in shard {shard} of {src.manifest.root}: {exc}. "
                        f"Fix or drop the shard, or set data.on_bad_sample=skip."
                    ) from None
                log.warning("Skipping bad sample %s in shard %s: %s", key, shard, exc)
                decoded.append(None)
                bad += 1
        good = [i for i, d in enumerate(decoded) if d is not None]
        if bad and not good:
            raise DataError(f"Every sample in a window of {length} at position {start} of {src.manifest.root} is bad.")
        for i, d in enumerate(decoded):  # substitute: the next good sample of the window
            if d is None:
                sub = dict(decoded[next((g for g in good if g > i), good[0])])
                sub["bad"] = True
                decoded[i] = sub
        if src.shuffle and length > 1:
            perm = np.random.default_rng([src.seed, self.epoch, start, 11]).permutation(length)
            decoded = [decoded[int(j)] for j in perm]
        return decoded  # type: ignore[return-value]


def _worker_init(_worker_id: int) -> None:
    """Workers leave SIGTERM/SIGUSR1 (SLURM sends them to every process) to the rank, which checkpoints."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


class _PositionedSource:
    """Position bookkeeping shared by the sources: (epoch, batches consumed in it, samples seen)."""

    epoch = batch_in_epoch = samples_seen = mb = 0

    def _epoch_batches(self) -> Iterable[dict[str, Any]]:
        """The rest of the current epoch's batches, from ``batch_in_epoch`` on."""
        raise NotImplementedError

    def batches(self, limit: int | None = None) -> Iterator[dict[str, Any]]:
        """Batches from the current position; advances the position as they are consumed."""
        produced = 0
        while limit is None or produced < limit:
            for batch in self._epoch_batches():
                self.batch_in_epoch += 1
                self.samples_seen += self.mb
                produced += 1
                yield batch
                if limit is not None and produced >= limit:
                    return
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    def rewind(self) -> None:
        """Back to the start of epoch 0 (evaluation reads the same batches every time)."""
        self.epoch, self.batch_in_epoch, self.samples_seen = 0, 0, 0


class StreamingSource(_PositionedSource):
    """Seekable, rank-balanced batches of one manifest split; the trainer's data source.

    ``batches()`` yields collated batches forever (epoch after epoch) from the current position;
    ``state_dict()`` / ``load_state_dict()`` save and restore that position (two integers).
    """

    def __init__(
        self,
        manifest: Manifest,
        split: str,
        collate: Callable[..., dict[str, Any]],
        *,
        micro_batch_size: int,
        rank: int,
        world: int,
        num_workers: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        shuffle_buffer: int = 1000,
        prefetch_factor: int = 2,
        on_bad_sample: str = "skip",
        train: bool = True,
        pin_memory: bool = False,
    ):
        self.manifest, self.split, self.collate = manifest, split, collate
        self.shards = manifest.shards(split)
        self.total = sum(s.samples for s in self.shards)
        self.mb, self.rank, self.world = micro_batch_size, rank, world
        self.num_workers, self.seed, self.shuffle = num_workers, seed, shuffle
        self.window, self.prefetch_factor = shuffle_buffer, prefetch_factor
        self.on_bad_sample, self.train, self.pin_memory = on_bad_sample, train, pin_memory
        self.batches_per_epoch = self.total // (world * micro_batch_size)
        if self.batches_per_epoch == 0:
            raise DataError(
                f"Split {split!r} of {manifest.root} has {self.total} samples, fewer than one batch per rank "
                f"(world {world} x micro batch {micro_batch_size}). Lower data.micro_batch_size or add data."
            )
        self.epoch, self.batch_in_epoch, self.samples_seen = 0, 0, 0

    def _loader(self, epoch: int, start: int) -> DataLoader:
        kwargs: dict[str, Any] = {}
        if self.num_workers > 0:
            kwargs = {"prefetch_factor": self.prefetch_factor, "persistent_workers": False}
        # Own generator: creating loaders never consumes the global torch RNG (exact resume).
        gen = torch.Generator().manual_seed(self.seed * 1000003 + epoch)
        return DataLoader(
            _EpochStream(self, epoch, start), batch_size=None, num_workers=self.num_workers,
            pin_memory=self.pin_memory, generator=gen, worker_init_fn=_worker_init, **kwargs,
        )

    def _epoch_batches(self) -> Iterable[dict[str, Any]]:
        return self._loader(self.epoch, self.batch_in_epoch)

    def state_dict(self) -> dict[str, Any]:
        W = max(1, self.num_workers)
        order = shard_order(len(self.shards), self.seed, self.epoch, self.shuffle)
        nb, per_worker = epoch_layout(self.total, self.world, W, self.mb)
        streams = []
        for w in range(W):  # informational: where each worker of this rank stands
            pos = self.rank * nb * self.mb + self.mb * (sum(per_worker[:w]) + _worker_batches_done(self.batch_in_epoch, w, W))
            off = 0
            for i in order:
                if pos < off + self.shards[i].samples:
                    streams.append({"worker": w, "shard": self.shards[i].name, "sample_in_shard": pos - off})
                    break
                off += self.shards[i].samples
        return {
            "split": self.split, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
            "samples_seen": self.samples_seen, "batches_per_epoch": self.batches_per_epoch,
            "world_size": self.world, "rank": self.rank, "num_workers": self.num_workers,
            "micro_batch_size": self.mb, "seed": self.seed, "workers": streams,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        same = all(state.get(k) == getattr(self, a) for k, a in
                   (("world_size", "world"), ("num_workers", "num_workers"), ("micro_batch_size", "mb"), ("seed", "seed")))
        self.samples_seen = int(state.get("samples_seen", 0))
        if same:
            self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
        else:  # another topology cannot continue the same sequence; start the next epoch cleanly
            log.warning("Data topology changed since the checkpoint; continuing at the start of epoch %d.", state["epoch"] + 1)
            self.epoch, self.batch_in_epoch = int(state["epoch"]) + 1, 0


class MapStyleSource(_PositionedSource):
    """Seekable, rank-balanced batches from any map-style dataset (e.g. a labelled TSV for fine-tuning).

    Epoch order is ``rng(seed, epoch)`` over indices (or identity without shuffle); each rank takes
    every ``world``-th index of the first ``nb*world*mb``; resume skips indices, never data.
    ``collate(list_of_items) -> dict`` builds the batch.
    """

    def __init__(self, dataset: Any, collate: Callable[[list[Any]], dict[str, Any]], *, micro_batch_size: int,
                 rank: int = 0, world: int = 1, seed: int = 0, shuffle: bool = True, num_workers: int = 0):
        self.dataset, self.collate, self.mb = dataset, collate, micro_batch_size
        self.rank, self.world, self.seed, self.shuffle, self.num_workers = rank, world, seed, shuffle, num_workers
        self.batches_per_epoch = len(dataset) // (world * micro_batch_size)
        if self.batches_per_epoch == 0:
            raise DataError(f"The dataset has {len(dataset)} items, fewer than one batch per rank ({world} x {micro_batch_size}).")
        self.epoch, self.batch_in_epoch, self.samples_seen = 0, 0, 0

    def _indices(self, epoch: int) -> list[int]:
        n = len(self.dataset)
        order = np.random.default_rng([self.seed, epoch, 13]).permutation(n) if self.shuffle else np.arange(n)
        used = order[: self.batches_per_epoch * self.world * self.mb]
        return [int(i) for i in used[self.rank:: self.world]]

    def _epoch_batches(self) -> Iterable[dict[str, Any]]:
        idx = self._indices(self.epoch)[self.batch_in_epoch * self.mb:]
        batched = [idx[i: i + self.mb] for i in range(0, len(idx), self.mb)]
        gen = torch.Generator().manual_seed(self.seed * 1000003 + self.epoch)
        return DataLoader(batched, batch_size=None, num_workers=self.num_workers, generator=gen, worker_init_fn=_worker_init,
                          collate_fn=lambda b: self.collate([self.dataset[i] for i in b]))

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "samples_seen": self.samples_seen,
                "world_size": self.world, "micro_batch_size": self.mb, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
        self.samples_seen = int(state.get("samples_seen", 0))
