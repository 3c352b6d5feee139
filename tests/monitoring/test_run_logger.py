"""RunLogger: metrics.jsonl, TensorBoard read back with EventAccumulator, console, resume."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from monitoring import RunLogger
from pipelines.engine.config import LoggingConfig


def _lines(run_dir: Path) -> list[dict]:
    text = (run_dir / "metrics.jsonl").read_text(encoding="utf-8")
    assert text.endswith("\n")

    def strict(name: str) -> None:
        raise AssertionError(f"non-strict JSON constant {name} in metrics.jsonl")

    return [json.loads(line, parse_constant=strict) for line in text.splitlines()]


def _accumulator(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def test_tiny_loop_metrics_jsonl(finished_run: Path) -> None:
    lines = _lines(finished_run)
    train = [r for r in lines if r.get("split") == "train"]
    evals = [r for r in lines if r.get("split") == "eval"]
    assert [r["step"] for r in train] == [10, 20, 30, 40, 50]
    assert [r["step"] for r in evals] == [25, 50]
    for r in train:
        for key in (
            "loss",
            "lr",
            "grad_norm",
            "tokens_per_s",
            "samples_per_s",
            "step_time",
            "mfu",
            "data_wait_share",
            "host_rss_mb",
            "time",
        ):
            assert isinstance(r[key], float), key
        assert r["tokens"] == r["step"] * 8 * 16
        assert 0 < r["mfu"] < 1.5  # CPU peak is the measured matmul rate, tiny MLP is far below it
    assert all(isinstance(r["loss"], float) and r["perplexity"] > 1 for r in evals)


def test_tiny_loop_tensorboard_scalars_and_histograms(finished_run: Path) -> None:
    acc = _accumulator(finished_run)
    scalars = set(acc.Tags()["scalars"])
    expected = {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_s",
        "train/mfu",
        "train/step_time",
        "train/data_wait_share",
        "eval/loss",
        "eval/perplexity",
        "eval/accuracy",
    }
    assert expected <= scalars, expected - scalars
    assert [e.step for e in acc.Scalars("train/loss")] == [10, 20, 30, 40, 50]
    assert [e.step for e in acc.Scalars("eval/loss")] == [25, 50]
    jsonl = {r["step"]: r["loss"] for r in _lines(finished_run) if r.get("split") == "train"}
    for e in acc.Scalars("train/loss"):
        assert e.value == pytest.approx(jsonl[e.step], rel=1e-6)
    assert "weights/0" in acc.Tags()["histograms"]
    assert [h.step for h in acc.Histograms("weights/0")] == [25, 50]
    assert "config" in "".join(acc.Tags().get("tensors", []))  # the run config as TensorBoard text


def test_ready_made_histogram(tmp_path: Path) -> None:
    with RunLogger(tmp_path, LoggingConfig(progress=False), is_main=True, total_steps=5) as lg:
        lg.log_histogram(3, "grad/hist", counts=[1, 4, 2], edges=[-1.0, 0.0, 1.0, 2.0])
        with pytest.raises(ValueError, match="edges"):
            lg.log_histogram(4, "grad/hist", counts=[1, 2], edges=[0.0, 1.0])
    (h,) = _accumulator(tmp_path).Histograms("grad/hist")
    assert h.step == 3 and h.histogram_value.num == 7
    assert list(h.histogram_value.bucket) == [1, 4, 2] and list(h.histogram_value.bucket_limit) == [0.0, 1.0, 2.0]


def test_non_main_rank_writes_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "rank1"
    logger = RunLogger(run_dir, LoggingConfig(), is_main=False, total_steps=10)
    logger.log(1, {"loss": 1.0})
    logger.event(1, "x", "y")
    logger.log_histogram(1, "h", [1.0, 2.0])
    assert logger.truncate_after(0) == 0
    logger.close()
    assert not run_dir.exists()


def test_events_and_nonfinite_values_are_strict_json(tmp_path: Path) -> None:
    with RunLogger(tmp_path, LoggingConfig(progress=False, tensorboard=False), is_main=True, total_steps=5) as lg:
        lg.log(1, {"loss": float("nan"), "grad_norm": float("inf"), "note": "text", "flag": True})
        lg.event(1, "resume", "resumed from step 0", checkpoint="step-0")
    a, b = _lines(tmp_path)
    assert a == {**a, "step": 1, "split": "train", "loss": "nan", "grad_norm": "inf", "note": "text", "flag": True}
    assert b["event"] == "resume" and b["message"] == "resumed from step 0" and b["checkpoint"] == "step-0"
    assert "split" not in b


def test_compact_console_lines_without_tty(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert not sys.stdout.isatty()
    with RunLogger(tmp_path, LoggingConfig(tensorboard=False), is_main=True, total_steps=50) as lg:
        assert lg.sinks["console"].progress is None  # progress=True but stdout is not a terminal
        lg.log(10, {"loss": 2.5, "lr": 1e-3, "tokens_per_s": 12345.0, "mfu": 0.25})
        lg.log(20, {"loss": 2.0, "lr": 1e-3, "tokens_per_s": 12345.0, "mfu": 0.25})
        lg.event(20, "loss_spike", "loss jumped")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[step 10/50 20%] train") and "loss 2.5000" in out[0] and "tok/s 12,345" in out[0]
    assert "mfu 25.0%" in out[0] and "lr 1.00e-03" in out[0]
    assert "eta " in out[1]
    assert out[2] == "[step 20] loss_spike: loss jumped"


def test_progress_bar_on_a_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a real pseudo-terminal the rich bar is used and shows the step count."""
    master, slave = os.openpty()
    tty = os.fdopen(slave, "w", buffering=1)
    monkeypatch.setattr(sys, "stdout", tty)
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.delenv("NO_COLOR", raising=False)
    lg = RunLogger(tmp_path, LoggingConfig(tensorboard=False), is_main=True, total_steps=40)
    try:
        assert lg.sinks["console"].progress is not None
        lg.log(20, {"loss": 1.25, "lr": 1e-3})
        lg.event(20, "note", "an event above the bar")
    finally:
        lg.close()
        tty.flush()
    os.set_blocking(master, False)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except (BlockingIOError, OSError):
            break
        if not chunk:
            break
        chunks.append(chunk)
    tty.close()
    os.close(master)
    screen = b"".join(chunks).decode("utf-8", "replace")
    assert "20/40" in screen and "loss 1.2500" in screen and "an event above the bar" in screen


def _session(run_dir: Path, steps: range, *, truncate: int | None = None, tear: bool = False) -> None:
    lg = RunLogger(run_dir, LoggingConfig(progress=False), is_main=True, total_steps=40)
    if truncate is not None:
        lg.truncate_after(truncate)
    for s in steps:
        lg.log(s, {"loss": float(s) + (0.5 if truncate is not None or steps.start > 1 else 0.0)})
    lg.close()
    if tear:  # a crash in the middle of writing a line
        with open(run_dir / "metrics.jsonl", "a") as fh:
            fh.write('{"step": 31, "split": "tr')


@pytest.mark.parametrize("explicit", [True, False], ids=["truncate_after", "automatic"])
def test_resume_never_shows_a_step_twice(tmp_path: Path, explicit: bool) -> None:
    _session(tmp_path, range(1, 31), tear=True)  # crashed after step 30, checkpoint was at 20
    _session(tmp_path, range(21, 41), truncate=20 if explicit else None)
    lines = _lines(tmp_path)  # also proves the torn line is gone
    assert [r["step"] for r in lines] == list(range(1, 41))
    assert all(r["loss"] == r["step"] + (0.5 if r["step"] > 20 else 0.0) for r in lines)
    acc = _accumulator(tmp_path)
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == list(range(1, 41))  # TensorBoard purged the stale 21..30
    assert all(e.value == e.step + (0.5 if e.step > 20 else 0.0) for e in events)


def test_resume_event_keeps_earlier_lines(tmp_path: Path) -> None:
    _session(tmp_path, range(1, 31))
    lg = RunLogger(tmp_path, LoggingConfig(progress=False, tensorboard=False), is_main=True, total_steps=40)
    lg.event(20, "resume", "resumed from step-20")  # drops the stale 21..30 but keeps step 20
    lg.log(21, {"loss": 0.0})
    lg.close()
    steps = [(r["step"], r.get("event")) for r in _lines(tmp_path)]
    assert steps == [(s, None) for s in range(1, 21)] + [(20, "resume"), (21, None)]


@pytest.mark.slow  # wandb's service process takes ~10-50 s to start on 2 shared cores
def test_resumed_run_logs_to_the_same_wandb_run(tmp_path: Path, monkeypatch) -> None:
    """A requeued job (a second RunLogger on the same run dir) continues the W&B run of the first.

    Uses the real ``wandb`` package in offline mode (``pip install pretrain[wandb]``).
    """
    pytest.importorskip("wandb")
    from accelerate import PartialState

    PartialState()  # as the trainer's Accelerator does; accelerate's trackers need it
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = LoggingConfig(progress=False, tensorboard=False, wandb=True)
    ids = []
    for session, steps in enumerate(((1, 2), (3, 4))):
        logger = RunLogger(tmp_path, cfg, is_main=True, total_steps=4, config_dict={"session": session})
        tracker = logger.sinks["wandb"].tracker
        ids.append(tracker.run.id)
        for step in steps:
            logger.log(step, {"loss": 1.0 / step})
        logger.close()
    assert ids[0] == ids[1], f"the requeued session started another W&B run: {ids}"
    assert (tmp_path / "wandb_run_id").read_text().strip() == ids[0]
    offline = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    # one directory per session, both of that run; wandb adds "-1" when both started in the same second
    assert len(offline) == 2 and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{ids[0]}(-\d+)?", n) for n in offline), offline
