"""Reading a step's values one step late changes when the host learns them, never what is trained.

Between log steps ``Trainer`` queues step n+1 before it reads step n (pipelines/engine/trainer.py); a
non-finite loss then skips the update through NaN gradients, and with ``optim.kernel=fused`` the skip is
decided on the device (``found_inf``) and the LR schedule steps when the norm is read. These runs go
through the real ``Trainer`` (``trainer_job.py``, as the health tests) with a NaN batch in the middle, once
reading every step at once (``train.read_late=false``) and once late, and compare weights and optimizer
state before every step, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trainer_job import events, run_job

from pipelines.engine.host_reads import HostCopy, StepOutcome


def _run(tmp_path: Path, name: str, **spec):
    return run_job({"run_dir": tmp_path / name, "steps": 12, **spec})


@pytest.mark.parametrize("kernel", ["default", "fused"])
def test_a_run_read_one_step_late_trains_what_a_run_read_every_step_trains(kernel, tmp_path, world_of_one):
    import torch

    spec = {"kernel": kernel, "nan_at": [[0, 6, 0]], "checkpoint_every": 0}
    now, now_task = _run(tmp_path, "now", log_every=100, read_late=False, **spec)
    late, late_task = _run(tmp_path, "late", log_every=100, **spec)
    assert sorted(now_task.weights_at) == sorted(late_task.weights_at) == list(range(1, 13))
    for step in range(1, 13):
        assert torch.equal(now_task.weights_at[step], late_task.weights_at[step]), step
        assert now_task.moments_at[step] == late_task.moments_at[step], step
    assert torch.equal(late_task.weights_at[6], late_task.weights_at[7])  # the NaN step was not applied
    assert not torch.equal(late_task.weights_at[7], late_task.weights_at[8])
    for key in ("steps", "tokens", "start_loss", "end_loss", "stopped_by"):
        assert now[key] == late[key], key
    assert late["tokens"] == 11 * 4  # the skipped step's samples are not counted
    assert [(e["step"], e["event"]) for e in events(late["run_dir"]) if e["event"].startswith("nan")] == [(6, "nan_skip")]
    for summary in (now, late):  # the LR schedule stepped on the 11 applied updates only, in both
        state = json.loads((Path(summary["checkpoint"]) / "trainer_state.json").read_text())
        assert state["health"]["nan_steps"] == 1
    sched = [torch.load(Path(s["checkpoint"]) / "engine" / "lr_scheduler.pt", weights_only=True) for s in (now, late)]
    assert sched[0]["last_epoch"] == sched[1]["last_epoch"] == 11


def test_a_stop_found_late_takes_effect_after_the_step_already_queued(tmp_path, world_of_one):
    """``nan_policy=stop``: the NaN of step 9 is read while step 10 runs; the run stops after step 10, whose
    update (good) is kept: the checkpoint holds the last good state, step 10, as the stop event says."""
    import torch

    summary, task = _run(tmp_path, "run", kernel="fused", log_every=100, nan_policy="stop", nan_at=[[0, 9, 0]])
    assert summary["stopped_by"] == "health" and max(task.weights_at) == 10 and summary["steps"] == 10
    assert torch.equal(task.weights_at[9], task.weights_at[10])  # step 9 was skipped
    (event,) = [e for e in events(summary["run_dir"]) if e["event"].startswith("nan")]
    assert event["event"] == "nan_stop" and event["step"] == 9
    (stop,) = events(summary["run_dir"], "stop")
    assert stop["failed_step"] == 9 and stop["last_good_step"] == 10


def test_consecutive_nan_steps_stop_with_the_last_good_state_when_read_late(tmp_path, world_of_one):
    """NaN from step 5 on with at most 3 in a row: the third (step 7) is read while step 8 runs -- also NaN,
    also skipped -- so the run keeps step 4's weights, as a run read every step does."""
    summary, task = _run(tmp_path, "run", log_every=100, max_consecutive_nan=3, nan_at=[[0, s, 0] for s in range(5, 13)])
    assert summary["stopped_by"] == "health" and summary["steps"] == 4 and max(task.weights_at) == 8
    assert [e["event"] for e in events(summary["run_dir"]) if e["event"].startswith("nan")] == ["nan_skip", "nan_skip",
                                                                                               "nan_stop"]


def test_a_step_outcome_is_read_once_the_engine_settles_it():
    import torch

    pending: list[StepOutcome] = []

    def settle() -> None:
        pending.pop().resolve({"grad_norm": HostCopy(torch.tensor([2.5])).tolist()[0], "lr": 0.1, "skipped": False})

    outcome = StepOutcome(settle=settle)
    pending.append(outcome)
    assert outcome.get()["grad_norm"] == 2.5 and not pending
    assert outcome.get()["lr"] == 0.1  # read once, kept
    with pytest.raises(RuntimeError, match="without resolving"):
        StepOutcome(settle=lambda: None).get()
