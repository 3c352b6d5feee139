"""The memory allocator of the prep workers: a faster `malloc` preloaded into the Ray tasks.

Why: tokenizing is most of a text job's CPU time, and a profile of `encode_batch_fast` on our
benchmark corpus (`benchmarks/corpus_text.py`) spends over a third of it in glibc's `malloc`,
`realloc` and `free` (many small strings and vectors per token). The same call with tcmalloc
preloaded ran 1.46x faster, with mimalloc 1.38x, with the jemalloc that Ray's wheel bundles 1.21x
(`docs/benchmarks.md`, prep_throughput). The tokens are the same: an allocator never changes what
a program computes, so shards stay byte-identical whichever one runs.

How: the tasks run with ``LD_PRELOAD`` set through Ray's ``runtime_env`` (Ray starts their worker
processes with it); the driver process is left as it is. ``worker_malloc: auto`` takes the first
library found of tcmalloc (Debian/Ubuntu: ``libtcmalloc-minimal4``), mimalloc and Ray's own
jemalloc; ``system`` keeps glibc's; a path names a library. Linux only (elsewhere ``auto`` means
``system``). On a multi-node cluster the chosen path must exist on every node; a node without it
prints the dynamic loader's "cannot be preloaded ... ignored" and runs with its system allocator.
"""

from __future__ import annotations

import ctypes.util
import functools
import os
import sys
from pathlib import Path

from data_prep.errors import PrepError

__all__ = ["find_worker_malloc", "worker_runtime_env"]

# names for ctypes.util.find_library, fastest first (measured, see the module docstring)
_SYSTEM_LIBRARIES = ("tcmalloc_minimal", "tcmalloc", "mimalloc")
# tcmalloc reports every allocation above 1 GiB on stderr; our big Arrow/numpy buffers are expected
_ENV = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)}


def _ray_jemalloc() -> str | None:
    try:
        import ray
    except ImportError:
        return None
    path = Path(ray.__file__).parent / "core" / "libjemalloc.so"
    return str(path) if path.is_file() else None


def find_worker_malloc(choice: str) -> str | None:
    """The library to preload for `choice` (``auto``, ``system`` or a path); None = the system allocator."""
    if choice == "system":
        return None
    if choice != "auto":
        path = Path(choice).expanduser()
        if not path.is_file():
            raise PrepError(
                f"worker_malloc={choice!r}: no such file. Give the path of a malloc library to preload into the "
                f"prep workers (e.g. /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4), or `auto` / `system`."
            )
        return str(path.resolve())
    return _auto_library() if sys.platform.startswith("linux") else None


@functools.cache  # find_library runs `ldconfig -p`; a job asks once per stage
def _auto_library() -> str | None:
    for name in _SYSTEM_LIBRARIES:
        found = ctypes.util.find_library(name)  # the soname from the loader's cache; never loaded here
        if found:
            return found
    return _ray_jemalloc()


def worker_runtime_env(choice: str) -> dict | None:
    """Ray ``runtime_env`` that starts the prep tasks' workers with the chosen allocator (None: as they are)."""
    library = find_worker_malloc(choice)
    if library is None:
        return None
    preload = " ".join(p for p in (library, os.environ.get("LD_PRELOAD", "")) if p)
    return {"env_vars": {"LD_PRELOAD": preload, **_ENV}}
