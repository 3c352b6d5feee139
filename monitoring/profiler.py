"""A torch.profiler window over a few optimizer steps of a real run (``logging.profile_steps: "21-25"``).

Why: a step's time on a GPU hides where it goes -- kernels, host syncs (``aten::_local_scalar_dense``,
``cudaStreamSynchronize``), launch overhead, copies. A benchmark harness times a different program; this
profiles the run a user runs, with its engine, loader and logging, after compilation and warm-up.

Each rank writes ``run_dir/profile/rank-NNNNN.txt`` (the operators by self device time on a GPU, self
CPU time otherwise, with call counts; on a GPU its header also gives the device's busy time and the host's
waits for it per step) and ``rank-NNNNN.trace.json`` (a Chrome / Perfetto trace). The window
is closed early if the run ends inside it. Off (``""``) costs nothing.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from core.config import ConfigError
from core.files import atomic_write_text

__all__ = ["StepProfiler", "device_busy_us", "host_waits", "parse_profile_steps"]

ROW_LIMIT = 40
#: CUDA runtime calls in which the host waits for the device: the whole device (DeepSpeed's throughput timer, any
#: ``torch.cuda.synchronize``), a stream (a value read, a blocking copy to or from the device), one event.
WAITS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")


def parse_profile_steps(spec: str) -> tuple[int, int] | None:
    """``"21-25"`` -> (21, 25); ``"7"`` -> (7, 7); ``""`` -> None (off). Steps count from 1."""
    spec = spec.strip()
    if not spec:
        return None
    first, sep, last = spec.partition("-")
    try:
        window = (int(first), int(last) if sep else int(first))
    except ValueError:
        window = (0, 0)
    if not 1 <= window[0] <= window[1]:
        raise ConfigError(f"logging.profile_steps={spec!r} must be FIRST-LAST optimizer steps with 1 <= FIRST <= LAST "
                          "(e.g. logging.profile_steps=21-25, after compilation and warm-up), one step N, or empty for off.")
    return window


def device_busy_us(events: Any) -> float:
    """Microseconds in which the device ran at least one kernel or copy: the union of the device events' spans.

    Not a sum of ``self_device_time_total`` over ``key_averages()``: that counts each kernel under its own
    device event and again under the host operator that launched it (an inductor kernel appears twice), and
    kernels overlapping on two streams twice -- the first H100 profiles read 109-164 % of the wall that way.
    A user annotation's span on the device timeline (``Optimizer.step#AdamW.step``) covers its gaps: left out.
    """
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False))
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    return busy


def host_waits(averages: Any, steps: int) -> str:
    """``"cudaDeviceSynchronize 0, cudaStreamSynchronize 2 (0.41 ms), ..."`` per step, from ``key_averages()``:
    each wait the host made and its time -- what the device's idle share of the wall is made of."""
    found = {a.key: a for a in averages if a.key in WAITS}
    parts = []
    for name in WAITS:
        a = found.get(name)
        calls = a.count / steps if a is not None else 0
        parts.append(f"{name} {calls:g}" + (f" ({a.cpu_time_total / 1e3 / steps:.2f} ms)" if a is not None else ""))
    return ", ".join(parts)


class StepProfiler:
    """``before(step)`` / ``after(step)`` around each optimizer step (numbered from 1); ``close()`` at the end."""

    def __init__(self, run_dir: Path, spec: str, rank: int, device_type: str):
        self.window = parse_profile_steps(spec)
        self.out = Path(run_dir) / "profile"
        self.rank, self.cuda = rank, device_type == "cuda"
        self._prof: Any = None
        self._steps = 0
        self._started = 0.0

    def before(self, step: int) -> None:
        if self.window is None or self._prof is not None or step != self.window[0]:
            return
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False)
        self._prof.__enter__()
        self._started = time.perf_counter()

    def after(self, step: int) -> None:
        if self._prof is None:
            return
        self._steps += 1
        if step >= self.window[1]:
            self.close()

    def close(self) -> None:
        """Stop the window (if open) and write this rank's table and trace (temp name, then rename)."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        wall_ms = (time.perf_counter() - self._started) * 1e3 / max(self._steps, 1)
        prof.__exit__(None, None, None)
        try:
            self._write(prof, wall_ms)
        except (OSError, RuntimeError, AttributeError) as exc:  # a diagnostic aid never stops the training run
            print(f"warning: logging.profile_steps: could not write the profile to {self.out} ({exc}); "
                  "the run goes on without it.", file=sys.stderr, flush=True)

    def _write(self, prof: Any, wall_ms: float) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        stem = self.out / f"rank-{self.rank:05d}"
        sort = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        averages = prof.key_averages()
        table = averages.table(sort_by=sort, row_limit=ROW_LIMIT)
        first, last = self.window  # type: ignore[misc]
        header = (f"# torch.profiler, optimizer steps {first}-{first + self._steps - 1} of the window {first}-{last} "
                  f"({self._steps} steps), rank {self.rank}, sorted by {sort}; totals are for all {self._steps} steps\n"
                  f"# wall {wall_ms:.2f} ms per step (profiled)")
        if self.cuda:  # the device's busy share: what is left of the wall time is the device waiting on the host
            busy_ms = device_busy_us(prof.events()) / 1e3 / max(self._steps, 1)
            header += f"; device busy {busy_ms:.2f} ms per step (kernels and copies, {busy_ms / wall_ms:.0%} of the wall)"
            header += f"\n# host waits per step: {host_waits(averages, max(self._steps, 1))}"
        header += "\n"
        atomic_write_text(stem.with_suffix(".txt"), header + table + "\n")
        tmp = stem.with_name(f".{stem.name}.trace.json.tmp")
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, stem.with_name(stem.name + ".trace.json"))

