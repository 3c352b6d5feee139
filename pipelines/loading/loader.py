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
   batch is the next one due; one loader runs epoch after epoch (the rotation is re-derived per
   epoch), so epoch boundaries cost no worker start-up.
4. Shuffle: block shuffle. Each worker's span is cut into windows of ``shuffle_buffer`` samples,
   each permuted by ``rng(seed, epoch, window start)``. Seeking costs at most one window re-read;
   the trade-off against a rolling buffer is that samples only mix within a window (plus the
   per-epoch shard permutation). A window is read at once but each sample is decoded only when
   its batch is built, so a batch never waits for the whole window's decoding.

Reading (``shard_io.ShardReader``, one per worker): local shards are read by seeking through their
index, ``pipe:`` URLs (``data.url_prefix``) in one streaming pass per worker span, hashed on the way.

Bad samples (undecodable, truncated shard) keep their slot: with ``on_bad_sample=skip`` they are
replaced by another sample of the same window (deterministically), counted, and logged with the
shard and key, so counts stay equal and nothing hangs. More than ``max_bad_share`` of the samples a
worker has read (at least one per 1000 allowed) stops the run with an error naming the shard: a
truncated shard never trains silently. Decoding uses numpy/json/PIL only.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from core.corpus import DataError, Manifest, ShardInfo, load_manifest, verify_shards
from pipelines.loading.shard_io import ShardReader, decode_sample, read_samples
from pipelines.loading.workers import loader_kwargs, worker_context

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


class _Stream(IterableDataset):
    """One rank's batches from ``(epoch, start_batch)`` on, epoch after epoch (``count`` of them, or
    without end); collated inside the worker.

    The loader's k-th batch comes from worker ``k % W`` (DataLoader polls workers in turn), so a
    worker derives, per epoch, which logical worker's batches (``b % W == w``) are its own. One
    loader (one set of worker processes) thus serves the whole run: workers run on into the next
    epoch while the current one's last batches are consumed, so an epoch boundary costs no worker
    start-up and no wait for the next epoch's first window.
    """

    def __init__(self, src: StreamingSource, epoch: int, start_batch: int, count: int | None):
        self.src, self.epoch, self.start_batch, self.count = src, epoch, start_batch, count

    def __iter__(self) -> Iterator[dict[str, Any]]:
        src, W = self.src, max(1, self.src.num_workers)
        info = get_worker_info()
        p = info.id if info else 0
        epoch, start, base = self.epoch, self.start_batch, 0  # base: loader index of batch `start` of `epoch`
        reader = _Reader(src)
        try:
            while self.count is None or base < self.count:
                end = src.batches_per_epoch if self.count is None else min(src.batches_per_epoch, start + self.count - base)
                yield from self._epoch(epoch, (p + start - base) % W, start, end, reader)
                base += src.batches_per_epoch - start
                epoch, start = epoch + 1, 0
        finally:
            reader.close()

    def _epoch(self, epoch: int, w: int, start: int, end: int, reader: _Reader) -> Iterator[dict[str, Any]]:
        """Logical worker ``w``'s batches ``b`` of ``epoch`` with ``start <= b < end``."""
        src, W = self.src, max(1, self.src.num_workers)
        order = [src.shards[i] for i in shard_order(len(src.shards), src.seed, epoch, src.shuffle)]
        nb, per_worker = epoch_layout(src.total, src.world, W, src.mb)
        span_start = src.rank * nb * src.mb + src.mb * sum(per_worker[:w])
        pos = _worker_batches_done(start, w, W) * src.mb
        stop = _worker_batches_done(end, w, W) * src.mb
        window = src.window if src.shuffle and src.window > 1 else src.mb
        k = pos // window
        samples: list[dict[str, Any]] = []
        while k * window < stop:
            lo = k * window
            hi = min(lo + window, per_worker[w] * src.mb)  # the window's extent does not depend on where we stop
            block = _Window(src, epoch, order, span_start + lo, hi - lo, reader)
            for j in range(max(0, pos - lo), min(hi, stop) - lo):
                samples.append(block.sample(j))
                if len(samples) == src.mb:
                    yield src.collate(samples, epoch=epoch, train=src.train)
                    samples = []
            k += 1


class _Reader(ShardReader):
    """A worker's shard reader plus its running count of samples decoded and found bad."""

    def __init__(self, src: StreamingSource):
        super().__init__(src.manifest, verify=src.verify_checksums)
        self.seen = self.bad = 0


class _Window:
    """One shuffle window: its raw samples are read at once (cheap), each is decoded when it is taken.

    Decoding lazily means the first batch of a window waits for the tar read only, not for decoding
    the whole window (PNG decode is most of an image loader's time). A bad sample keeps its slot and
    is replaced by the next good sample of the window in read order (the first good one after the
    end), counted via ``bad``; the result is the same whatever order the slots are taken in.
    """

    def __init__(self, src: StreamingSource, epoch: int, order: list[ShardInfo], start: int, length: int, reader: _Reader):
        self.src, self.start, self.reader = src, start, reader
        self.raw = list(read_samples(src.manifest, order, start, length, reader))
        self.perm = (np.random.default_rng([src.seed, epoch, start, 11]).permutation(length)
                     if src.shuffle and length > 1 else np.arange(length))
        self.decoded: dict[int, dict[str, Any] | None] = {}

    def sample(self, j: int) -> dict[str, Any]:
        """The sample in shuffled slot ``j``."""
        i = int(self.perm[j])
        got = self._decode(i)
        if got is not None:
            return got
        n = len(self.raw)
        for g in (*range(i + 1, n), *range(i)):
            sub = self._decode(g)
            if sub is not None:
                return {**sub, "bad": True}
        raise DataError(f"Every sample in a window of {n} at position {self.start} of {self.src.manifest.root} is bad.")

    def _decode(self, i: int) -> dict[str, Any] | None:
        if i in self.decoded:
            return self.decoded[i]
        src, reader = self.src, self.reader
        shard, key, parts = self.raw[i]
        reader.seen += 1
        try:
            if isinstance(parts, str):
                raise ValueError(parts)
            out = decode_sample(src.manifest.kind, key, parts, src.manifest.token_dtype)
        except Exception as exc:  # noqa: BLE001 - any decode failure is a bad sample by policy
            if src.on_bad_sample == "fail":
                raise DataError(
                    f"Bad sample {key} in shard {shard} of {src.manifest.root}: {exc}. "
                    f"Fix or drop the shard, or set data.on_bad_sample=skip."
                ) from None
            log.warning("Skipping bad sample %s in shard %s: %s", key, shard, exc)
            reader.bad += 1
            if reader.bad > src.max_bad_share * max(reader.seen, 1000):
                raise DataError(
                    f"{reader.bad} of the {reader.seen} samples read from {src.manifest.root} are bad (more than "
                    f"data.max_bad_share={src.max_bad_share}); the latest, {key} in shard {shard}: {exc}. The shard is "
                    f"truncated or corrupt: restore it or re-run `pretrain prepare` (or raise data.max_bad_share)."
                ) from None
            out = None
        self.decoded[i] = out
        return out


class _PositionedSource:
    """Position bookkeeping shared by the sources: (epoch, batches consumed in it, samples seen)."""

    epoch = batch_in_epoch = samples_seen = mb = batches_per_epoch = 0

    def _stream(self, epoch: int, start: int, count: int | None) -> Iterator[dict[str, Any]]:
        """``count`` batches (None: without end) from batch ``start`` of ``epoch`` on, across epochs."""
        raise NotImplementedError

    def batches(self, limit: int | None = None) -> Iterator[dict[str, Any]]:
        """Batches from the current position; advances the position as they are consumed."""
        produced, stream = 0, None
        while limit is None or produced < limit:
            if self.batch_in_epoch >= self.batches_per_epoch:
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
            if stream is None:
                stream = self._stream(self.epoch, self.batch_in_epoch, None if limit is None else limit - produced)
            batch = next(stream)
            self.batch_in_epoch += 1
            self.samples_seen += self.mb
            produced += 1
            yield batch

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
        max_bad_share: float = 0.001,
        verify_checksums: bool = True,
        train: bool = True,
        pin_memory: bool = False,
        start_method: str = "forkserver",
    ):
        self.manifest, self.split, self.collate = manifest, split, collate
        self.shards = manifest.shards(split)
        self.total = sum(s.samples for s in self.shards)
        self.mb, self.rank, self.world = micro_batch_size, rank, world
        self.num_workers, self.seed, self.shuffle = num_workers, seed, shuffle
        self.window, self.prefetch_factor = shuffle_buffer, prefetch_factor
        self.on_bad_sample, self.train, self.pin_memory = on_bad_sample, train, pin_memory
        self.max_bad_share, self.verify_checksums = max_bad_share, verify_checksums
        self.start_method = start_method
        if num_workers > 0:
            worker_context(start_method)  # the forkserver starts now, while the model is being built
        self.batches_per_epoch = self.total // (world * micro_batch_size)
        if self.batches_per_epoch == 0:
            raise DataError(
                f"Split {split!r} of {manifest.root} has {self.total} samples, fewer than one batch per rank "
                f"(world {world} x micro batch {micro_batch_size}). Lower data.micro_batch_size or add data."
            )
        self.epoch, self.batch_in_epoch, self.samples_seen = 0, 0, 0

    def _stream(self, epoch: int, start: int, count: int | None) -> Iterator[dict[str, Any]]:
        return iter(self._loader(epoch, start, count))

    def _loader(self, epoch: int, start: int, count: int | None = None) -> DataLoader:
        kwargs = loader_kwargs(self.num_workers, self.start_method)
        if self.num_workers > 0:
            kwargs.update(prefetch_factor=self.prefetch_factor, persistent_workers=False)
        # Own generator: creating loaders never consumes the global torch RNG (exact resume).
        gen = torch.Generator().manual_seed(self.seed * 1000003 + epoch)
        return DataLoader(
            _Stream(self, epoch, start, count), batch_size=None, num_workers=self.num_workers,
            pin_memory=self.pin_memory, generator=gen, **kwargs,
        )

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
                 rank: int = 0, world: int = 1, seed: int = 0, shuffle: bool = True, num_workers: int = 0,
                 start_method: str = "forkserver"):
        self.dataset, self.collate, self.mb = dataset, collate, micro_batch_size
        self.rank, self.world, self.seed, self.shuffle, self.num_workers = rank, world, seed, shuffle, num_workers
        self.start_method = start_method
        self.batches_per_epoch = len(dataset) // (world * micro_batch_size)
        if self.batches_per_epoch == 0:
            raise DataError(f"The dataset has {len(dataset)} items, fewer than one batch per rank ({world} x {micro_batch_size}).")
        self.epoch, self.batch_in_epoch, self.samples_seen = 0, 0, 0

    def _indices(self, epoch: int) -> list[int]:
        n = len(self.dataset)
        order = np.random.default_rng([self.seed, epoch, 13]).permutation(n) if self.shuffle else np.arange(n)
        used = order[: self.batches_per_epoch * self.world * self.mb]
        return [int(i) for i in used[self.rank:: self.world]]

    def _stream(self, epoch: int, start: int, count: int | None) -> Iterator[dict[str, Any]]:
        while True:  # one loader per epoch
            yield from self._epoch_loader(epoch, start)
            epoch, start = epoch + 1, 0

    def _epoch_loader(self, epoch: int, start: int) -> DataLoader:
        idx = self._indices(epoch)[start * self.mb:]
        batched = [idx[i: i + self.mb] for i in range(0, len(idx), self.mb)]
        gen = torch.Generator().manual_seed(self.seed * 1000003 + epoch)
        return DataLoader(batched, batch_size=None, num_workers=self.num_workers, generator=gen,
                          collate_fn=functools.partial(_collate_items, self.dataset, self.collate),
                          **loader_kwargs(self.num_workers, self.start_method))

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "samples_seen": self.samples_seen,
                "world_size": self.world, "micro_batch_size": self.mb, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
        self.samples_seen = int(state.get("samples_seen", 0))


def _collate_items(dataset: Any, collate: Callable[[list[Any]], dict[str, Any]], indices: list[int]) -> dict[str, Any]:
    """One batch of a map-style dataset (a module-level function: workers may be started by pickling)."""
    return collate([dataset[i] for i in indices])
