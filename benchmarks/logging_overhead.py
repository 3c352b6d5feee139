"""Benchmark: the cost of monitoring (RunLogger + ThroughputMeter + HealthMonitor) per training step.

Goal (issue #9): < 2 % of a small step at default settings (log every 10 steps). The "small step"
is a transformer-FFN-sized MLP (256 -> 1024 -> 256) over 256 token rows, the size of a
bert-tiny-class micro-batch; monitoring time is measured around the real calls, in the same run.

    python benchmarks/logging_overhead.py [--steps 200]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from monitoring import HealthMonitor, RunLogger, ThroughputMeter
from pipelines.config import LoggingConfig, TrainConfig


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
    train_time = monitor_time = 0.0
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
        train_time += (t2 - t1) + (t4 - t3)
        monitor_time += (t1 - t0) + (t3 - t2) + (t5 - t4)
    logger.close()
    share = monitor_time / train_time
    print(
        f"monitoring overhead: {monitor_time / steps * 1e6:.0f} us/step = {share:.2%} of a "
        f"{train_time / steps * 1e3:.1f} ms step (log_every={log_every}; goal < 2 %)"
    )
    return share


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        measure(Path(tmp), args.steps)
