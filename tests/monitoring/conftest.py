"""Fixtures for the monitoring tests.

``write_logged_run`` writes a run directory through the real ``RunLogger`` / ``ThroughputMeter`` /
``HealthMonitor`` from a known loss curve: input for the logger and report tests, which test how
metrics are written and drawn. How the training loop applies the health policies is tested through
the real ``Trainer`` (``trainer_job.py``, ``test_health.py``, ``test_trainer_health.py``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from core.config import save_config, to_dict
from pipelines.engine.config import LoggingConfig, RunConfig

BATCH, SEQ = 8, 16
FLOPS_PER_SAMPLE = 6 * 676  # a 16-32-4 MLP's parameters, 6 N per sample


def write_logged_run(
    run_dir: Path,
    *,
    steps: int = 50,
    log_every: int = 10,
    eval_every: int = 25,
    cfg: LoggingConfig | None = None,
    nan_steps: frozenset[int] = frozenset(),
) -> Path:
    """A run dir (config.yaml, metrics.jsonl, tb/) of ``steps`` steps of BATCH x SEQ tokens each; the
    train loss is 2 exp(-step / 20) + 0.1 (NaN at ``nan_steps``, which the health monitor reports)."""
    import torch

    from monitoring import HealthMonitor, RunLogger, ThroughputMeter
    from monitoring.throughput import resolve_peak_flops

    cfg = cfg or LoggingConfig(progress=False)
    run_cfg = RunConfig()
    run_cfg.train.max_steps = steps
    run_cfg.model.name = "tiny-mlp"
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(run_cfg, run_dir / "config.yaml")
    meter = ThroughputMeter(flops_per_sample=FLOPS_PER_SAMPLE, peak_flops=resolve_peak_flops(cfg.peak_flops, "cpu"))
    weights = torch.linspace(-1.0, 1.0, 16 * 32).reshape(32, 16)
    with RunLogger(run_dir, cfg, is_main=True, total_steps=steps, config_dict=to_dict(run_cfg)) as logger:
        health = HealthMonitor(cfg, logger)
        for step in range(1, steps + 1):
            meter.start_step()
            time.sleep(0.001)
            meter.data_ready()
            time.sleep(0.002)
            loss = float("nan") if step in nan_steps else 2.0 * math.exp(-step / 20) + 0.1
            health.check(step, loss, 1.0)
            stats = meter.end_step(samples=BATCH, tokens=BATCH * SEQ)
            if step % log_every == 0:
                logger.log(step, {"loss": loss, "lr": 1e-2, "grad_norm": 1.0, "tokens": meter.total_tokens, **stats})
            if step % 25 == 0:
                logger.log_histogram(step, "weights/0", weights * step)
            if eval_every and step % eval_every == 0:
                eval_loss = loss + 0.05
                logger.log(step, {"loss": eval_loss, "perplexity": math.exp(eval_loss), "accuracy": 0.5}, split="eval")
    return run_dir


@pytest.fixture
def logged_run() -> Callable[..., Path]:
    return write_logged_run


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One completed 50-step run dir shared by the read-only tests."""
    return write_logged_run(tmp_path_factory.mktemp("runs") / "mlp-run")


@pytest.fixture
def world_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-process Trainer job reads the torch.distributed variables; monkeypatch removes them after."""
    from pipelines.engine.distributed import free_port

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
