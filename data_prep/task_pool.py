"""Run the parallel stages as plain Ray tasks: balanced file chunks, at most `workers` at a time.

Why not Ray Data here: on small and medium jobs its streaming executor, block splitting and
sort-based shuffle (sample -> map -> reduce, three task waves) left the workers idle most of the
time. The text and image stages are a classic hash-partitioned shuffle instead: each map task
reads, cleans and tokenizes a chunk of files and returns one Arrow table per reduce group
(`num_returns`), kept in Ray's object store; each reduce task receives its group's tables from
every map task, deduplicates by content hash and writes its shards. The driver only submits
tasks and collects small records; it never touches documents.
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["chunk_entries", "run_limited"]


def chunk_entries(entries: Sequence[dict[str, Any]], n: int) -> list[list[dict[str, Any]]]:
    """Split input files (or ranges of files, `data_prep.ranges`) into at most `n` chunks of similar total size, largest first.

    Greedy longest-processing-time assignment in a fixed order, so the chunking is reproducible
    (it does not affect the output anyway: every shard sorts its documents by hash).
    """
    n = max(1, min(n, len(entries)))
    heap = [(0, k) for k in range(n)]
    chunks: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    for e in sorted(entries, key=lambda e: (-e["size"], e["path"], e["source"], e.get("span") or [])):
        load, k = heapq.heappop(heap)
        chunks[k].append(e)
        heapq.heappush(heap, (load + e["size"] + 1, k))
    loads = {k: load for load, k in heap}
    return [chunks[k] for k in sorted(range(n), key=lambda k: (-loads[k], k)) if chunks[k]]


def run_limited(
    remote_fn, calls: Sequence[tuple], workers: int, *, num_returns: int = 1, progress: str = "", on_done: Callable[[int], None] | None = None
) -> list[Any]:
    """Submit `remote_fn.remote(*args)` for each call with at most `workers` running at once.

    Returns the ObjectRef (or list of refs when `num_returns` > 1) of every call, in call order,
    all complete. Limiting in-flight tasks is what makes `num_workers` mean what it says on a
    bigger cluster. A failed task raises its exception here. `on_done(i)` runs as call i ends.
    """
    import ray

    fn = remote_fn.options(num_returns=num_returns) if num_returns != 1 else remote_fn
    refs: list[Any] = [None] * len(calls)
    inflight: dict[Any, int] = {}
    bar = _progress_bar(progress, len(calls))
    nxt = 0
    while nxt < len(calls) or inflight:
        while nxt < len(calls) and len(inflight) < max(1, workers):
            refs[nxt] = fn.remote(*calls[nxt])
            inflight[refs[nxt][0] if num_returns > 1 else refs[nxt]] = nxt
            nxt += 1
        ready, _ = ray.wait(list(inflight), num_returns=1)
        for ref in ready:
            i = inflight.pop(ref)
            ray.get(ref)  # re-raise a task's error now, naming the stage
            if on_done:
                on_done(i)
            if bar:
                bar.update(1)
    if bar:
        bar.close()
    return refs


def _progress_bar(desc: str, total: int):
    if not desc:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="task", file=sys.stderr, leave=False)
