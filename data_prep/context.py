"""``JobContext``: everything a prep worker task needs, typed, built by ``data_prep.job`` in phases.

The driver fills it as the job learns things (the tokenizer, then the shard plan, then the reduce
groups) and ships it to the Ray tasks once per phase (``ray.put``); tasks only read it. Configs travel
as plain dicts (``to_dict``) so a worker rebuilds them without the driver's objects.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class JobContext:
    # from the prep config
    kind: str
    sources: list[dict[str, Any]]
    clean: dict[str, Any]
    images: dict[str, Any]
    seed: int
    seq_len: int
    short_seq_prob: float
    nsp_random_prob: float
    dupe_factor: int
    validation_fraction: float
    output: str
    job_id: str  # workers build the tokenizer afresh for every job (no warm caches across jobs)
    # once the tokenizer is known
    tokenizer_json: str = ""
    tokenizer_sha256: str = ""
    special: dict[str, int] = field(default_factory=dict)
    token_dtype: str | None = None
    # once the input is sized and deduplicated
    buckets: dict[str, int] = field(default_factory=dict)  # split -> number of shards
    fingerprint: str = ""
    near_dups: frozenset[str] = frozenset()
    lsh: tuple[int, int] | None = None  # (bands, rows) of the MinHash pass
    # the reduce plan
    groups: int = 0
    group_of: dict[str, int] = field(default_factory=dict)  # shard name -> reduce group

    def with_(self, **changes: Any) -> JobContext:
        """A copy with ``changes`` (the driver's phases; a context already shipped never changes)."""
        return dataclasses.replace(self, **changes)
