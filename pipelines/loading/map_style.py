"""Map-style datasets (e.g. a labelled TSV for fine-tuning) as seekable, rank-balanced batches, and the
evaluation plan both sources share: one pass, every sample on exactly one rank, as many forwards on each."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from core.corpus import DataError
from pipelines.loading.workers import loader_kwargs

__all__ = ["MapStyleSource", "evaluation_plan", "whole_split_limit"]


class _PositionedSource:
    """Position bookkeeping shared by the map-style source: (epoch, batches consumed in it, samples seen)."""

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


class MapStyleSource(_PositionedSource):
    """Seekable, rank-balanced batches from any map-style dataset (e.g. a labelled TSV for fine-tuning).

    Epoch order is ``rng(seed, epoch)`` over indices (or identity without shuffle); each rank takes
    every ``world``-th index of the first ``nb*world*mb``; resume skips indices, never data.
    ``collate(list_of_items) -> dict`` builds the batch (called with ``epoch=`` too when it has a true
    ``takes_epoch`` attribute: a training batch's random augmentation per epoch). ``filler``: keep the last partial batch (an
    epoch then sees every item, as a ``DataLoader`` with ``drop_last=False``); ``filler`` is an item
    its collate and task mark invalid (e.g. ``valid: False``), given to a rank whose share of the last
    batch is empty. Without it the last ``len % (world*mb)`` items of each epoch's order are left out.
    ``preload``: modules the workers' forkserver imports once (``workers.worker_context``).
    """

    def __init__(self, dataset: Any, collate: Callable[[list[Any]], dict[str, Any]], *, micro_batch_size: int,
                 rank: int = 0, world: int = 1, seed: int = 0, shuffle: bool = True, num_workers: int = 0,
                 start_method: str = "forkserver", filler: Any = None, preload: tuple[str, ...] = ()):
        self.dataset, self.collate, self.mb = dataset, collate, micro_batch_size
        self.rank, self.world, self.seed, self.shuffle, self.num_workers = rank, world, seed, shuffle, num_workers
        self.start_method, self.filler, self.preload = start_method, filler, preload
        per_batch = world * micro_batch_size
        self.batches_per_epoch = -(-len(dataset) // per_batch) if filler is not None else len(dataset) // per_batch
        if self.batches_per_epoch == 0:
            raise DataError(f"The dataset has {len(dataset)} items, fewer than one batch per rank ({world} x {micro_batch_size}).")
        self.epoch, self.batch_in_epoch, self.samples_seen = 0, 0, 0

    def _indices(self, epoch: int) -> list[int]:
        """This rank's item indices for ``epoch`` in order; -1 stands for the filler."""
        n = len(self.dataset)
        order = np.random.default_rng([self.seed, epoch, 13]).permutation(n) if self.shuffle else np.arange(n)
        slots = self.batches_per_epoch * self.world * self.mb
        used = np.concatenate([order, np.full(max(0, slots - n), -1)])[:slots]
        return [int(i) for i in used[self.rank:: self.world]]

    def _stream(self, epoch: int, start: int, count: int | None) -> Iterator[dict[str, Any]]:
        while True:  # one loader per epoch
            yield from self._epoch_loader(epoch, start)
            epoch, start = epoch + 1, 0

    def _epoch_loader(self, epoch: int, start: int) -> DataLoader:
        idx = self._indices(epoch)[start * self.mb:]
        batched = [idx[i: i + self.mb] for i in range(0, len(idx), self.mb)]
        gen = torch.Generator().manual_seed(self.seed * 1000003 + epoch)
        # a collate that augments (``takes_epoch``) draws from (seed, epoch, item): the same after a resume
        collate = functools.partial(self.collate, epoch=epoch) if getattr(self.collate, "takes_epoch", False) else self.collate
        return DataLoader(batched, batch_size=None, num_workers=self.num_workers, generator=gen,
                          collate_fn=functools.partial(_collate_items, self.dataset, collate, self.filler),
                          **loader_kwargs(self.num_workers, self.start_method, self.preload))

    def evaluation_batches(self, limit: int | None = None) -> Iterator[tuple[dict[str, Any], bool]]:
        """One pass over the dataset in its order, every item exactly once across ranks: ``(batch, counted)``
        (see ``evaluation_plan``); the training position is neither used nor moved."""
        plan = evaluation_plan(len(self.dataset), self.mb, self.rank, self.world, limit)
        batched = [list(range(start, start + size)) for start, size, _ in plan]
        loader = DataLoader(batched, batch_size=None, num_workers=self.num_workers,
                            generator=torch.Generator().manual_seed(self.seed),
                            collate_fn=functools.partial(_collate_items, self.dataset, self.collate, None),
                            **loader_kwargs(self.num_workers, self.start_method, self.preload))
        for batch, (_, _, counted) in zip(loader, plan, strict=True):
            yield batch, counted

    def eval_limit(self, limit: int) -> int:
        return whole_split_limit(len(self.dataset), self.mb, self.world, limit)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "samples_seen": self.samples_seen,
                "world_size": self.world, "micro_batch_size": self.mb, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
        self.samples_seen = int(state.get("samples_seen", 0))


def whole_split_limit(total: int, mb: int, world: int, limit: int) -> int:
    """``limit`` as ``evaluation_plan`` applies it: 0 (the whole split) when it reaches the split's last batch, so
    a release card does not call an evaluation of every sample a part of the split."""
    return 0 if not limit or limit >= math.ceil(total / (world * mb)) else limit


def evaluation_plan(total: int, mb: int, rank: int, world: int, limit: int | None = None) -> list[tuple[int, int, bool]]:
    """This rank's micro-batches of one evaluation pass over ``total`` samples: ``(first sample, size, counted)``.

    Global batch b is samples ``[b W mb, (b+1) W mb)`` and rank r takes its r-th block of ``mb``, so the
    ranks together read every sample exactly once, the last partial batch included. Every rank runs
    the same number of forward passes (``ceil(total / (W mb))``, or ``limit``), because ZeRO-3 and
    sharded models gather parameters collectively in each forward: a rank whose block of the last
    batch is empty runs one sample (the split's last) that is not counted, instead of leaving its
    peers waiting.
    """
    per_global = world * mb
    count = math.ceil(total / per_global)
    if limit:
        count = min(count, limit)
    plan = []
    for b in range(count):
        start = b * per_global + rank * mb
        size = max(0, min(mb, total - start))
        plan.append((start, size, True) if size else (total - 1, 1, False))
    return plan


def _collate_items(dataset: Any, collate: Callable[[list[Any]], dict[str, Any]], filler: Any,
                   indices: list[int]) -> dict[str, Any]:
    """One batch of a map-style dataset (a module-level function: workers may be started by pickling).

    Filler slots (-1) are left out, so the last batch is simply smaller; only a rank whose last batch
    would be empty gets one filler (every rank must take the step)."""
    return collate([dataset[i] for i in indices if i >= 0] or [filler])
