"""Throughput, MFU, memory and straggler measurement for the training loop.

The trainer brackets each optimizer step with ``start_step()`` / ``data_ready()`` / ``end_step()``.
Rates are averaged over a short window of recent steps because single-step wall times are noisy
and, on GPUs, only meaningful once the host has waited for the device (the trainer's ``loss.item()``
is that sync point). torch is imported inside the functions that need it so that importing this
module stays cheap for the CLI.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = [
    "ThroughputMeter",
    "PEAK_FLOPS",
    "peak_flops_for",
    "cpu_peak_flops",
    "resolve_peak_flops",
    "peak_remeasure",
    "model_flops_utilization",
    "step_time_skew",
    "host_rss_mb",
]

log = logging.getLogger(__name__)

# Peak dense (no structured sparsity) FLOP/s per device, by compute dtype. "fp32" is the plain
# CUDA-core rate (what PyTorch uses by default: float32 matmul precision "highest"); "tf32" applies
# when TF32 tensor cores are allowed. Sources are listed in docs/monitoring.md. Patterns are matched
# in order against torch.cuda.get_device_name(), so more specific names come first.
_T = 1e12
PEAK_FLOPS: list[tuple[str, str, dict[str, float]]] = [
    # (regex, label, {dtype: FLOP/s})
    (r"GH200", "GH200", {"fp32": 67 * _T, "tf32": 494.5 * _T, "bf16": 989.5 * _T, "fp16": 989.5 * _T}),
    (r"H200 NVL", "H200 NVL", {"fp32": 60 * _T, "tf32": 417.5 * _T, "bf16": 835.5 * _T, "fp16": 835.5 * _T}),
    (r"H200", "H200 SXM", {"fp32": 67 * _T, "tf32": 494.5 * _T, "bf16": 989.5 * _T, "fp16": 989.5 * _T}),
    (r"H100 NVL", "H100 NVL", {"fp32": 60 * _T, "tf32": 417.5 * _T, "bf16": 835.5 * _T, "fp16": 835.5 * _T}),
    (r"H100.*PCIe", "H100 PCIe", {"fp32": 51 * _T, "tf32": 378 * _T, "bf16": 756 * _T, "fp16": 756 * _T}),
    (r"H100", "H100 SXM", {"fp32": 67 * _T, "tf32": 494.5 * _T, "bf16": 989.5 * _T, "fp16": 989.5 * _T}),
    (r"\bA100\b", "A100", {"fp32": 19.5 * _T, "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T}),
    (r"\bA10\b", "A10", {"fp32": 31.2 * _T, "tf32": 62.5 * _T, "bf16": 125 * _T, "fp16": 125 * _T}),
    (r"\bL40S\b", "L40S", {"fp32": 91.6 * _T, "tf32": 183 * _T, "bf16": 362 * _T, "fp16": 362 * _T}),
    (r"\bL4\b", "L4", {"fp32": 30.3 * _T, "tf32": 60 * _T, "bf16": 121 * _T, "fp16": 121 * _T}),
    (r"V100.*PCIE", "V100 PCIe", {"fp32": 14 * _T, "tf32": 14 * _T, "bf16": 14 * _T, "fp16": 112 * _T}),
    (r"V100", "V100 SXM2", {"fp32": 15.7 * _T, "tf32": 15.7 * _T, "bf16": 15.7 * _T, "fp16": 125 * _T}),
    (r"\bT4\b", "T4", {"fp32": 8.1 * _T, "tf32": 8.1 * _T, "bf16": 8.1 * _T, "fp16": 65 * _T}),
    (r"RTX 4090", "RTX 4090", {"fp32": 82.6 * _T, "tf32": 82.6 * _T, "bf16": 165.2 * _T, "fp16": 165.2 * _T}),
    (r"RTX 3090", "RTX 3090", {"fp32": 35.6 * _T, "tf32": 35.6 * _T, "bf16": 71 * _T, "fp16": 71 * _T}),
    (r"MI300X", "MI300X", {"fp32": 163.4 * _T, "tf32": 653.7 * _T, "bf16": 1307.4 * _T, "fp16": 1307.4 * _T}),
    (r"MI250X", "MI250X", {"fp32": 95.7 * _T, "tf32": 95.7 * _T, "bf16": 383 * _T, "fp16": 383 * _T}),
]

_DTYPE_ALIASES = {
    "float32": "fp32",
    "fp32": "fp32",
    "float": "fp32",
    "32": "fp32",
    "tf32": "tf32",
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float16": "fp16",
    "fp16": "fp16",
    "half": "fp16",
    "16": "fp16",
}

_cpu_peak_cache: dict[tuple[str, int], float] = {}


def _dtype_key(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.").lower()
    if name not in _DTYPE_ALIASES:
        raise ValueError(f"Unknown compute dtype {dtype!r}; use fp32, tf32, bf16 or fp16.")
    return _DTYPE_ALIASES[name]


def _table_lookup(device_name: str, dtype: str) -> float | None:
    for pattern, _label, peaks in PEAK_FLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return peaks[dtype]
    return None


def peak_flops_for(device: Any, dtype: Any = "fp32") -> float:
    """Peak dense FLOP/s of one device for ``dtype``; 0.0 when unknown (MFU is then not reported).

    ``device`` is a torch.device, ``"cpu"``/``"cuda[:i]"``, or a GPU name such as
    ``"NVIDIA H100 80GB HBM3"``. CPUs have no table entry: their peak is measured once with a
    matmul probe (``cpu_peak_flops``), so CPU MFU reads as "share of attainable matmul speed".
    An fp32 request on a GPU uses the TF32 rate when torch allows TF32 matmuls.
    """
    key = _dtype_key(dtype)
    text = str(device)
    if text == "cpu" or text.startswith("cpu:"):
        return cpu_peak_flops("fp32" if key == "tf32" else key)
    if text == "mps" or text.startswith("mps:"):
        return 0.0
    if text == "cuda" or text.startswith("cuda:"):
        import torch

        if not torch.cuda.is_available():
            return 0.0
        index = torch.device(text).index
        text = torch.cuda.get_device_name(torch.cuda.current_device() if index is None else index)
        if key == "fp32" and torch.get_float32_matmul_precision() != "highest":
            key = "tf32"
    peak = _table_lookup(text, key)
    if peak is None:
        log.warning("No peak FLOP/s known for device %r; set logging.peak_flops to report MFU.", text)
        return 0.0
    return peak


def cpu_peak_flops(dtype: Any = "fp32", seconds: float = 0.2, *, fresh: bool = False) -> float:
    """Best matmul FLOP/s this process reaches on the CPU, measured once per dtype/thread count.

    ``fresh``: probe again and keep the higher figure. On a shared CPU a probe taken while other
    processes run reads low, so a later step can beat it (``ThroughputMeter`` then re-probes).
    """
    import torch

    key = (_dtype_key(dtype), torch.get_num_threads())
    if key in _cpu_peak_cache and not fresh:
        return _cpu_peak_cache[key]
    tdtype = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[key[0]]
    n = 512
    # the probe's own generator: a re-probe comes when a step beats the peak, a moment set by timing, and drawing
    # from the global one there would shift every later dropout mask (a run would not repeat, nor resume exactly)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(tdtype)
    b = torch.randn(n, n, generator=gen).to(tdtype)
    torch.mm(a, b)  # warm-up: thread pool, kernel selection
    best = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        torch.mm(a, b)
        dt = time.perf_counter() - t0
        best = max(best, 2 * n**3 / max(dt, 1e-9))
        if time.perf_counter() > deadline:
            break
    best = max(best, _cpu_peak_cache.get(key, 0.0))
    _cpu_peak_cache[key] = best
    return best


def peak_remeasure(configured: float, device: Any, precision: str = "fp32") -> Callable[[], float] | None:
    """How ``ThroughputMeter`` re-measures a peak that a step beat: a fresh CPU probe; None for a
    configured peak or a GPU's table value (those are not measurements)."""
    text = str(device)
    if (configured and configured > 0) or not (text == "cpu" or text.startswith("cpu:")):
        return None
    key = _dtype_key(precision)
    return lambda: cpu_peak_flops("fp32" if key == "tf32" else key, seconds=0.5, fresh=True)


def resolve_peak_flops(configured: float, device: Any, precision: str = "fp32") -> float:
    """``logging.peak_flops`` when set (> 0), else the device table / CPU probe for the precision."""
    return float(configured) if configured and configured > 0 else peak_flops_for(device, precision)


def model_flops_utilization(flops_per_sample: float, samples: float, step_time: float, peak_flops: float) -> float:
    """Achieved model FLOP/s of one device divided by its peak (the PaLM definition of MFU)."""
    if step_time <= 0 or peak_flops <= 0:
        return float("nan")
    return flops_per_sample * samples / step_time / peak_flops


_process: Any = None


def host_rss_mb() -> float:
    """Resident set size of this process in MiB (psutil when present, else /proc)."""
    global _process
    if _process is None or (_process and _process.pid != os.getpid()):  # a forked child: re-create
        try:
            import psutil

            _process = psutil.Process()
        except ImportError:
            _process = False
    if _process:
        return _process.memory_info().rss / 2**20
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


def _device_memory_mb() -> dict[str, float]:
    import sys

    torch = sys.modules.get("torch")  # never import torch just to learn there is no GPU
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    return {
        "mem_allocated_mb": torch.cuda.memory_allocated() / 2**20,
        "mem_reserved_mb": torch.cuda.memory_reserved() / 2**20,
        "mem_peak_mb": torch.cuda.max_memory_allocated() / 2**20,
    }


class ThroughputMeter:
    """Times optimizer steps and turns them into rates, MFU and memory figures.

    ``samples``/``tokens`` given to ``end_step`` are this process's counts; rates are reported
    globally (× ``world_size``) and MFU per device, which assumes ranks are evenly loaded (the
    skew check is there to tell when they are not). The first ``warmup_steps`` steps are reported
    on their own but kept out of the window, so loader start-up does not read as starvation.
    """

    def __init__(
        self,
        flops_per_sample: float,
        peak_flops: float,
        world_size: int = 1,
        *,
        window: int = 20,
        warmup_steps: int = 1,
        clock: Callable[[], float] = time.perf_counter,
        remeasure_peak: Callable[[], float] | None = None,
    ) -> None:
        self.flops_per_sample = float(flops_per_sample)
        self.peak_flops = float(peak_flops)
        self.remeasure_peak = remeasure_peak  # a measured (CPU) peak: re-probed once when a step beats it
        self._peak_warned, self._measured_peak = False, remeasure_peak is not None
        self.world_size = int(world_size)
        self._clock = clock
        self.warmup_steps = int(warmup_steps)
        self.steps_seen = 0
        self._window: deque[tuple[float, ...]] = deque(maxlen=max(1, window))
        self._t_start: float | None = None
        self._t_data: float | None = None
        self._sums, self._slides = [0.0] * 6, 0
        self._rss, self._rss_at = host_rss_mb(), time.monotonic()  # pays psutil's import now, not in a timed step
        self.total_samples = 0
        self.total_tokens = 0
        self.last_step_time = float("nan")

    def start_step(self) -> None:
        """Call before fetching the step's first batch."""
        self._t_start = self._clock()
        self._t_data = None

    def data_ready(self) -> None:
        """Call once the batches are in hand; the time since ``start_step`` counts as data wait.

        With gradient accumulation call it after each micro-batch fetch is fine too: the wait
        is then measured up to the last call (an upper bound on the loader's share).
        """
        self._t_data = self._clock()

    def end_step(self, samples: int, tokens: int, peer_wait: float = 0.0, flops: float | None = None) -> dict[str, float]:
        """Close the step and return window-averaged rates, MFU and memory.

        ``peer_wait``: seconds this rank spent blocked in the step's agreement collective waiting for
        the other ranks. ``busy_time`` (step time minus that wait) is what tells a straggler apart:
        every rank's plain step time is paced by the slowest one. ``flops``: this step's model FLOPs
        when the task counts them per batch (variable-length fine-tuning batches); else
        ``samples x flops_per_sample``.
        """
        now = self._clock()
        if self._t_start is None:
            raise RuntimeError("ThroughputMeter.end_step() called without start_step().")
        step_time = now - self._t_start
        wait = (self._t_data - self._t_start) if self._t_data is not None else 0.0
        self._t_start = None
        self.last_step_time = step_time
        self.total_samples += int(samples)
        self.total_tokens += int(tokens)
        step_flops = float(flops) if flops is not None else self.flops_per_sample * int(samples)
        t, wait_sum, n_samples, n_tokens, peer_sum, n_flops = self._slide(
            (step_time, wait, int(samples), int(tokens), float(peer_wait), step_flops))
        n = len(self._window)
        out: dict[str, float] = {
            "step_time": t / n,
            "busy_time": (t - peer_sum) / n,
            "data_wait_share": wait_sum / t if t > 0 else 0.0,
            "samples_per_s": n_samples / t * self.world_size if t > 0 else 0.0,
            "tokens_per_s": n_tokens / t * self.world_size if t > 0 else 0.0,
        }
        out["tokens_per_s_per_device"] = out["tokens_per_s"] / self.world_size
        out["step_flops"] = step_flops  # this rank's model FLOPs of this step (the work done, not the padding)
        if self.peak_flops > 0 and n_flops > 0 and t > 0:
            per_device = n_flops / t  # model FLOP/s of one device
            out["tflops_per_device"] = per_device / 1e12
            mfu = self._utilization(per_device, n_flops, t)
            if mfu is not None:
                out["mfu"] = mfu
        out.update(_device_memory_mb())
        out["host_rss_mb"] = self._host_rss()
        self.steps_seen += 1
        if self.steps_seen <= self.warmup_steps:
            self._window.clear()  # first steps (loader start-up, allocator, compile) would skew averages
            self._sums = [0.0] * 6
        return out

    def _utilization(self, per_device: float, flops: float, seconds: float) -> float | None:
        """``model_flops_utilization`` of ``flops`` done in ``seconds``; a measured peak that a step beat is re-measured (kept if higher). MFU
        above 1 is impossible: if the peak still reads below the achieved rate (a CPU shared with other
        processes, a throttled clock) it is left out, with one warning, rather than logged wrong."""
        if per_device > self.peak_flops and self.remeasure_peak is not None:
            self.peak_flops = max(self.peak_flops, float(self.remeasure_peak()))
            self.remeasure_peak = None  # one re-probe per run: it costs half a second of the step
        if per_device <= self.peak_flops:
            return model_flops_utilization(flops, 1, seconds, self.peak_flops)  # the window's FLOPs as one batch
        if not self._peak_warned:
            self._peak_warned = True
            why = ("measured on this CPU, twice: other processes were using it or its clock varies" if self._measured_peak
                   else "given by logging.peak_flops or the device table: it is too low")
            log.warning("MFU not reported: this device runs %.3g model FLOP/s, above its peak of %.3g FLOP/s (%s). Set "
                        "logging.peak_flops to the device's peak FLOP/s to report MFU.", per_device, self.peak_flops, why)
        return None

    def _slide(self, entry: tuple[float, ...]) -> list[float]:
        """Add a step to the window and return the window's column sums (kept running: O(1) per
        step; recomputed exactly once per window length so rounding never accumulates)."""
        if len(self._window) == self._window.maxlen:
            old = self._window[0]
            self._sums = [a - b for a, b in zip(self._sums, old, strict=True)]
        self._window.append(entry)
        self._sums = [a + b for a, b in zip(self._sums, entry, strict=True)]
        self._slides += 1
        if self._slides % self._window.maxlen == 0:
            self._sums = [float(sum(col)) for col in zip(*self._window, strict=True)]
        return self._sums

    def _host_rss(self) -> float:
        """Host RSS, re-read at most once a second (a /proc read per step is most of the meter's cost)."""
        now = time.monotonic()
        if now - self._rss_at >= 1.0:
            self._rss, self._rss_at = host_rss_mb(), now
        return self._rss

    def state_dict(self) -> dict[str, int]:
        return {"total_samples": self.total_samples, "total_tokens": self.total_tokens}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.total_samples = int(state.get("total_samples", 0))
        self.total_tokens = int(state.get("total_tokens", 0))


def step_time_skew(local_step_time: float, gather_fn: Callable[[Any], Any], device: Any = None) -> dict[str, Any]:
    """Gather every rank's step time and name the slowest rank (call on all ranks together).

    ``gather_fn`` maps a 1-element tensor to the concatenation of all ranks' tensors in rank order
    (``accelerator.gather`` does exactly that; pass ``device=accelerator.device`` for NCCL).
    """
    import torch

    local = torch.tensor([float(local_step_time)], dtype=torch.float64, device=device)
    times = [float(x) for x in gather_fn(local).detach().reshape(-1).cpu().tolist()]
    if not times or any(math.isnan(x) for x in times):
        raise ValueError(f"step_time_skew: gathered step times are unusable: {times}")
    slowest = max(range(len(times)), key=times.__getitem__)
    mean = sum(times) / len(times)
    return {
        "step_time_max": times[slowest],
        "step_time_min": min(times),
        "step_time_mean": mean,
        "step_time_skew": times[slowest] / mean if mean > 0 else float("nan"),
        "slowest_rank": slowest,
        "step_times": times,
    }
