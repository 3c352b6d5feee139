"""Benchmark: the cost of monitoring (RunLogger + ThroughputMeter + HealthMonitor) per training step.

Goal (issue #9): < 2 % of a small step at default settings (log every 10 steps). The "small step"
is a transformer-FFN-sized MLP (256 -> 1024 -> 256) over 256 token rows, the size of a
bert-tiny-class micro-batch; monitoring time is measured around the real calls, in the same run.

    python benchmarks/logging_overhead.py [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from monitoring import HealthMonitor, RunLogger, ThroughputMeter
from pipelines.engine.config import LoggingConfig, TrainConfig


def measure(tmp_path: Path, steps: int) -> float:
    import torch

    torch.manual_seed(0)
    cfg = LoggingConfig()  # defaults: TensorBoard on, progress on (compact lines: no TTY here)
    log_every = TrainConfig().log_every
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(256, 256)
    logger = RunLogger(tmp_path, cfg, is_main=True, total_steps=1000, config_dict={"a": 1})
    health = HealthMonitor(cfg, logger)
    meter = ThroughputMeter(flops_per_sample=6 * 2 * 256 * 1024, peak_flops=1e11)
    train_times, plain_steps, log_steps = [], [], []
    warmup = log_every  # steady state: one-time costs (first TensorBoard write) excluded
    for step in range(1, warmup + steps + 1):
        t0 = time.perf_counter()
        meter.start_step()
        meter.data_ready()
        t1 = time.perf_counter()
        loss = model(x).pow(2).mean()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        loss_value = loss.item()
        t2 = time.perf_counter()
        status = health.check(step, loss_value, grad_norm)
        t3 = time.perf_counter()
        if status == "ok":
            opt.step()
        opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        stats = meter.end_step(samples=64, tokens=64 * 128)
        health.observe_data_wait(step, stats["data_wait_share"])
        if step % log_every == 0:
            logger.log(step, {"loss": loss_value, "lr": 1e-3, "grad_norm": grad_norm, **stats})
        t5 = time.perf_counter()
        if step <= warmup:
            continue
        train_times.append((t2 - t1) + (t4 - t3))
        (log_steps if step % log_every == 0 else plain_steps).append((t1 - t0) + (t3 - t2) + (t5 - t4))
    logger.close()
    # Medians: on a shared machine a preempted step inflates a mean but not a median.
    monitor = statistics.median(plain_steps) + (statistics.median(log_steps) - statistics.median(plain_steps)) / log_every
    train = statistics.median(train_times)
    share = monitor / train
    mean_share = (sum(plain_steps) + sum(log_steps)) / sum(train_times)
    print(
        f"monitoring overhead: {monitor * 1e6:.0f} us/step = {share:.2%} of a {train * 1e3:.1f} ms step "
        f"(medians; a log step costs {statistics.median(log_steps) * 1e6:.0f} us; means give {mean_share:.2%}; "
        f"log_every={log_every}; goal < 2 %)"
    )
    return share


def components(tmp_path: Path, calls: int = 3000) -> float:
    """Median cost of each monitoring call on its own (no training step to compete with): a figure
    that stays meaningful on a shared machine, where every timed region is inflated by preemption."""
    cfg = LoggingConfig()
    log_every = TrainConfig().log_every
    logger = RunLogger(tmp_path, cfg, is_main=True, total_steps=10**6, config_dict={"a": 1})
    health = HealthMonitor(cfg, logger)
    meter = ThroughputMeter(flops_per_sample=1e6, peak_flops=1e11)

    def median_us(fn: Any, n: int) -> float:
        times = []
        for i in range(n):
            t0 = time.perf_counter()
            fn(i)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    def per_step(i: int) -> None:
        meter.start_step()
        meter.data_ready()
        stats = meter.end_step(samples=64, tokens=64 * 128)
        health.check(i, 2.0 + (i % 7) * 0.01, 1.5)
        health.observe_data_wait(i, stats["data_wait_share"])

    step_us = median_us(per_step, calls)
    meter.start_step()
    meter.data_ready()
    stats = meter.end_step(samples=64, tokens=64 * 128)
    log_us = median_us(lambda i: logger.log(10 + i, {"loss": 2.0, "lr": 1e-3, "grad_norm": 1.5, "tokens": i, **stats}),
                       calls // 6)
    logger.close()
    total = step_us + log_us / log_every
    print(f"per call (medians): meter + health {step_us:.1f} us/step, log {log_us:.0f} us -> {total:.0f} us/step "
          f"at log_every={log_every}")
    return total


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        measure(Path(tmp) / "loop", args.steps)
        components(Path(tmp) / "calls")
