"""How DataLoader worker processes start, and how they treat the job's signals.

Why not plain ``fork`` (torch's default on Linux): a trainer is multi-threaded (gloo, DeepSpeed,
each loader's queue feeder thread), and ``fork()`` copies a process whose other threads may hold
locks at that instant. We caught CPython 3.11 doing exactly this: an evaluation loader's worker
stuck for good in ``PyOS_AfterFork_Child`` -> ``_PyThreadState_DeleteExcept`` (a thread of the
previous loader was exiting while we forked), its rank waiting on it and the other rank waiting
in the all-reduce — a finished run that never exits. Python 3.14 made ``forkserver`` the POSIX
default for this reason. The forkserver is a clean single-threaded process, started once per
trainer (it imports torch and our data modules once, ~1.5 s, overlapping model set-up); every
worker is forked from it, which costs about what a fork of the trainer does (~0.08 s). ``spawn``
starts a fresh interpreter per worker (~2 s each); ``fork`` stays available for scripts that
cannot guard their entry point with ``if __name__ == "__main__":``.

Garbage collection: a worker starts with the forkserver's whole heap (torch's ~170k objects). The
first full collection in the worker walks all of them, touching every page (copy-on-write faults):
0.15 s of the first batch's 0.19 s on the 2-core VM, and every later full collection again. Each
worker therefore freezes what it inherited (``gc.freeze``, as the ``gc`` docs advise for fork
servers); its collections then scan only its own objects.

Signals: SLURM delivers the pre-emption warning (USR1) and SIGTERM to *every* process of the job
step, a terminal its Ctrl-C (SIGINT) to every process of the foreground job, and torch's launcher each
of them to a rank's whole process group; the trainer checkpoints on them, its workers and the
forkserver must just survive (a worker that took Ctrl-C as torch's do would end, and its rank's next
batch with it). SIGUSR2
makes every process print its Python stacks (``scancel --signal=USR2 JOB`` on a job that seems
hung).
"""

from __future__ import annotations

import atexit
import faulthandler
import functools
import gc
import multiprocessing
import os
import select
import signal
import threading
import time
from typing import Any

START_METHODS = ("forkserver", "spawn", "fork")
# Modules a worker needs; the forkserver imports them once so that each worker starts in ~0.1 s.
_PRELOAD = ["pipelines.loading.loader", "pipelines.engine.objectives"]
_JOB_SIGNALS = {signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGUSR2}


def worker_context(method: str, preload: tuple[str, ...] = ()) -> Any:
    """The multiprocessing context to pass as ``DataLoader(multiprocessing_context=...)``. ``preload``: modules
    the forkserver imports as well when this call starts it (what a caller's collate needs; transformers' image
    processors cost each worker ~4 s to import otherwise); a forkserver already running is kept as it is."""
    if method not in START_METHODS:
        from core.config import ConfigError

        raise ConfigError(f"data.worker_start_method={method!r}: choose one of {', '.join(START_METHODS)}.")
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        _ensure_forkserver(ctx, preload)
    _kill_workers_at_exit()
    return ctx


@functools.cache
def _kill_workers_at_exit() -> None:
    """Workers ignore SIGTERM (see ``worker_init``), and that is what multiprocessing's own exit hook
    sends to the daemonic children still alive before it joins them: a rank that raises while its
    loader's iterator is still referenced (by the traceback) would wait for its workers forever
    instead of exiting. Registered after that hook, this one runs before it and SIGKILLs them
    (they hold read-only shard data, nothing to flush)."""
    def kill() -> None:
        for child in multiprocessing.active_children():
            if child.daemon:
                child.kill()

    atexit.register(kill)


def loader_kwargs(num_workers: int, method: str, preload: tuple[str, ...] = ()) -> dict[str, Any]:
    """``DataLoader`` arguments for ``num_workers`` workers started by ``method`` (none for 0)."""
    if num_workers <= 0:
        return {}
    return {"multiprocessing_context": worker_context(method, preload),
            "worker_init_fn": functools.partial(worker_init, owner_pid=os.getpid())}


def _ensure_forkserver(ctx: Any, preload: tuple[str, ...] = ()) -> None:
    """Start this process's forkserver (idempotent) with the job's signals blocked in it.

    A blocked signal stays blocked across fork and exec, so the forkserver, the resource tracker
    and every worker forked later never act on them; in this process they are only held back for
    the few milliseconds of the spawn (blocked, not ignored: one arriving meanwhile is delivered
    right after, never lost).
    """
    from multiprocessing import forkserver, resource_tracker

    ctx.set_forkserver_preload([*_PRELOAD, *preload])
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _JOB_SIGNALS)
    try:
        resource_tracker.ensure_running()  # starts first; it unblocks SIGINT/SIGTERM here when it does
        signal.pthread_sigmask(signal.SIG_BLOCK, _JOB_SIGNALS)
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def worker_init(_worker_id: int, owner_pid: int | None = None) -> None:
    """Workers leave SIGTERM/SIGUSR1/SIGINT to their rank (which checkpoints), dump stacks on SIGUSR2,
    and exit when ``owner_pid`` (the rank that made the loader) does. Bind it with functools.partial."""
    gc.freeze()  # the inherited heap is never collected here: no walk over it, no copy-on-write faults
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    register_stack_dump()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _JOB_SIGNALS)  # blocked since the forkserver's start
    if owner_pid is not None and owner_pid != os.getppid():
        _exit_with(owner_pid)


def _exit_with(owner_pid: int) -> None:
    """torch's workers watch their parent, which is the forkserver here, and the forkserver lives as
    long as any worker does: a rank killed with SIGKILL (OOM killer, a dead node's launcher) would
    leave its workers and the forkserver running forever, holding the job's stdout open. So each
    worker watches its rank itself."""
    try:
        fd = os.pidfd_open(owner_pid)  # Linux >= 5.3: readable once the process has exited, no pid reuse
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):
        fd = None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])
        else:
            while _alive(owner_pid):
                time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="owner-watchdog", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def register_stack_dump() -> None:
    """SIGUSR2 prints every thread's Python stack to stderr (the job's per-node log)."""
    try:
        faulthandler.register(signal.SIGUSR2, all_threads=True, chain=False)
    except (AttributeError, ValueError, RuntimeError):  # no SIGUSR2 (Windows) or stderr has no fd
        pass
