"""A sweep's runs, ``jobs`` at a time (``SweepConfig.jobs > 1``), each its own process, and how they stop.

A thread per slot launches one run (``pipelines.engine.launcher.launch``) and waits on it. The runs are
processes of this one's group, so a terminal's Ctrl-C reaches each of them itself: they checkpoint and
stop, and here no further run starts. ``kill PID`` (SIGTERM) reaches this process alone: it is passed on
to every running run (``launch_output.relaying_signals``), with the same result. Either way the sweep
waits for the running runs, says how to go on, and ``pretrain sweep`` exits 128 + the signal; the same
command resumes the stopped runs from their checkpoints. A second Ctrl-C aborts at once. A run that
stopped on a signal this process did not get (it ignores SIGINT when a script started it in the background)
stops the sweep the same way, before its slot takes the next run.
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


def run_in_parallel(run: Callable[[Any], dict[str, Any]], specs: Sequence[Any], jobs: int,
                    stopped_on: Callable[[dict[str, Any]], int | None] = lambda record: None) -> list[dict[str, Any]]:
    """``run(spec)`` for every spec, ``jobs`` at a time; the records of the runs that ran, in spec order.

    ``stopped_on(record)``: the signal a run checkpointed and stopped on (0: one it does not name), else None.
    Such a run stops the sweep as a signal to it does, before its slot takes the next run: the runs may get a
    signal this process never sees (a sweep started in a script's background ignores SIGINT; a signal sent to
    the runs alone), as the one-at-a-time loop stops after a run stopped on one."""
    futures: list[Future] = []
    stopped: list[int] = []

    def stop(signum: int) -> None:  # queued runs never start; the running ones are told by the relay
        stopped.append(signum)
        stop_signals.record_stop(signum or None)
        for future in futures:
            future.cancel()

    def run_and_check(spec: Any) -> dict[str, Any]:
        if stopped:  # a run queued after the stop that the cancel did not reach: it never starts either
            raise CancelledError
        record = run(spec)
        signum = stopped_on(record)
        if signum is not None and not stopped:  # in the slot's thread: before it takes a queued run
            stop(signum)
        return record

    with ThreadPoolExecutor(max_workers=jobs) as pool, relaying_signals(stop):
        futures.extend(pool.submit(run_and_check, spec) for spec in specs)
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
