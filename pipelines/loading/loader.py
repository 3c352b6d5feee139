"""Corpus manifests -> seekable, rank-balanced batches in an order no topology changes.

The training sample sequence is a pure function of ``(seed, global position)``: not of the number
of ranks, of loader workers or of the micro-batch size. A run therefore resumes exactly on another
world size or worker count (same global batch: no sample repeated, none skipped), and a checkpoint
stores one integer per corpus.

1. Corpus sequence (``CorpusSequence``): epoch e permutes the split's shards with ``rng(seed, e)``
   and concatenates their samples (manifest counts, T in all); global index k is sample ``k % T``
   of epoch ``k // T``. Epochs follow each other without a dropped tail.
2. Shuffle: the concatenation is cut into windows of ``shuffle_buffer`` samples, each permuted by
   ``rng(seed, epoch, window start)``; seeking costs at most one window read. Samples mix within a
   window (plus the per-epoch shard permutation), the trade-off for reading each byte about once.
3. Mixture (``data.corpora``, ``blend.SlotCursor``): global slot q takes the next sample of the
   corpus furthest behind its weight; one corpus maps slot q to k = q.
4. Ranks: optimizer step s consumes the global slots ``[s G, (s+1) G)`` (G = world x micro batch x
   accumulation steps); rank r takes the contiguous block ``[s G + r G/world, s G + (r+1) G/world)``
   cut into its micro-batches, so every rank has the same number of batches and none waits.
5. Workers: a rank's micro-batches go to DataLoader workers in items of consecutive micro-batches,
   item i to worker ``i % W`` — the order in which the DataLoader returns them. Items grow 1, 2, 4,
   ... up to ``group`` micro-batches (about one shuffle window, so each window is read by about one
   worker) in every worker's turn (``item_span``): the first batch after a start or a resume waits
   for one micro-batch, not for ``group`` of them.

Evaluation (``evaluation_batches``, ``evaluation_plan``) reads a split once in order, every sample
on exactly one rank, the last partial batch included; every rank runs as many forwards.

Reading (``shard_io.ShardReader``, one per worker and corpus): local shards by seeking through
their index, ``pipe:`` URLs (``data.url_prefix``) in one forward streaming pass, hashed on the way.

Bad samples (undecodable, truncated shard) keep their slot: with ``on_bad_sample=skip`` they are
replaced by another sample of the same window (deterministically), counted, and logged with the
shard and key, so counts stay equal and nothing hangs. More than ``max_bad_share`` of the samples a
worker has read (at least one per 1000 allowed) stops the run with an error naming the shard: a
truncated shard never trains silently. Decoding uses numpy/json/PIL only. A decoded token sample is
checked against what the model and the corpus allow (``SampleLimits``: its length within the model's
positions and the corpus' seq_len, its ids within the vocabulary; one numpy min/max per record): a
sample that fails is a bad sample like an undecodable one, named with its shard.

One error path: a ``DataError`` raised in a loader worker is handed to the main process as data
(``_Failed``) and raised there with the same one-paragraph message the main process would give,
not as torch's "Caught DataError in DataLoader worker process N" with the worker's traceback.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from core.corpus import DataError, Manifest, ShardInfo, load_manifest, verify_shards
from core.corpus_kinds import corpus_kind
from pipelines.loading.blend import SlotCursor
from pipelines.loading.handover import Packed
from pipelines.loading.map_style import MapStyleSource, evaluation_plan, whole_split_limit
from pipelines.loading.shard_io import Decoded, SampleLimits, ShardReader, decode_sample, read_samples
from pipelines.loading.workers import loader_kwargs, worker_context

__all__ = [
    "DataError",
    "Manifest",
    "ShardInfo",
    "load_manifest",
    "verify_shards",
    "CorpusSequence",
    "StreamingSource",
    "MapStyleSource",
    "shard_order",
    "evaluation_plan",
    "read_samples",
    "decode_sample",
    "SampleLimits",
]

log = logging.getLogger(__name__)

_WINDOWS_KEPT = 2  # per corpus and worker: the window being read and the one before (a batch may straddle)
_MAX_GROUP = 16  # micro-batches per worker item, at most


def item_span(i: int, workers: int, group: int) -> tuple[int, int]:
    """Micro-batches ``[lo, hi)`` (from the stream's first) of worker item ``i``: round ``r = i // workers``
    holds ``workers`` items of ``min(group, 2**r)`` each."""
    r, q = divmod(i, workers)
    ramp = max(0, (group - 1).bit_length())  # rounds before items reach `group`
    size = min(group, 1 << min(r, ramp))
    lo = workers * ((1 << min(r, ramp)) - 1 + max(0, r - ramp) * group) + q * size
    return lo, lo + size


def _identity(item: Any) -> Any:
    """The DataLoader's collate_fn: items are collated in ``_Stream`` already (the default walks every key string)."""
    return item


def shard_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(n))
    return [int(i) for i in np.random.default_rng([seed, epoch, 7]).permutation(n)]


class CorpusSequence:
    """One corpus split's endless sample sequence: global index k -> (epoch, window, slot in it)."""

    def __init__(self, manifest: Manifest, split: str, *, seed: int, shuffle: bool, window: int):
        self.manifest, self.split = manifest, split
        self.shards = manifest.shards(split)
        self.total = sum(s.samples for s in self.shards)
        if self.total == 0:
            raise DataError(f"Split {split!r} of {manifest.path} has no samples. Re-run `pretrain prepare` or pick another split.")
        self.seed, self.shuffle, self.window = seed, shuffle, max(1, window)

    def order(self, epoch: int) -> list[ShardInfo]:
        return [self.shards[i] for i in shard_order(len(self.shards), self.seed, epoch, self.shuffle)]

    def locate(self, k: int) -> tuple[int, int, int, int]:
        """``(epoch, window start, window length, slot in the window)`` of global index ``k``."""
        epoch, offset = divmod(k, self.total)
        start = offset - offset % self.window
        return epoch, start, min(self.window, self.total - start), offset - start

    def permutation(self, epoch: int, start: int, length: int) -> np.ndarray:
        if self.shuffle and length > 1:
            return np.random.default_rng([self.seed, epoch, start, 11]).permutation(length)
        return np.arange(length)


class _Reader(ShardReader):
    """A worker's shard reader for one corpus plus its running count of samples decoded and found bad."""

    def __init__(self, src: StreamingSource, manifest: Manifest):
        super().__init__(manifest, verify=src.verify_checksums, limits=src.limits)
        self.seen = self.bad = 0


class _Failed:
    """A ``DataError`` of a loader worker, passed to the main process as an item so it is raised there as itself."""

    def __init__(self, message: str):
        self.message = message


class _Window:
    """One shuffle window: its raw samples are read at once (cheap), each is decoded when it is taken.

    Decoding lazily means the first batch of a window waits for the tar read only, not for decoding
    the whole window (PNG decode is most of an image loader's time). A bad sample keeps its slot and
    is replaced by the next good sample of the window in read order (the first good one after the
    end), counted via ``bad``; the result is the same whatever order the slots are taken in.
    """

    def __init__(self, src: StreamingSource, seq: CorpusSequence, epoch: int, start: int, length: int, reader: _Reader):
        self.src, self.seq, self.start, self.reader = src, seq, start, reader
        self.raw = list(read_samples(seq.manifest, seq.order(epoch), start, length, reader))
        self.perm = seq.permutation(epoch, start, length)
        self.decoded: dict[int, dict[str, Any] | None] = {}

    def take(self, j0: int, j1: int, epoch: int, out: list[dict[str, Any]]) -> None:
        """Append the samples in shuffled slots ``j0 .. j1-1``, marked with ``epoch``. A format-2 token
        sample was decoded and checked with its record (read-only arrays: nothing to copy or check)."""
        raw, fast = self.raw, 0
        for j, i in enumerate(self.perm[j0:j1].tolist(), j0):
            parts = raw[i][2]
            if type(parts) is Decoded:
                out.append({**parts, "epoch": epoch})
                fast += 1
            else:  # anything else (an error entry, format 1, an image) decodes and counts itself
                out.append({**self.sample(j), "epoch": epoch})
        self.reader.seen += fast

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
        raise DataError(f"Every sample in a window of {n} at position {self.start} of {self.seq.manifest.root} is bad.")

    def _decode(self, i: int) -> dict[str, Any] | None:
        if i in self.decoded:
            return self.decoded[i]
        src, reader, m = self.src, self.reader, self.seq.manifest
        shard, key, parts = self.raw[i]
        reader.seen += 1
        try:
            if isinstance(parts, str):
                raise ValueError(parts)
            out = decode_sample(m.kind, key, parts, m.token_dtype)
            if not isinstance(parts, Decoded):  # a format-2 record was checked as a whole when it was read
                reader.limits.check(out)
        except Exception as exc:  # noqa: BLE001 - any decode failure is a bad sample by policy
            if src.on_bad_sample == "fail":
                raise DataError(
                    f"Bad sample {key} in shard {shard} of {m.root}: {exc}. "
                    f"Fix or drop the shard, or set data.on_bad_sample=skip."
                ) from None
            log.warning("Skipping bad sample %s in shard %s: %s", key, shard, exc)
            reader.bad += 1
            if reader.bad > src.max_bad_share * max(reader.seen, 1000):
                raise DataError(
                    f"{reader.bad} of the {reader.seen} samples read from {m.root} are bad (more than "
                    f"data.max_bad_share={src.max_bad_share}); the latest, {key} in shard {shard}: {exc}. The shard is "
                    f"truncated or corrupt: restore it or re-run `pretrain prepare` (or raise data.max_bad_share)."
                ) from None
            out = None
        self.decoded[i] = out
        return out


class _Samples:
    """What one worker reads: per corpus a shard reader and its last few windows."""

    def __init__(self, src: StreamingSource):
        self.src = src
        self.readers = [_Reader(src, seq.manifest) for seq in src.sequences]
        self.windows: list[OrderedDict[tuple[int, int], _Window]] = [OrderedDict() for _ in src.sequences]

    def get(self, c: int, k: int) -> dict[str, Any]:
        """Sample ``k`` of corpus ``c``'s sequence, marked with its epoch (and its corpus, in a mixture)."""
        seq = self.src.sequences[c]
        epoch, start, length, j = seq.locate(k)
        s = {**self._window(c, seq, epoch, start, length).sample(j), "epoch": epoch}
        if len(self.src.sequences) > 1:
            s["key"] = f"{self.src.names[c]}/{s['key']}"
        return s

    def run(self, c: int, k: int, n: int) -> list[dict[str, Any]]:
        """Samples ``k .. k+n-1`` of corpus ``c``'s sequence (one corpus: ``get`` for each, a window at a time)."""
        seq, out = self.src.sequences[c], []
        while n > 0:
            epoch, start, length, j = seq.locate(k)
            step = min(n, length - j)
            self._window(c, seq, epoch, start, length).take(j, j + step, epoch, out)
            k, n = k + step, n - step
        return out

    def _window(self, c: int, seq: CorpusSequence, epoch: int, start: int, length: int) -> _Window:
        cache = self.windows[c]
        win = cache.get((epoch, start))
        if win is None:
            win = cache[(epoch, start)] = _Window(self.src, seq, epoch, start, length, self.readers[c])
            while len(cache) > _WINDOWS_KEPT:
                cache.popitem(last=False)
        return win

    def close(self) -> None:
        for r in self.readers:
            r.close()


class _Stream(IterableDataset):
    """One rank's micro-batches ``first, first+1, ...`` (``count`` of them, or without end) of the
    steps starting at global slot ``origin``, in items of ``group`` micro-batches, collated in the worker.

    Worker ``p`` of ``W`` builds items ``p, p+W, ...``: the DataLoader returns item i from worker
    ``i % W``, so the loader yields the micro-batches in order whatever W is.
    """

    def __init__(self, src: StreamingSource, cursor: dict[str, Any], origin: int, first: int, count: int | None,
                 plan: list[tuple[int, int]] | None = None):
        self.src, self.cursor, self.origin, self.first, self.count = src, cursor, origin, first, count
        self.plan = plan  # an evaluation pass: micro-batch j is samples [start, start + size) of corpus 0

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        src = self.src
        info = get_worker_info()
        p, W = (info.id, info.num_workers) if info else (0, 1)
        cursor = SlotCursor.from_state(self.cursor)  # this worker's own copy, moved forward as it reads
        samples = _Samples(src)
        try:
            for item in self._items(src, samples, cursor, p, W):
                yield Packed(item) if info else item
        except DataError as exc:
            if info is None:
                raise
            yield [_Failed(str(exc))]  # raised by the main process: one message, not a worker traceback
        finally:
            samples.close()

    def _items(self, src: StreamingSource, samples: _Samples, cursor: SlotCursor, p: int, W: int) -> Iterator[list[Any]]:
        """Worker ``p`` of ``W``'s items: ``group`` collated micro-batches each."""
        i = p
        while True:
            lo, hi = (self.first + x for x in item_span(i, W, src.group))
            if self.count is not None:
                hi = min(hi, self.first + self.count)
            if lo >= hi:
                return
            item = []
            for j in range(lo, hi):
                if self.plan is not None:
                    batch = samples.run(0, *self.plan[j])
                elif len(src.sequences) == 1:  # one corpus: consecutive indices of its sequence
                    batch = samples.run(0, cursor.take(src.slot(self.origin, j), src.mb)[0][1], src.mb)
                else:
                    batch = [samples.get(c, k) for c, k in cursor.take(src.slot(self.origin, j), src.mb)]
                item.append(src.collate(batch, epoch=batch[0]["epoch"], train=src.train))
            yield item
            i += W


class StreamingSource:
    """Seekable, rank-balanced batches of one corpus split or a weighted mixture; the trainer's data source.

    ``corpus``: a ``Manifest``, or ``[(name, weight, Manifest), ...]`` for a mixture (corpus i > 0
    shuffles with ``seed + 7919 i``). ``batches()`` yields collated micro-batches from the current
    position, ``state_dict()`` / ``load_state_dict()`` save and restore that position, which holds
    on another world size, worker count or micro-batch size as long as the global batch
    (world x micro batch x ``grad_accum``) is the same.
    """

    def __init__(
        self,
        corpus: Manifest | list[tuple[str, float, Manifest]],
        split: str,
        collate: Callable[..., dict[str, Any]],
        *,
        micro_batch_size: int,
        rank: int,
        world: int,
        grad_accum: int = 1,
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
        limits: SampleLimits | None = None,
    ):
        mixture = corpus if isinstance(corpus, list) else [("", 1.0, corpus)]
        if not mixture or any(not w > 0 for _, w, _ in mixture):
            raise DataError("data.corpora needs at least one corpus and every weight > 0 (they are normalised to sum to 1).")
        if len({n for n, _, _ in mixture}) != len(mixture):
            raise DataError(f"data.corpora: names must differ, got {[n for n, _, _ in mixture]}. Set `name:` on each entry.")
        total_weight = sum(w for _, w, _ in mixture)
        self.names = [n for n, _, _ in mixture]
        self.weights = [w / total_weight for _, w, _ in mixture]
        self.sequences = [CorpusSequence(m, split, seed=seed + 7919 * i, shuffle=shuffle, window=shuffle_buffer)
                          for i, (_, _, m) in enumerate(mixture)]
        self.manifest, self.split, self.collate = mixture[0][2], split, collate
        self.mb, self.rank, self.world, self.accum = micro_batch_size, rank, world, grad_accum
        self.global_batch = world * micro_batch_size * grad_accum
        self.num_workers, self.seed, self.shuffle = num_workers, seed, shuffle
        self.window, self.prefetch_factor = shuffle_buffer, prefetch_factor
        self.on_bad_sample, self.train, self.pin_memory = on_bad_sample, train, pin_memory
        self.max_bad_share, self.verify_checksums = max_bad_share, verify_checksums
        self.start_method, self.limits = start_method, limits or SampleLimits()
        self.group = 1 if not corpus_kind(self.manifest.kind).tokenized else max(1, min(_MAX_GROUP, math.ceil(shuffle_buffer / micro_batch_size)))
        if num_workers > 0:
            worker_context(start_method)  # the forkserver starts now, while the model is being built
        # one epoch of the corpus that runs out first (relative to its weight), in this rank's micro-batches
        per_epoch = min(seq.total / w for seq, w in zip(self.sequences, self.weights, strict=True))
        self.batches_per_epoch = int(per_epoch // self.global_batch) * grad_accum
        if self.batches_per_epoch == 0:
            raise DataError(
                f"Split {split!r} of {self.manifest.root} has {self.sequences[0].total} samples, fewer than one global batch "
                f"(world {world} x micro batch {micro_batch_size} x accumulation {grad_accum}). Lower data.micro_batch_size "
                f"or add data."
            )
        self.rewind()

    # ------------------------------------------------------------------------------------ layout
    def slot(self, origin: int, j: int) -> int:
        """The first global slot of this rank's micro-batch ``j`` of the steps starting at ``origin``."""
        step, micro = divmod(j, self.accum)
        return origin + step * self.global_batch + (self.rank * self.accum + micro) * self.mb

    def _rebase(self) -> None:
        """Fold the whole steps consumed into ``origin`` (and move the mixture cursor there)."""
        steps, self.done = divmod(self.done, self.accum)
        self.origin += steps * self.global_batch
        self.cursor.take(self.origin, 0)

    # ----------------------------------------------------------------------------------- reading
    def batches(self, limit: int | None = None) -> Iterator[dict[str, Any]]:
        """Micro-batches from the current position; the position advances as they are consumed."""
        self._rebase()
        kwargs = loader_kwargs(self.num_workers, self.start_method)
        if self.num_workers > 0:
            kwargs.update(prefetch_factor=self.prefetch_factor, persistent_workers=False)
        # Own generator: creating loaders never consumes the global torch RNG (exact resume).
        gen = torch.Generator().manual_seed(self.seed * 1000003 + self.origin)
        loader = DataLoader(_Stream(self, self.cursor.state(), self.origin, self.done, limit), batch_size=None,
                            collate_fn=_identity, num_workers=self.num_workers, pin_memory=self.pin_memory, generator=gen, **kwargs)
        for item in loader:
            for batch in (item.batches() if isinstance(item, Packed) else item):
                if isinstance(batch, _Failed):
                    raise DataError(batch.message)
                self.done += 1
                self.samples_seen += self.mb
                yield batch

    def evaluation_batches(self, limit: int | None = None) -> Iterator[tuple[dict[str, Any], bool]]:
        """One pass over the first corpus's split, every sample exactly once across ranks: ``(batch, counted)``.

        See ``evaluation_plan``; the position of ``batches()`` is neither used nor moved.
        """
        plan = evaluation_plan(self.sequences[0].total, self.mb, self.rank, self.world, limit)
        kwargs = loader_kwargs(self.num_workers, self.start_method)
        if self.num_workers > 0:
            kwargs.update(prefetch_factor=self.prefetch_factor, persistent_workers=False)
        spans = [(start, size) for start, size, _ in plan]
        loader = DataLoader(_Stream(self, SlotCursor(self.weights).state(), 0, 0, len(plan), plan=spans), batch_size=None,
                            collate_fn=_identity, num_workers=self.num_workers, pin_memory=self.pin_memory,
                            generator=torch.Generator().manual_seed(self.seed), **kwargs)
        counted = iter([c for _, _, c in plan])
        for item in loader:
            for batch in (item.batches() if isinstance(item, Packed) else item):
                if isinstance(batch, _Failed):
                    raise DataError(batch.message)
                yield batch, next(counted)

    def eval_limit(self, limit: int) -> int:
        return whole_split_limit(self.sequences[0].total, self.mb, self.world, limit)

    def rewind(self) -> None:
        """Back to the first sample."""
        self.origin, self.done, self.samples_seen = 0, 0, 0
        self.cursor = SlotCursor(self.weights)

    # ---------------------------------------------------------------------------------- position
    def state_dict(self) -> dict[str, Any]:
        self._rebase()
        counts = self.cursor.counts
        return {
            "format": 2, "position": self.origin, "micro_in_step": self.done, "global_batch": self.global_batch,
            "split": self.split, "samples_seen": self.samples_seen, "seed": self.seed,
            "epoch": min(c // seq.total for c, seq in zip(counts, self.sequences, strict=True)),
            "cursor": {**self.cursor.state(), "names": self.names},
            "consumed": {n: c for n, c in zip(self.names, counts, strict=True)} if len(self.names) > 1 else {},
            "corpus_epochs": {n: round(c / seq.total, 4) for n, c, seq in zip(self.names, counts, self.sequences, strict=True)},
            "world_size": self.world, "rank": self.rank, "num_workers": self.num_workers,
            "micro_batch_size": self.mb, "grad_accum": self.accum,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.samples_seen = int(state.get("samples_seen", 0))
        if "position" not in state:  # a checkpoint of the per-rank layout (before the global sequence)
            log.warning("The checkpoint's data position is from an older loader layout; continuing at the start of epoch %d.",
                        state["epoch"] + 1)
            self.origin, self.done = (int(state["epoch"]) + 1) * self.sequences[0].total, 0
            self.cursor = SlotCursor(self.weights, slot=self.origin, counts=[self.origin] + [0] * (len(self.names) - 1))
            return
        position, micro = int(state["position"]), int(state.get("micro_in_step", 0))
        if int(state.get("global_batch", self.global_batch)) != self.global_batch:
            log.warning("The global batch changed from %s to %d samples: the sample sequence goes on at global position %d%s.",
                        state.get("global_batch"), self.global_batch, position,
                        ", the rest of the checkpoint's interrupted step is skipped" if micro else "")
            if micro:
                position, micro = position + int(state["global_batch"]), 0
        self.origin, self.done = position, micro
        self.cursor = SlotCursor.resumed(state["cursor"], self.names, self.weights, position)
        self.cursor.take(position, 0)
