"""``logging.profile_steps``: the window's parsing and the files a profiled window leaves."""

from __future__ import annotations

import json

import pytest
import torch

from core.config import ConfigError
from monitoring.profiler import StepProfiler, parse_profile_steps


def test_profile_steps_parse_and_refuse_a_bad_window():
    assert parse_profile_steps("") is None and parse_profile_steps("  ") is None
    assert parse_profile_steps("21-25") == (21, 25) and parse_profile_steps("7") == (7, 7)
    for bad in ("0-3", "5-2", "a-b", "3-", "-3", "2:4"):
        with pytest.raises(ConfigError, match="logging.profile_steps"):
            parse_profile_steps(bad)


def _steps(profiler: StepProfiler, n: int) -> None:
    model, x = torch.nn.Linear(16, 16), torch.randn(4, 16)
    for step in range(1, n + 1):
        profiler.before(step)
        model(x).square().sum().backward()
        profiler.after(step)
    profiler.close()


def test_a_window_writes_the_operator_table_and_a_trace(tmp_path):
    _steps(StepProfiler(tmp_path, "2-3", rank=0, device_type="cpu"), n=5)
    table = (tmp_path / "profile/rank-00000.txt").read_text()
    assert "optimizer steps 2-3 of the window 2-3 (2 steps)" in table and "aten::addmm" in table
    assert "Self CPU" in table
    trace = json.loads((tmp_path / "profile/rank-00000.trace.json").read_text())
    assert any(e.get("name") == "aten::addmm" for e in trace["traceEvents"])
    assert not list((tmp_path / "profile").glob(".*"))  # no temporary file left


def test_a_run_that_ends_inside_the_window_writes_what_it_profiled(tmp_path):
    _steps(StepProfiler(tmp_path, "3-10", rank=1, device_type="cpu"), n=4)
    assert "optimizer steps 3-4 of the window 3-10 (2 steps)" in (tmp_path / "profile/rank-00001.txt").read_text()


def test_off_writes_nothing(tmp_path):
    _steps(StepProfiler(tmp_path, "", rank=0, device_type="cpu"), n=3)
    assert not (tmp_path / "profile").exists()


def test_device_busy_is_the_union_of_device_spans_not_a_sum():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from monitoring.profiler import device_busy_us

    def event(start, end, device=DeviceType.CUDA, annotation=False):
        return SimpleNamespace(time_range=SimpleNamespace(start=start, end=end), device_type=device,
                               is_user_annotation=annotation)

    events = [event(0, 10, DeviceType.CPU),  # the host op that launched the kernels: never device time
              event(0, 4), event(2, 6),  # two streams overlapping: 0-6
              event(3, 5),  # inside: nothing more
              event(10, 12), event(12, 13),  # back to back
              event(0, 40, annotation=True)]  # an annotation spanning gaps: left out
    assert device_busy_us(events) == 6 + 3
    assert device_busy_us([event(0, 10, DeviceType.CPU)]) == 0.0


def test_host_waits_count_each_synchronize_per_step():
    from types import SimpleNamespace

    from monitoring.profiler import host_waits

    def avg(key, count, cpu_us):
        return SimpleNamespace(key=key, count=count, cpu_time_total=cpu_us)

    averages = [avg("cudaStreamSynchronize", 6, 900.0), avg("cudaLaunchKernel", 900, 5000.0),
                avg("cudaEventSynchronize", 3, 30.0)]
    assert host_waits(averages, steps=3) == ("cudaDeviceSynchronize 0, cudaStreamSynchronize 2 (0.30 ms), "
                                             "cudaEventSynchronize 1 (0.01 ms)")
