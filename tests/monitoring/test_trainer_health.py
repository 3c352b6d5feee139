"""Health policies and monitoring through the real ``Trainer`` (both engines), not a hand-written loop.

A corrupt sample (a NaN feature) is placed on an exact rank, step and micro-batch; the run must
keep that update out of the weights and the optimizer state, then follow ``logging.nan_policy``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_job import events, run_job

REPO = Path(__file__).resolve().parents[2]
ENGINES = ["ddp", "deepspeed"]


def _world_of_one(mp: pytest.MonkeyPatch) -> None:
    """The in-process job reads the torch.distributed variables; monkeypatch keeps them out of later tests."""
    from pipelines.engine.distributed import free_port

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        mp.setenv(key, value)


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    _world_of_one(monkeypatch)


def _train_lines(run_dir: Path) -> dict[int, dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if r.get("split") == "train"}


@pytest.fixture(scope="module")
def skipped_runs(tmp_path_factory):
    """Per engine: 8 steps of 2 micro-batches; step 3's second micro-batch is corrupt, so the
    gradients of its first micro-batch (already accumulated) must be dropped as well."""
    out = {}
    for engine in ENGINES:
        run_dir = tmp_path_factory.mktemp(engine) / "run"
        mp = pytest.MonkeyPatch()
        _world_of_one(mp)
        try:
            summary, task = run_job({"run_dir": run_dir, "steps": 8, "engine": engine, "grad_accum": 2, "nan_at": [[0, 3, 1]]})
        finally:
            mp.undo()
        out[engine] = (summary, task, run_dir)
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_skip_step_leaves_weights_and_optimizer_unchanged_and_finishes(skipped_runs, engine):
    summary, task, run_dir = skipped_runs[engine]
    assert summary["steps"] == 8 and summary["stopped_by"] is None
    w, m = task.weights_at, task.moments_at
    assert torch.equal(w[3], w[4]) and m[3] == m[4], "the NaN step changed the weights or Adam's state"
    for step in (1, 2, 4, 5, 6, 7):
        assert not torch.equal(w[step], w[step + 1]), f"step {step} did not update the weights"
    assert all(torch.isfinite(v).all() for v in w.values())
    nan = events(run_dir, "nan_skip")
    assert [e["step"] for e in nan] == [3] and "step 3" in nan[0]["message"] and "skipped" in nan[0]["message"]
    assert not events(run_dir, "nan_stop")
    train = _train_lines(run_dir)
    assert train[3]["loss"] == "nan" and train[4]["lr"] == train[3]["lr"]  # the schedule waits for a real update
    assert all(math.isfinite(train[s]["loss"]) for s in train if s != 3)
    assert summary["tokens"] == 7 * 2 * 4  # tokens trained on: the skipped step's are not counted


def test_engines_agree_after_a_skipped_step(skipped_runs):
    """DeepSpeed drops the partitioned gradients of the first micro-batch exactly as DDP does."""
    ddp, ds = (_train_lines(skipped_runs[e][2]) for e in ENGINES)
    for step in range(4, 9):
        assert ddp[step]["loss"] == pytest.approx(ds[step]["loss"], rel=1e-4), step


@pytest.mark.parametrize("engine", ENGINES)
def test_finite_loss_with_nan_gradients_is_skipped(tmp_path, engine):
    """The gradient check is the optimizer step's own (DDP: the clipping norm; DeepSpeed: its overflow check)."""
    run_dir = tmp_path / "run"
    summary, task = run_job({"run_dir": run_dir, "steps": 5, "engine": engine, "grad_accum": 2, "nan_grad_at": [[0, 2, 0]]})
    assert summary["steps"] == 5 and summary["stopped_by"] is None
    assert torch.equal(task.weights_at[2], task.weights_at[3]) and task.moments_at[2] == task.moments_at[3]
    assert not torch.equal(task.weights_at[3], task.weights_at[4])
    (nan,) = events(run_dir, "nan_skip")
    assert nan["step"] == 2 and "grad_norm" in nan["message"] and "loss" not in nan["message"].split(" at ")[0]
    train = _train_lines(run_dir)
    assert math.isfinite(train[2]["loss"]) and train[2]["grad_norm"] in ("nan", "inf")


def test_skip_step_stops_after_max_consecutive_with_last_good_checkpoint(tmp_path, capsys):
    run_dir = tmp_path / "run"
    summary, task = run_job({"run_dir": run_dir, "steps": 10, "max_consecutive_nan": 3,
                             "nan_at": [[0, 4, 0], [0, 5, 0], [0, 6, 0]]})
    assert summary["stopped_by"] == "health" and summary["steps"] == 3
    assert [(e["step"], e["event"]) for e in events(run_dir) if e["event"].startswith("nan")] == [
        (4, "nan_skip"), (5, "nan_skip"), (6, "nan_stop")]
    stop = events(run_dir, "stop")[-1]
    assert "step 6" in stop["message"] and "step-00000003" in stop["message"] and stop["last_good_step"] == 3
    assert "3 steps in a row" in events(run_dir, "nan_stop")[0]["message"]
    assert "Stopped at step 6" in capsys.readouterr().out
    ckpt = Path(summary["checkpoint"])
    assert ckpt.name == "step-00000003" and (run_dir / "checkpoints/latest").read_text().strip() == ckpt.name
    saved = torch.load(ckpt / "engine" / "model.pt", weights_only=True)
    assert torch.equal(torch.cat([v.flatten() for v in saved.values()]), task.weights_at[4])
    assert json.loads((ckpt / "trainer_state.json").read_text())["health"]["consecutive_nan"] == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_stop_policy_saves_last_good_state_and_resumes_from_it(tmp_path, engine, monkeypatch):
    run_dir = tmp_path / "run"
    spec = {"run_dir": run_dir, "steps": 8, "engine": engine, "nan_policy": "stop", "nan_at": [[0, 5, 0]]}
    summary, task = run_job(spec)
    assert summary["stopped_by"] == "health" and summary["steps"] == 4
    assert Path(summary["checkpoint"]).name == "step-00000004"
    assert json.loads((Path(summary["checkpoint"]) / "trainer_state.json").read_text())["step"] == 4
    (nan_stop,) = events(run_dir, "nan_stop")
    assert nan_stop["step"] == 5 and "at step 5" in nan_stop["message"] and "nan_policy=stop" in nan_stop["message"]
    assert "Stopped at step 5" in events(run_dir, "stop")[-1]["message"]
    assert not events(run_dir, "nan_skip")

    _world_of_one(monkeypatch)
    resumed, task2 = run_job({**spec, "nan_at": [], "resume": "auto"})
    assert resumed["resumed_from"].endswith("step-00000004") and resumed["steps"] == 8 and resumed["stopped_by"] is None
    assert torch.equal(task2.weights_at[1], task.weights_at[5])  # the resumed run starts from the last good weights


def test_throttled_loader_warns_of_data_starvation(tmp_path, capsys):
    run_dir = tmp_path / "run"
    summary, _ = run_job({"run_dir": run_dir, "steps": 24, "data_delay_s": 0.03, "log_every": 5})
    assert summary["steps"] == 24
    (warning,) = events(run_dir, "data_starvation")
    assert warning["share"] > 0.5 and "num_workers" in warning["message"]
    assert "data_starvation" in capsys.readouterr().out
    assert _train_lines(run_dir)[20]["data_wait_share"] > 0.5


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_two_ranks_name_the_straggler_and_agree_on_a_one_rank_nan(tmp_path, engine):
    """A real 2-process job (gloo; DDP, or DeepSpeed ZeRO-2): rank 1 sleeps in every forward; rank 1
    alone sees a corrupt sample at step 7, and both ranks must skip that update together (a rank
    that went on alone would hang in DDP's gradient all-reduce). The sleep (0.3 s a step) is longer than
    a step of this tiny model, so a busy machine's scheduling noise cannot make rank 0 the slower one."""
    run_dir = tmp_path / "run"
    spec = {"run_dir": str(run_dir), "steps": 15, "engine": engine, "grad_accum": 2,
            "slow_rank": 1, "slow_forward_s": 0.15, "skew_every": 5, "nan_at": [[1, 7, 1]]}
    from pipelines.engine.launcher import free_port, fresh_world_env

    env = fresh_world_env()
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(Path(__file__).with_name("trainer_job.py")), json.dumps(spec)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads([x for x in proc.stdout.splitlines() if x.startswith("SUMMARY ")][-1][8:])
    assert summary["world_size"] == 2 and summary["steps"] == 15 and summary["stopped_by"] is None
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ranks = [r for r in lines if r.get("split") == "ranks"]
    assert [r["step"] for r in ranks] == [5, 10, 15]
    assert all(r["slowest_rank"] == 1 and r["step_time_skew"] > 1.2 for r in ranks), ranks
    assert [e["step"] for e in events(run_dir, "nan_skip")] == [7]
    train = _train_lines(run_dir)
    assert all(math.isfinite(train[s]["loss"]) for s in train if s != 7)


def test_ddp_fp16_uses_dynamic_loss_scaling_and_logs_the_scale(tmp_path):
    """engine=ddp, precision=fp16: autocast + GradScaler starting at 2^16. A step whose scaled fp16
    gradients overflow (here: the first steps, whose loss x 2^16 exceeds fp16's range, and step 3's
    NaN gradients) is not applied and halves the scale -- routine under fp16, not a health alarm."""
    run_dir = tmp_path / "run"
    steps = 6
    summary, task = run_job({"run_dir": run_dir, "steps": steps, "engine": "ddp", "precision": "fp16",
                             "nan_grad_at": [[0, 3, 0]]})
    assert summary["steps"] == steps and summary["stopped_by"] is None
    train = _train_lines(run_dir)
    scales = [train[s]["loss_scale"] for s in range(1, steps + 1)]
    assert scales[0] == 2.0**16
    skipped = [torch.equal(task.weights_at[s], task.weights_at[s + 1]) for s in range(1, steps)]
    assert skipped[2] and not all(skipped)  # step 3 (NaN gradients) skipped; others applied
    for s in range(1, steps):  # halved after exactly the skipped steps, unchanged otherwise
        assert scales[s] == scales[s - 1] / (2 if skipped[s - 1] else 1), (s, scales, skipped)
        assert (train[s]["grad_norm"] is None) == skipped[s - 1]
    assert events(run_dir, "nan_skip") == []
    scaler = torch.load(Path(summary["checkpoint"]) / "engine" / "grad_scaler.pt", weights_only=True)
    assert scaler["scale"] <= scales[-1]  # saved for a resume to go on with the scale it had


def test_ddp_fp16_forward_runs_in_half_precision(tmp_path):
    from trainer_job import build_trainer

    from pipelines.engine.distributed import in_process_run

    with in_process_run():
        trainer = build_trainer({"run_dir": tmp_path / "run", "steps": 1, "engine": "ddp", "precision": "fp16"})
        seen = []
        trainer.engine.module.net[0].register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
        trainer.engine(x=torch.randn(4, 8), y=torch.zeros(4))
    assert seen == [torch.float16]
