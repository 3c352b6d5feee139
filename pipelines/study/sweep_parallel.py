"""A sweep's runs, ``jobs`` at a time (``SweepConfig.jobs > 1``), each its own process, and how they stop.

A thread per slot launches one run (``pipelines.engine.launcher.launch``) and waits on it. The runs are
processes of this one's group, so a terminal's Ctrl-C reaches each of them itself: they checkpoint and
stop, and here no further run starts. ``kill PID`` (SIGTERM) reaches this process alone: it is passed on
to every running run (``launch_output.relaying_signals``), with the same result. Either way the sweep
waits for the running runs, says how to go on, and ``pretrain sweep`` exits 128 + the signal; the same
command resumes the stopped runs from their checkpoints. A second Ctrl-C aborts at once.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any

from pipelines.engine import stop_signals
from pipelines.engine.launch_output import relaying_signals

__all__ = ["run_in_parallel", "STOPPED"]

STOPPED = "sweep stopped by a signal; run the same command again to resume it."


def run_in_parallel(run: Callable[[Any], dict[str, Any]], specs: Sequence[Any], jobs: int) -> list[dict[str, Any]]:
    """``run(spec)`` for every spec, ``jobs`` at a time; the records of the runs that ran, in spec order."""
    futures: list[Future] = []
    stopped: list[int] = []

    def stop(signum: int) -> None:  # queued runs never start; the running ones are told by the relay
        stopped.append(signum)
        stop_signals.record_stop(signum)
        for future in futures:
            future.cancel()

    with ThreadPoolExecutor(max_workers=jobs) as pool, relaying_signals(stop):
        futures.extend(pool.submit(run, spec) for spec in specs)
        try:
            records = _results(futures)
        except KeyboardInterrupt:  # the terminal's Ctrl-C, which the runs got too
            stop(signal.SIGINT)  # every cancel before the first wait: no slot frees first
            records = _results(futures)
    if stopped:
        print(STOPPED, flush=True)
    return records


def _results(futures: list[Future]) -> list[dict[str, Any]]:
    """Each future's record, waiting for it; a cancelled one (never started) has none."""
    records = []
    for future in futures:
        try:
            records.append(future.result())
        except CancelledError:
            continue
    return records
