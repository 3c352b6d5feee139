"""Scoring an export on every rank: the dev set's batches dealt out, each run on the rank's device.

Rank 0 used to score the whole dev set alone, on its CPU, while the other ranks waited at a barrier: at
real scale that is the longest part of a fine-tune (ImageNet's 50,000 dev images through a ViT-B/16 are
~1,760 TFLOP: a quarter of an hour on a CPU that sustains 2 TFLOP/s, seconds on a node's GPUs), and a
wait past ``distributed.timeout_minutes`` fails the job. Now rank r runs every world-th batch on its GPU (or CPU)
and the ranks exchange the outputs as raw float32 (``all_gather_bytes``: nothing is unpickled), so every
rank holds every batch's output in order. The batches are the ones one process would run, whole: the
outputs, and so the metrics, do not depend on the number of ranks.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from pipelines.engine.distributed import DistEnv, all_gather_bytes

__all__ = ["scoring_device", "forward_on_ranks", "pack_arrays", "unpack_arrays"]

Batch = TypeVar("Batch")


def scoring_device(env: DistEnv | None) -> torch.device:
    """Where a rank scores: the GPU training ran on (``env``), or any GPU a lone process sees, else the CPU."""
    if env is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device("cuda", torch.cuda.current_device()) if env.device == "cuda" else torch.device("cpu")


def forward_on_ranks(batches: Sequence[Batch], forward: Callable[[Batch], np.ndarray],
                     env: DistEnv | None) -> list[np.ndarray]:
    """``forward(batch)`` of every batch, in order, on every rank; this rank runs batches ``rank::world``.

    Every rank must call it (one collective exchange, whatever its share, empty included)."""
    rank, world = (env.rank, env.world_size) if env is not None else (0, 1)
    mine = [np.ascontiguousarray(forward(b), dtype=np.float32) for b in batches[rank::world]]
    if world == 1:
        return mine
    shares = [unpack_arrays(part) for part in all_gather_bytes(pack_arrays(mine), env)]
    return [shares[i % world][i // world] for i in range(len(batches))]


def pack_arrays(arrays: list[np.ndarray]) -> bytes:
    """float32 arrays as bytes: an 8-byte header length, a JSON list of shapes, then the values, C order."""
    header = json.dumps([list(a.shape) for a in arrays]).encode("utf-8")
    return struct.pack("<Q", len(header)) + header + b"".join(a.astype("<f4", copy=False).tobytes() for a in arrays)


def unpack_arrays(data: bytes) -> list[np.ndarray]:
    """The arrays ``pack_arrays`` wrote (copies: each owns its memory)."""
    (size,) = struct.unpack_from("<Q", data)
    shapes: list[Any] = json.loads(data[8: 8 + size].decode("utf-8"))
    out, at = [], 8 + size
    for shape in shapes:
        n = int(np.prod(shape, dtype=np.int64))
        out.append(np.frombuffer(data, dtype="<f4", count=n, offset=at).reshape(shape).astype(np.float32))
        at += 4 * n
    if at != len(data):
        raise ValueError(f"packed arrays: {len(data) - at} bytes left over after {len(shapes)} arrays")
    return out
