"""The launcher as a user should meet it: each rank's error line once, no launcher report after it, and
a signal sent to ``pretrain`` (``kill PID``, Ctrl-C) passed on to the ranks (``forwarding_signals``).

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
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["LaunchOutput", "Forwarder", "forwarding_signals", "relaying_signals", "kill_tree"]

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

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

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


_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class Forwarder:
    """The signals ``forwarding_signals`` passed on (in order), and whether a second Ctrl-C killed the job."""

    def __init__(self, installed: bool):
        self.installed = installed  # False outside the main thread: the launcher must then share our session
        self.signals: list[int] = []
        self.aborted = False
        self.proc: subprocess.Popen | None = None
        self.output: LaunchOutput | None = None

    def attach(self, proc: subprocess.Popen, output: LaunchOutput | None) -> None:
        """The launcher has started: pass on what arrived before it did."""
        self.proc, self.output = proc, output
        if self.aborted:
            kill_tree(proc.pid)
        for signum in self.signals:
            self._send(signum)

    def __call__(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGINT and signal.SIGINT in self.signals:  # a second Ctrl-C: stop now, no checkpoint
            self.aborted = True
            if self.proc is not None:
                kill_tree(self.proc.pid)
            return
        self.signals.append(signum)
        self._send(signum)

    def _send(self, signum: int) -> None:
        if self.proc is None:
            return
        if self.output is not None:
            self.output.stopping = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            ranks = _deepspeed_ranks(self.proc.pid)
            if ranks:  # to the ranks only: DeepSpeed's launch.py would SIGTERM them and SIGKILL them 30 s later
                for pid in ranks:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signum)
            elif os.getpgid(self.proc.pid) == self.proc.pid:  # its own group: deepspeed's launch.py and ranks are in it
                os.killpg(self.proc.pid, signum)
            else:
                self.proc.send_signal(signum)


@contextlib.contextmanager
def forwarding_signals() -> Iterator[Forwarder]:
    """While the launcher runs, pass SIGTERM, SIGINT (Ctrl-C), SIGHUP and SIGQUIT sent to this process on to
    it (``Forwarder.attach``), and keep waiting.

    ``launch`` starts the launcher in a session of its own, so a terminal's Ctrl-C reaches this process
    only, and the launcher once, from here -- as ``kill PID`` (or a scheduler stopping the job) does,
    which reaches only this process anyway (by default it would die at once and leave the launcher and
    its ranks training on, orphaned). The launcher (torchrun, accelerate) hands SIGTERM or SIGINT to
    every rank (DeepSpeed's ranks get it from here: ``_deepspeed_ranks``), which checkpoints at its next
    step boundary and exits; ``launch`` then returns 128 + the
    signal, as a shell reports a stopped command (the ranks' stop line names the checkpoint), and the
    output leaves out the agent's shutdown report. A second Ctrl-C kills the launcher, its ranks and
    their workers at once (``kill_tree``): a checkpoint being written stays a ``.tmp-`` folder that a
    resume ignores, the complete ones are untouched. SIGHUP (the terminal closed) and SIGQUIT go on as
    they came, as the terminal would have sent them. Not SIGUSR1: torch's elastic agent dies of it
    without passing it on (SLURM sends its pre-emption warning to every rank itself).
    """
    forwarder = Forwarder(installed=threading.current_thread() is threading.main_thread())
    previous = {sig: signal.signal(sig, forwarder) for sig in _FORWARDED} if forwarder.installed else {}
    relay = _relay if not forwarder.installed else None
    if relay is not None:
        relay.join(forwarder)
    try:
        yield forwarder
    finally:
        if relay is not None:
            relay.leave(forwarder)
        for sig, handler in previous.items():
            if handler is not None:  # None: one set outside Python, which cannot be put back
                signal.signal(sig, handler)


class _Relay:
    """The launches running outside the main thread while ``relaying_signals`` is open, and what it passed on."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: set[Forwarder] = set()
        self.received: list[int] = []

    def join(self, forwarder: Forwarder) -> None:
        with self.lock:
            self.running.add(forwarder)
            forwarder.signals.extend(self.received[:1])  # a launch starting after the signal: stopped at once

    def leave(self, forwarder: Forwarder) -> None:
        with self.lock:
            self.running.discard(forwarder)

    def __call__(self, signum: int) -> None:
        with self.lock:
            self.received.append(signum)
            running = list(self.running)
        for forwarder in running:
            forwarder(signum, None)


_relay: _Relay | None = None  # the open relaying_signals, if any


@contextlib.contextmanager
def relaying_signals(on_signal: Callable[[int], None]) -> Iterator[None]:
    """In the main thread of a process whose launches run in other threads (a sweep's parallel runs), where
    their forwarders cannot be signal handlers: a SIGTERM sent to this process alone (``kill PID``, a
    scheduler) calls ``on_signal`` (which stops queued work) and goes on to every such launch, running or
    starting later, whose ranks checkpoint and stop. Without it this process died at once and left its
    launches training, unsupervised. Ctrl-C is left alone: the terminal sends it to those launches, which
    share this process's group, itself."""
    global _relay
    relay = _Relay()

    def handler(signum: int, _frame: Any) -> None:
        on_signal(signum)
        relay(signum)

    previous, _relay = signal.signal(signal.SIGTERM, handler), relay
    try:
        yield
    finally:
        _relay = None
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _children() -> dict[int, list[int]]:
    """Parent pid -> its children's pids, read from ``/proc`` (empty where there is none)."""
    children: dict[int, list[int]] = {}
    proc_dir = Path("/proc")
    for entry in proc_dir.iterdir() if proc_dir.is_dir() else []:
        try:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            children.setdefault(int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
        except (OSError, ValueError, IndexError):  # not a process, or one that has just ended
            continue
    return children


def _tree(pid: int, children: dict[int, list[int]]) -> list[int]:
    """``pid`` and every process below it."""
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo.extend(children.get(found[-1], []))
    return found


def _deepspeed_ranks(pid: int) -> list[int]:
    """The ranks DeepSpeed's per-node ``deepspeed.launcher.launch`` started below ``pid`` (none: another launcher,
    or ranks not started yet). Its SIGINT / SIGTERM handler SIGTERMs each rank and SIGKILLs it 30 s later, a
    checkpoint still being written or not; given the signal themselves, the ranks checkpoint and exit first."""
    children = _children()
    for below in _tree(pid, children):
        try:
            if b"deepspeed.launcher.launch" in Path(f"/proc/{below}/cmdline").read_bytes():
                return children.get(below, [])
        except OSError:
            continue
    return []


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group and every process below it: torch's ranks run in sessions of
    their own, and their loader workers and forkserver are their children (read from ``/proc``)."""
    victims = _tree(pid, _children())
    for victim in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(victim, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
