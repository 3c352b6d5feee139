"""HealthMonitor in a real loop: NaN policies, loss spikes, data starvation."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from monitoring import HealthMonitor
from pipelines.engine.config import LoggingConfig


def _events(run_dir: Path, prefix: str = "") -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "event" in r and r["event"].startswith(prefix)]


def test_nan_skip_step_skips_then_recovers(tmp_path: Path, tiny_loop) -> None:
    import torch

    snapshots = {}

    def on_step(step: int, _stats: dict, model) -> None:
        snapshots[step] = [p.detach().clone() for p in model.parameters()]

    cfg = LoggingConfig(progress=False, nan_policy="skip_step", max_consecutive_nan=3)
    out = tiny_loop(tmp_path, steps=30, cfg=cfg, nan_steps=frozenset({12, 13}), on_step=on_step)
    statuses = out["statuses"]
    assert [s for s, v in statuses.items() if v != "ok"] == [12, 13]
    assert statuses[12] == statuses[13] == "skip" and len(statuses) == 30  # the run went on
    for step in (12, 13):  # a skipped step leaves the weights exactly as they were
        assert all(torch.equal(a, b) for a, b in zip(snapshots[step - 1], snapshots[step], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[13], snapshots[14], strict=True))
    health = out["health"]
    assert health.nan_steps == 2 and health.consecutive_nan == 0
    kinds = [(e["step"], e["event"]) for e in _events(tmp_path, "nan")]
    assert kinds == [(12, "nan_skip"), (13, "nan_skip")]
    skip = next(e for e in _events(tmp_path, "nan") if e["step"] == 13)
    assert skip["consecutive"] == 2 and skip["loss"] == "nan"


def test_nan_skip_step_stops_after_max_consecutive(tmp_path: Path, tiny_loop) -> None:
    cfg = LoggingConfig(progress=False, nan_policy="skip_step", max_consecutive_nan=3)
    out = tiny_loop(tmp_path, steps=30, cfg=cfg, nan_steps=frozenset(range(5, 30)))
    statuses = out["statuses"]
    assert [statuses[s] for s in (5, 6, 7)] == ["skip", "skip", "stop"]
    assert max(statuses) == 7  # the loop obeyed
    assert [e["event"] for e in _events(tmp_path, "nan")] == ["nan_skip", "nan_skip", "nan_stop"]


def test_nan_stop_policy_stops_at_once(tmp_path: Path, tiny_loop) -> None:
    cfg = LoggingConfig(progress=False, nan_policy="stop")
    out = tiny_loop(tmp_path, steps=30, cfg=cfg, nan_steps=frozenset({9}))
    assert out["statuses"][9] == "stop" and max(out["statuses"]) == 9
    assert all(v == "ok" for s, v in out["statuses"].items() if s < 9)
    (event,) = _events(tmp_path, "nan")
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


def test_throttled_data_source_triggers_starvation_warning(tmp_path: Path, tiny_loop) -> None:
    cfg = LoggingConfig(progress=False, starvation_share=0.10)
    tiny_loop(tmp_path, steps=12, log_every=100, eval_every=0, cfg=cfg, data_delay_s=0.03)
    events = _events(tmp_path)
    assert [e["event"] for e in events] == ["data_starvation"]  # warned once, not every step
    assert events[0]["step"] == 5 and events[0]["share"] > 0.25  # after the 5-step window filled


def test_fast_data_source_does_not_warn(tmp_path: Path, tiny_loop) -> None:
    cfg = LoggingConfig(progress=False, starvation_share=0.60)
    tiny_loop(tmp_path, steps=12, log_every=100, eval_every=0, cfg=cfg)
    assert _events(tmp_path) == []


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
