"""ThroughputMeter rates and MFU against hand calculations, the peak table, and straggler skew."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from monitoring.throughput import (
    ThroughputMeter,
    cpu_peak_flops,
    model_flops_utilization,
    peak_flops_for,
    step_time_skew,
)


class _Clock:
    """A settable clock so the arithmetic can be checked exactly."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_mfu_equals_hand_calculation() -> None:
    clock = _Clock()
    meter = ThroughputMeter(flops_per_sample=3e9, peak_flops=2e12, world_size=4, clock=clock)
    meter.start_step()
    clock.now += 0.1  # waiting for data
    meter.data_ready()
    clock.now += 0.4  # forward/backward/step
    out = meter.end_step(samples=16, tokens=16 * 128)
    # by hand: each device does 16 samples * 3e9 FLOP in 0.5 s = 9.6e10 FLOP/s; peak 2e12 -> 4.8 %
    assert out["step_time"] == pytest.approx(0.5)
    assert out["data_wait_share"] == pytest.approx(0.2)
    assert out["samples_per_s"] == pytest.approx(16 / 0.5 * 4)
    assert out["tokens_per_s"] == pytest.approx(16 * 128 / 0.5 * 4)
    assert out["tokens_per_s_per_device"] == pytest.approx(16 * 128 / 0.5)
    assert out["mfu"] == pytest.approx(0.048)
    assert out["tflops_per_device"] == pytest.approx(0.096)
    assert model_flops_utilization(3e9, 16, 0.5, 2e12) == pytest.approx(0.048)
    assert out["host_rss_mb"] > 10


def test_rates_are_averaged_over_the_window() -> None:
    clock = _Clock()
    meter = ThroughputMeter(flops_per_sample=1.0, peak_flops=1.0, window=2, clock=clock)
    for duration, samples in ((1.0, 10), (3.0, 10), (1.0, 30)):
        meter.start_step()
        clock.now += duration
        out = meter.end_step(samples=samples, tokens=samples)
    assert out["samples_per_s"] == pytest.approx((10 + 30) / (3.0 + 1.0))  # the first step left the window
    assert meter.total_samples == 50 and meter.last_step_time == pytest.approx(1.0)
    meter.load_state_dict({"total_samples": 7, "total_tokens": 9})
    assert meter.state_dict() == {"total_samples": 7, "total_tokens": 9}


def test_real_clock_rates() -> None:
    meter = ThroughputMeter(flops_per_sample=1e6, peak_flops=1e9)
    meter.start_step()
    time.sleep(0.02)
    meter.data_ready()
    time.sleep(0.02)
    out = meter.end_step(samples=4, tokens=400)
    assert 0.04 <= out["step_time"] < 0.5
    assert 0.2 < out["data_wait_share"] < 0.8
    assert out["mfu"] == pytest.approx(1e6 * 4 / out["step_time"] / 1e9)


def test_end_without_start_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="start_step"):
        ThroughputMeter(1.0, 1.0).end_step(1, 1)


def test_no_mfu_without_a_peak() -> None:
    meter = ThroughputMeter(flops_per_sample=1e6, peak_flops=0.0)
    meter.start_step()
    assert "mfu" not in meter.end_step(1, 1)


@pytest.mark.parametrize(
    ("name", "dtype", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5),
        ("NVIDIA H100 80GB HBM3", "fp32", 67),
        ("NVIDIA H100 PCIe", "fp16", 756),
        ("NVIDIA H100 NVL", "bf16", 835.5),
        ("NVIDIA H200", "bf16", 989.5),
        ("NVIDIA GH200 480GB", "bf16", 989.5),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312),
        ("NVIDIA A100 80GB PCIe", "tf32", 156),
        ("NVIDIA A10", "bf16", 125),
        ("NVIDIA L4", "fp16", 121),
        ("NVIDIA L40S", "bf16", 362),
        ("Tesla V100-SXM2-16GB", "fp16", 125),
        ("Tesla V100-PCIE-32GB", "fp16", 112),
        ("Tesla T4", "fp16", 65),
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
        ("AMD Instinct MI300X", "bf16", 1307.4),
    ],
)
def test_peak_table(name: str, dtype: str, tflops: float) -> None:
    assert peak_flops_for(name, dtype) == pytest.approx(tflops * 1e12)


def test_peak_table_accepts_torch_dtypes_and_refuses_unknowns() -> None:
    import torch

    assert peak_flops_for("NVIDIA A100-SXM4-40GB", torch.bfloat16) == pytest.approx(312e12)
    assert peak_flops_for("NVIDIA A10G", "bf16") == 0.0  # not A10, not in the table
    with pytest.raises(ValueError, match="dtype"):
        peak_flops_for("NVIDIA H100", "int8")


def test_cpu_peak_is_measured_once() -> None:
    first = peak_flops_for("cpu", "fp32")
    assert first > 1e8  # any CPU does more than 0.1 GFLOP/s on a 512x512 matmul
    t0 = time.perf_counter()
    assert cpu_peak_flops("fp32") == first
    assert time.perf_counter() - t0 < 0.01  # cached: no second probe


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_cpu_peak_probe_leaves_the_training_rng_alone(dtype: str) -> None:
    """The probe runs again when a step beats the peak, at a moment the machine's speed decides (a bf16 run on a CPU
    without bf16 matmuls beats its first probe within a few steps): drawing its matrices from torch's global
    generator there shifted every later dropout mask, so a resumed bf16 run left the run it resumed from at the
    step after a re-probe. Its matrices come from a generator of its own."""
    import torch

    torch.manual_seed(1234)
    state = torch.get_rng_state()
    cpu_peak_flops(dtype, seconds=0.01, fresh=True)
    assert torch.equal(torch.get_rng_state(), state)


# ----------------------------------------------------------------------------- 2-process skew
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _skew_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    def gather(t: torch.Tensor) -> torch.Tensor:  # what accelerate.gather does for a 1-element tensor
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t)
        return torch.cat(parts)

    results = []
    for slow_rank in (1, 0):
        meter = ThroughputMeter(flops_per_sample=1.0, peak_flops=1.0, world_size=world)
        for _ in range(3):
            meter.start_step()
            time.sleep(0.06 if rank == slow_rank else 0.01)
            stats = meter.end_step(samples=1, tokens=1)
            dist.barrier()  # the step boundary: the fast rank waits outside its timed region
        results.append(step_time_skew(stats["step_time"], gather))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def test_step_time_skew_names_the_slower_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.multiprocessing as mp

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_skew_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        first, second = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert first["slowest_rank"] == 1 and second["slowest_rank"] == 0
        for r in (first, second):
            assert r["step_time_max"] >= 0.06 > r["step_time_min"] >= 0.01
            assert r["step_time_mean"] == pytest.approx(sum(r["step_times"]) / 2)
            assert r["step_time_skew"] > 1.2


def test_mfu_from_the_step_flops_of_variable_length_batches() -> None:
    """Fine-tuning batches vary in length: the step's own FLOP count wins over samples x flops_per_sample."""
    clock = _Clock()
    meter = ThroughputMeter(flops_per_sample=3e9, peak_flops=2e12, world_size=1, clock=clock)
    meter.start_step()
    clock.now += 0.5
    out = meter.end_step(samples=16, tokens=1000, flops=2e11)
    assert out["mfu"] == pytest.approx(2e11 / 0.5 / 2e12)  # 20 %, not 16 x 3e9 / 0.5 / 2e12 = 4.8 %


def test_a_cpu_peak_that_a_step_beats_is_remeasured_and_mfu_never_exceeds_one(caplog) -> None:
    """A CPU peak probed while other processes ran reads low (fine-tuning logged 125.8 % MFU): the first
    step that beats it re-probes (the higher figure is kept); a peak still below the achieved rate gives
    no MFU and one warning, never a figure above 100 %."""
    probes = iter([4e11, 1e11])
    clock = _Clock()
    meter = ThroughputMeter(flops_per_sample=0, peak_flops=1e11, clock=clock, warmup_steps=0,
                            remeasure_peak=lambda: next(probes))
    meter.start_step()
    clock.now += 1.0
    out = meter.end_step(samples=8, tokens=800, flops=2e11)  # 2e11 FLOP/s > the 1e11 probe
    assert out["mfu"] == pytest.approx(0.5) and meter.peak_flops == 4e11 and out["step_flops"] == 2e11
    low = ThroughputMeter(flops_per_sample=0, peak_flops=1e11, clock=clock, warmup_steps=0,
                          remeasure_peak=lambda: next(probes))
    for _ in range(3):
        low.start_step()
        clock.now += 1.0
        out = low.end_step(samples=8, tokens=800, flops=2e11)
        assert "mfu" not in out and out["tflops_per_device"] == pytest.approx(0.2)
    assert sum("MFU not reported" in r.message for r in caplog.records) == 1
    fresh = cpu_peak_flops("fp32", seconds=0.05, fresh=True)
    assert cpu_peak_flops("fp32") == fresh >= peak_flops_for("cpu", "fp32")  # a fresh probe only ever raises it
