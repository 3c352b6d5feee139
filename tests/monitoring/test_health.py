"""HealthMonitor: NaN policies, loss spikes, data starvation -- through the real ``Trainer`` (``trainer_job``)
where the loop's behaviour is asserted, directly on the monitor for its own arithmetic."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from trainer_job import events, run_job

from monitoring import HealthMonitor
from pipelines.engine.config import LoggingConfig


def _events(run_dir: Path, prefix: str = "") -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "event" in r and r["event"].startswith(prefix)]


def test_nan_skip_step_skips_then_recovers(tmp_path: Path, world_of_one) -> None:
    import torch

    run_dir = tmp_path / "run"
    summary, task = run_job({"run_dir": run_dir, "steps": 16, "nan_policy": "skip_step", "max_consecutive_nan": 3,
                             "nan_at": [[0, 12, 0], [0, 13, 0]]})
    assert summary["steps"] == 16 and summary["stopped_by"] is None  # the run went on
    w = task.weights_at  # weights each step starts from
    assert torch.equal(w[12], w[13]) and torch.equal(w[13], w[14])  # a skipped step leaves the weights exactly as they were
    assert task.moments_at[12] == task.moments_at[14]  # and the optimizer state
    assert not torch.equal(w[14], w[15]) and not torch.equal(w[11], w[12])
    kinds = [(e["step"], e["event"]) for e in events(run_dir) if e["event"].startswith("nan")]
    assert kinds == [(12, "nan_skip"), (13, "nan_skip")]
    skip = next(e for e in events(run_dir, "nan_skip") if e["step"] == 13)
    assert skip["consecutive"] == 2 and skip["loss"] == "nan"
    state = json.loads((Path(summary["checkpoint"]) / "trainer_state.json").read_text())
    assert state["health"]["nan_steps"] == 2 and state["health"]["consecutive_nan"] == 0


def test_nan_skip_step_stops_after_max_consecutive(tmp_path: Path, world_of_one) -> None:
    run_dir = tmp_path / "run"
    summary, task = run_job({"run_dir": run_dir, "steps": 16, "nan_policy": "skip_step", "max_consecutive_nan": 3,
                             "nan_at": [[0, s, 0] for s in range(5, 17)]})
    assert summary["stopped_by"] == "health" and summary["steps"] == 4  # the loop obeyed; step 4 was the last good
    assert [e["event"] for e in events(run_dir) if e["event"].startswith("nan")] == ["nan_skip", "nan_skip", "nan_stop"]
    assert events(run_dir, "nan_stop")[0]["step"] == 7 and max(task.weights_at) == 7  # no step after 7 ran


def test_nan_stop_policy_stops_at_once(tmp_path: Path, world_of_one) -> None:
    import torch

    run_dir = tmp_path / "run"
    summary, task = run_job({"run_dir": run_dir, "steps": 16, "nan_policy": "stop", "nan_at": [[0, 9, 0]]})
    assert summary["stopped_by"] == "health" and summary["steps"] == 8 and max(task.weights_at) == 9
    assert all(not torch.equal(task.weights_at[s], task.weights_at[s + 1]) for s in range(1, 9))  # steps 1..8 applied
    (event,) = [e for e in events(run_dir) if e["event"].startswith("nan")]
    assert event["event"] == "nan_stop" and event["step"] == 9 and "nan_policy=stop" in event["message"]


def test_infinite_gradient_norm_alone_is_caught() -> None:
    health = HealthMonitor(LoggingConfig(nan_policy="skip_step"))
    assert health.check(1, 2.0, math.inf) == "skip"
    assert health.events[0]["grad_norm"] == "inf" and "grad_norm" in health.events[0]["message"]
    assert health.check(2, 2.0, 1.0) == "ok" and health.consecutive_nan == 0


def test_loss_spike_is_an_event_not_a_stop() -> None:
    rng = random.Random(0)
    health = HealthMonitor(LoggingConfig(spike_zscore=6.0))
    for step in range(1, 101):
        assert health.check(step, 3.0 - step * 0.005 + rng.gauss(0, 0.02), 1.0) == "ok"
    assert health.events == []  # an ordinary noisy, decreasing curve is not a spike
    assert health.check(101, 4.0, 1.0) == "ok"
    (event,) = health.events
    assert event["event"] == "loss_spike" and event["step"] == 101 and event["zscore"] > 6
    state = health.state_dict()
    again = HealthMonitor(LoggingConfig(spike_zscore=6.0))
    again.load_state_dict(json.loads(json.dumps(state)))
    assert again.check(102, 4.5, 1.0) == "ok" and again.spikes == 2


def test_throttled_data_source_triggers_one_starvation_warning(tmp_path: Path, world_of_one) -> None:
    run_dir = tmp_path / "run"
    run_job({"run_dir": run_dir, "steps": 30, "log_every": 100, "data_delay_s": 0.03, "starvation_share": 0.10})
    found = events(run_dir)
    assert [e["event"] for e in found] == ["data_starvation"]  # warned once, not every step
    assert found[0]["step"] == 20 and found[0]["share"] > 0.25  # after the 20-step window filled


def test_fast_data_source_does_not_warn(tmp_path: Path, world_of_one) -> None:
    run_dir = tmp_path / "run"
    run_job({"run_dir": run_dir, "steps": 30, "log_every": 100, "starvation_share": 0.60})
    assert events(run_dir) == []


def test_starvation_episode_ends_and_can_recur() -> None:
    health = HealthMonitor(LoggingConfig(starvation_share=0.1), starvation_window=3)
    shares = [0.5] * 3 + [0.0] * 3 + [0.5] * 3
    kinds = [e["event"] for s, x in enumerate(shares) if (e := health.observe_data_wait(s, x))]
    assert kinds == ["data_starvation", "data_starvation_end", "data_starvation"]


def test_bad_policy_is_refused() -> None:
    cfg = LoggingConfig()
    cfg.nan_policy = "ignore"  # type: ignore[assignment]
    with pytest.raises(ValueError, match="nan_policy"):
        HealthMonitor(cfg)
