"""The launcher as a user should meet it: each rank's error line once, no launcher report after it, and
a signal sent to ``pretrain`` passed on to the ranks (``forwarding_signals``).

When ranks stop on a problem the user must fix, each prints one ``error: ...`` line and exits with
code 2. torch's elastic agent (behind ``accelerate launch`` and ``torchrun``) then adds its own
shutdown lines and a ``ChildFailedError`` traceback with a "Failures / Root Cause" box, 40 lines
that say nothing the error line did not. ``LaunchOutput`` passes the launcher's stderr through line
by line, prints an error line the first time only, and, once a rank has printed one, drops the
agent's report. Everything else (warnings, a rank's own traceback of a real crash, the agent's
report when no rank explained itself) passes unchanged. ``PRETRAIN_DEBUG=1`` turns the filter off.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import IO, Any

__all__ = ["LaunchOutput", "forwarding_signals"]

_AGENT_LINE = re.compile(r"^[IWE]\d{4} [\d:.]+ +\d+ .*torch/distributed/elastic/")  # glog-style lines of the agent
_REPORT_RULE = re.compile(r"^={20,}\s*$")


class LaunchOutput:
    """Copy ``stream`` (the launcher's stderr pipe) to ``sys.stderr`` in a thread, filtered as above."""

    def __init__(self, stream: IO[bytes]):
        self.stream = stream
        self.errors: list[str] = []  # the distinct error lines the ranks printed
        self.dropped_report = False
        self.stopping = False  # a signal was passed on: the agent's "death signal" lines and traceback are expected
        self._thread = threading.Thread(target=self._copy, name="launch-output", daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._thread.join()

    def _emit(self, lines: list[str]) -> None:
        out = sys.stderr  # looked up per write: tests and notebooks replace it
        out.write("".join(lines))
        out.flush()

    def _copy(self) -> None:
        held: list[str] = []  # a traceback being read: shown, or dropped if it is the agent's report
        rules_left = 0  # lines of the report box still to drop: it opens and closes with a rule of '='
        for raw in iter(self.stream.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            if rules_left:
                rules_left -= bool(_REPORT_RULE.match(line))
                continue
            if held:
                held.append(line)
                if line[:1].isspace() or line.startswith("Traceback"):
                    continue
                if "ChildFailedError" in line and self.errors:  # the exception line closes the traceback
                    held, rules_left, self.dropped_report = [], 2, True
                elif "SignalException" in line and self.stopping:  # the agent re-raising the signal it passed on
                    held = []
                else:
                    self._emit(held)
                    held = []
                continue
            if line.startswith("Traceback (most recent call last):"):
                held = [line]
            elif line.startswith("error: "):
                if line not in self.errors:
                    self.errors.append(line)
                    self._emit([line])
            elif not ((self.errors or self.stopping) and _AGENT_LINE.match(line)):
                self._emit([line])
        if held:
            self._emit(held)


@contextlib.contextmanager
def forwarding_signals(proc: subprocess.Popen, output: LaunchOutput | None) -> Iterator[list[int]]:
    """Pass a SIGTERM sent to this process on to the launcher, and keep waiting; yields the signals passed.

    ``kill PID`` (or a scheduler stopping the job) reaches only this process; by default it would die
    at once and leave the launcher and its ranks training on, orphaned. The launcher (torchrun,
    accelerate) hands it to every rank, which checkpoints at its next step boundary and exits; this
    process then returns (``launch``: 128 + the signal, as a shell reports a terminated command; the
    ranks' stop line names the checkpoint) and ``output`` leaves out the agent's shutdown report. Only SIGTERM: torch's elastic agent dies of
    SIGUSR1 without passing it on (SLURM sends its pre-emption warning to every rank itself).
    """
    received: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        received.append(signum)
        if output is not None:
            output.stopping = True
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    try:
        previous = signal.signal(signal.SIGTERM, forward)
    except ValueError:  # not the main thread: nothing to install
        previous = None
    try:
        yield received
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
