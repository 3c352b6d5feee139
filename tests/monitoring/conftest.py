"""A tiny real training loop driven through RunLogger / ThroughputMeter / HealthMonitor."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from core.config import save_config, to_dict
from pipelines.engine.config import LoggingConfig, RunConfig


def run_tiny_loop(
    run_dir: Path,
    *,
    steps: int = 50,
    log_every: int = 10,
    eval_every: int = 25,
    cfg: LoggingConfig | None = None,
    nan_steps: frozenset[int] = frozenset(),
    data_delay_s: float = 0.0,
    first_step: int = 1,
    logger_kwargs: dict[str, Any] | None = None,
    on_step: Callable[[int, dict[str, Any], Any], None] | None = None,
) -> dict[str, Any]:
    """Train a 2-layer MLP on random data the way the trainer will, returning what happened.

    ``nan_steps`` poisons the loss at those steps (a real NaN through backward); ``data_delay_s``
    throttles the data source with a sleep per batch.
    """
    import torch

    from monitoring import HealthMonitor, RunLogger, ThroughputMeter
    from monitoring.throughput import resolve_peak_flops

    torch.manual_seed(0)
    cfg = cfg or LoggingConfig(progress=False)
    run_cfg = RunConfig()
    run_cfg.train.max_steps = steps
    run_cfg.model.name = "tiny-mlp"
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(run_cfg, run_dir / "config.yaml")

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch, seq = 8, 16
    params = sum(p.numel() for p in model.parameters())
    meter = ThroughputMeter(flops_per_sample=6 * params, peak_flops=resolve_peak_flops(cfg.peak_flops, "cpu"))
    logger = RunLogger(
        run_dir, cfg, is_main=True, total_steps=steps, config_dict=to_dict(run_cfg), **(logger_kwargs or {})
    )
    health = HealthMonitor(cfg, logger, starvation_window=5)
    statuses: dict[int, str] = {}

    def fetch() -> tuple[torch.Tensor, torch.Tensor]:
        if data_delay_s:
            time.sleep(data_delay_s)
        x = torch.randn(batch, 16)
        return x, x[:, :4] * 2.0

    try:
        for step in range(first_step, steps + 1):
            meter.start_step()
            x, y = fetch()
            meter.data_ready()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if step in nan_steps:
                loss = loss * float("nan")
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            status = health.check(step, loss.detach(), grad_norm)
            statuses[step] = status
            if status == "ok":
                opt.step()
            opt.zero_grad(set_to_none=True)
            stats = meter.end_step(samples=batch, tokens=batch * seq)
            health.observe_data_wait(step, stats["data_wait_share"])
            if on_step is not None:
                on_step(step, stats, model)
            if status == "stop":
                break
            if step % log_every == 0:
                logger.log(
                    step,
                    {
                        "loss": loss.detach(),
                        "lr": opt.param_groups[0]["lr"],
                        "grad_norm": grad_norm,
                        "tokens": meter.total_tokens,
                        **stats,
                    },
                )
            if step % 25 == 0:
                logger.log_histogram(step, "weights/0", model[0].weight)
            if eval_every and step % eval_every == 0:
                with torch.no_grad():
                    xe, ye = fetch()
                    eval_loss = torch.nn.functional.mse_loss(model(xe), ye)
                logger.log(
                    step, {"loss": eval_loss, "perplexity": float(torch.exp(eval_loss)), "accuracy": 0.5}, split="eval"
                )
    finally:
        logger.close()
    return {"statuses": statuses, "health": health, "meter": meter, "model": model}


@pytest.fixture
def tiny_loop() -> Callable[..., dict[str, Any]]:
    return run_tiny_loop


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One completed 50-step run shared by the read-only tests (saves CPU on a shared box)."""
    run_dir = tmp_path_factory.mktemp("runs") / "mlp-run"
    run_tiny_loop(run_dir)
    return run_dir
