"""The signals that stop a run at its next step boundary, with a checkpoint: SIGTERM, SIGUSR1 (a
scheduler's stop, SLURM's pre-emption warning) and SIGINT (Ctrl-C).

The trainer's handler only sets its stop flag; the step's all-reduce carries the flag to every rank, so
all of them checkpoint after the same step and the run ends with one stop line naming the checkpoint.
A terminal sends Ctrl-C to every process of its foreground job: the data loader's workers and their
forkserver ignore it (``pipelines.loading.workers``), and ``pretrain train --nproc N`` runs its launcher
in a session of its own and passes the signal on once (``launch_output.forwarding_signals``), which the
launcher passes to each rank.

A second Ctrl-C aborts at once (``KeyboardInterrupt``): a checkpoint being written then stays under its
temporary ``.tmp-`` name, which a resume ignores and the next save removes; complete checkpoints are
never touched. A process whose run stopped on Ctrl-C exits with 130 (128 + SIGINT, as a shell reports
it; ``stopped_by``); the ranks of a SLURM job keep exiting 0 after SIGTERM / SIGUSR1, which requeues them.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

__all__ = ["STOP_SIGNALS", "install", "record_stop", "stopped_by", "forget", "signal_name"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_CTRL_C_NOTE = b"Ctrl-C: stopping after this step with a checkpoint (press Ctrl-C again to abort without one).\n"
_stops: list[int] = []  # the signals that stopped runs in this process, in order


def install(on_signal: Callable[[int], None], *, announce: bool) -> Callable[[], None]:
    """Send the stop signals to ``on_signal`` (from the main thread; elsewhere nothing is installed).

    Returns the function that gives SIGINT back to Python's default handler once the run's loop is
    over (a Ctrl-C after it interrupts at once, as anywhere else); SIGTERM / SIGUSR1 stay ignored-but-
    noted, as a job's rank has always treated them. ``announce``: on the first Ctrl-C, say on stderr
    what happens now (rank 0's job)."""
    interrupts = 0

    def handler(signum: int, _frame: Any) -> None:
        nonlocal interrupts
        if signum == signal.SIGINT:
            interrupts += 1
            if interrupts > 1:
                raise KeyboardInterrupt
            if announce:
                os.write(2, _CTRL_C_NOTE)  # no print() in a handler: it may interrupt a print on that stream
        on_signal(signum)

    try:
        previous = signal.getsignal(signal.SIGINT)
        for sig in STOP_SIGNALS:
            signal.signal(sig, handler)
    except ValueError:  # not the main thread (a sweep's worker thread): signals stay with the main thread
        return lambda: None

    def restore() -> None:
        if signal.getsignal(signal.SIGINT) is handler:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)

    return restore


def record_stop(signum: int | None) -> None:
    """The trainer stopped its run on ``signum`` (this process's own signal; None: another rank's), or
    ``launch`` passed ``signum`` on to the job it started, which stopped on it."""
    if signum is not None:
        _stops.append(int(signum))


def stopped_by() -> int | None:
    """The signal that stopped the first run this process stopped on a signal, if any."""
    return _stops[0] if _stops else None


def forget() -> None:
    """A new command in this process starts with no stop on record (``pipelines.cli.main``)."""
    _stops.clear()


def signal_name(signum: int | None) -> str | None:
    """``SIGINT`` for 2, ...; None for None."""
    return signal.Signals(signum).name if signum else None
