"""Ctrl-C on a training command, as a terminal sends it: SIGINT to every process of the foreground job.

Each test starts the real command in a process group of its own (the job a shell would make of it)
and signals that group with ``os.killpg``, as the terminal does. Wanted: Ctrl-C stops like SIGTERM --
every rank checkpoints at its next step boundary, the user sees one stop line naming the checkpoint
(no traceback per rank), the command exits with 130 (128 + SIGINT), and the same command again resumes
from that checkpoint. A second Ctrl-C aborts at once, without a checkpoint and without a half-written one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from job_helpers import communicate_or_dump, job_env, job_processes

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs/train/bert_tiny_cpu.yaml")  # data.num_workers=2: loader workers get the Ctrl-C too
ACK = "Ctrl-C: stopping after this step with a checkpoint"


def _args(corpus: Path, run_dir: Path, max_steps: int = 100_000) -> list[str]:
    return [CONFIG, f"data.corpus={corpus}", f"train.max_steps={max_steps}", "train.eval_every=0", "train.log_every=1",
            "train.grad_accum_steps=8",  # a step needs more batches than the loader has queued when Ctrl-C comes
            "logging.tensorboard=false", f"train.run_dir={run_dir}"]


def _command(entry: str, corpus: Path, run_dir: Path) -> list[str]:
    if entry == "rank":  # one rank run directly, as `python -m pipelines.pretrain` without a launcher
        return [sys.executable, "-m", "pipelines.pretrain", *_args(corpus, run_dir)]
    if entry == "deepspeed":  # two ranks under DeepSpeed's launcher (its runner, then launch.py, then the ranks)
        return [sys.executable, "-m", "pipelines.cli", "train", *_args(corpus, run_dir), "--nproc", "2", "--launcher", "deepspeed"]
    return [sys.executable, "-m", "pipelines.cli", "train", *_args(corpus, run_dir), "--nproc", entry]


def _start_and_interrupt(cmd: list[str], run_dir: Path, presses: int = 1) -> tuple[subprocess.Popen, str, str]:
    """Start ``cmd`` as a job of its own, wait for its first logged step, press Ctrl-C ``presses`` times."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and '"split": "train"' in metrics.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.3)
    for press in range(presses):
        time.sleep(0.05 * press)
        os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=240)
    time.sleep(1)
    return proc, out, err


def _assert_stopped_with_a_checkpoint(proc: subprocess.Popen, out: str, err: str, run_dir: Path) -> Path:
    from pipelines.engine.checkpoint import find_resume, verify_checkpoint

    assert proc.returncode == 128 + signal.SIGINT, (proc.returncode, out[-2000:], err[-4000:])
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in err, err[-4000:]
    assert err.count(ACK) == 1, err[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    stops = [r for r in records if r.get("event") == "stop"]
    assert len(stops) == 1 and stops[0]["reason"] == "signal" and stops[0]["signal"] == "SIGINT", stops
    step = stops[0]["step"]
    checkpoint = run_dir / "checkpoints" / f"step-{step:08d}"
    shown = [line for line in out.splitlines() if "stop:" in line]
    assert shown == [f"[step {step}] stop: Stopping early (SIGINT); checkpoint {checkpoint}. Run the same command "
                     f"again to continue from it."], out[-3000:]
    verify_checkpoint(checkpoint)
    assert find_resume(run_dir, "auto") == checkpoint
    assert job_processes(str(run_dir)) == [], "processes of the job outlived the command"
    return checkpoint


def _assert_resumes(corpus: Path, run_dir: Path, checkpoint: Path) -> None:
    """The same command (one step further) continues from the checkpoint Ctrl-C left."""
    step = int(checkpoint.name.split("-")[1])
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "train", *_args(corpus, run_dir, step + 1)], cwd=REPO,
                          env=job_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"Resuming from {checkpoint} (step {step})." in proc.stdout
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"split": "train"' in line]
    assert steps == list(range(1, step + 2)), steps
    assert (run_dir / "checkpoints" / f"step-{step + 1:08d}" / "trainer_state.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["2", "1", "rank", "deepspeed"])
def test_ctrl_c_checkpoints_at_the_step_boundary_and_exits_130(entry, bert_corpus, tmp_path):
    """`pretrain train --nproc 2` (the ranks under `accelerate launch`), `--nproc 1` and a rank run directly:
    every rank used to print a KeyboardInterrupt traceback, the command exited 1, and nothing was saved.
    `--launcher deepspeed`: its runner printed a KeyboardInterrupt traceback, and its launch.py SIGTERMed the
    ranks (the stop line named SIGTERM) and SIGKILLs them 30 s later, a checkpoint being written or not."""
    run_dir = tmp_path / "run"
    proc, out, err = _start_and_interrupt(_command(entry, bert_corpus, run_dir), run_dir)
    checkpoint = _assert_stopped_with_a_checkpoint(proc, out, err, run_dir)
    if entry != "deepspeed":  # resuming is the launcher's no part: the other entries check it (and save ~20 s here)
        _assert_resumes(bert_corpus, run_dir, checkpoint)


@pytest.mark.slow
def test_a_second_ctrl_c_aborts_at_once_and_leaves_no_partial_checkpoint(bert_corpus, tmp_path):
    """Ctrl-C twice on `pretrain train --nproc 2`: the launcher, its ranks and their workers are killed, the
    command says so in one line and exits 130; any checkpoint under a final name is complete."""
    from pipelines.engine.checkpoint import find_resume, list_checkpoints, verify_checkpoint

    run_dir = tmp_path / "run"
    proc, out, err = _start_and_interrupt(_command("2", bert_corpus, run_dir), run_dir, presses=2)
    assert proc.returncode == 128 + signal.SIGINT, (proc.returncode, out[-2000:], err[-4000:])
    assert "Traceback" not in out + err and err.count("aborted (Ctrl-C twice)") == 1, err[-4000:]
    assert job_processes(str(run_dir)) == [], "ranks outlived the command"
    for checkpoint in list_checkpoints(run_dir):
        verify_checkpoint(checkpoint)
    assert find_resume(run_dir, "auto") == (list_checkpoints(run_dir) or [None])[-1]


@pytest.mark.slow
def test_ctrl_c_stops_a_sweep_with_its_run_checkpointed_and_the_same_command_resumes(bert_corpus, tmp_path):
    """`pretrain sweep --local` with runs it launches (`launcher: python`; `--nproc 2`'s Ctrl-C is tested above, and
    a sweep's launch is the same): Ctrl-C checkpoints the running run, starts no further one, says how to go on and
    exits 130 -- it exited 1, the run recorded as failed. The same command again resumes that run from its
    checkpoint and finishes the sweep (it used to stop again after the resumed run, on its old stop event)."""
    from test_sweep import TINY_RUN, write_sweep

    run = {**TINY_RUN, "train": {**TINY_RUN["train"], "max_steps": 24, "grad_accum_steps": 8}}
    path = write_sweep(tmp_path / "sweep.yaml", out_dir=str(tmp_path / "sw"), corpus=str(bert_corpus), run=run,
                       lrs=[1e-3, 2e-3], seeds=[0], launcher="python")
    cmd = [sys.executable, "-m", "pipelines.cli", "sweep", str(path), "--local"]
    runs = tmp_path / "sw" / "runs"
    proc, out, err = _start_and_interrupt(cmd, runs / "adam-none-lr1e-3-s0")
    checkpoint = _assert_stopped_with_a_checkpoint(proc, out, err, runs / "adam-none-lr1e-3-s0")
    assert out.count("sweep stopped by a signal after run 0; run the same command again to resume it.") == 1, out[-3000:]
    assert not (runs / "adam-none-lr2e-3-s0").exists(), "a run started after Ctrl-C"
    [record] = [json.loads(line) for line in (tmp_path / "sw" / "sweep.jsonl").read_text().splitlines()]
    assert (record["status"], record["stopped_by"], record["error"]) == ("interrupted", "signal", None), record

    again = subprocess.run(cmd, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, (again.stdout[-3000:], again.stderr[-3000:])
    step = int(checkpoint.name.split("-")[1])
    assert f"Resuming from {checkpoint} (step {step})." in again.stdout, again.stdout[-3000:]
    for name in ("adam-none-lr1e-3-s0", "adam-none-lr2e-3-s0"):
        assert json.loads((runs / name / "done").read_text())["status"] == "ok", name
    steps = [json.loads(line)["step"] for line in (runs / "adam-none-lr1e-3-s0" / "metrics.jsonl").read_text().splitlines()
             if '"split": "train"' in line]
    assert steps == list(range(1, 25)), steps


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl_c", "kill", "ctrl_c_ignored_by_the_sweep"])
def test_a_stopped_sweep_of_parallel_runs_checkpoints_the_running_ones_and_starts_no_more(how, bert_corpus, tmp_path):
    """`jobs: 2`: the two running runs checkpoint (recorded as interrupted, not failed), the third never starts,
    and the sweep says how to go on and exits 128 + the signal. `ctrl_c`: the terminal's SIGINT reaches the
    sweep and its runs (one process group); it exited 1. `kill`: `kill PID` sends SIGTERM to the sweep process
    only, which passes it on to its runs; the sweep died at once and left its runs training, unsupervised.
    `ctrl_c_ignored_by_the_sweep`: a sweep started in the background of a script (`pretrain sweep ... &`, which a
    shell starts with SIGINT ignored) never sees the group's SIGINT, but its runs set their own handler and stop
    on it: the sweep used to start the third run as a slot freed, which then trained on, unstopped."""
    from test_sweep import TINY_RUN, write_sweep

    run = {**TINY_RUN, "train": {**TINY_RUN["train"], "max_steps": 100_000, "grad_accum_steps": 8}}
    path = write_sweep(tmp_path / "sweep.yaml", out_dir=str(tmp_path / "sw"), corpus=str(bert_corpus), run=run,
                       lrs=[1e-3, 2e-3, 3e-3], seeds=[0], jobs=2)
    runs = tmp_path / "sw" / "runs"
    sigint = signal.SIG_IGN if how == "ctrl_c_ignored_by_the_sweep" else signal.SIG_DFL  # not what pytest got
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "sweep", str(path), "--local"], cwd=REPO,
                            env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))
    deadline = time.monotonic() + 300
    while not all((runs / name / "metrics.jsonl").exists() and '"split": "train"' in (runs / name / "metrics.jsonl").read_text()
                  for name in ("adam-none-lr1e-3-s0", "adam-none-lr2e-3-s0")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.3)
    signum = signal.SIGTERM if how == "kill" else signal.SIGINT
    if signum == signal.SIGINT:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    out, err = communicate_or_dump(proc, 240)  # once at load ~7 it did not exit in 240 s: the stacks say where
    assert proc.returncode == 128 + signum, (proc.returncode, out[-2000:], err[-4000:], job_processes(str(runs)))
    assert "Traceback" not in out + err, err[-4000:]
    assert out.count("sweep stopped by a signal; run the same command again to resume it.") == 1, out[-3000:]
    assert not (runs / "adam-none-lr3e-3-s0").exists(), "a run started after Ctrl-C"
    records = [json.loads(line) for line in (tmp_path / "sw" / "sweep.jsonl").read_text().splitlines()]
    assert sorted((r["name"], r["status"], r["stopped_by"]) for r in records) == [
        ("adam-none-lr1e-3-s0", "interrupted", "signal"), ("adam-none-lr2e-3-s0", "interrupted", "signal")], records
    assert job_processes(str(runs)) == [], "processes of the sweep outlived it"
