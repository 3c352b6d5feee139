"""What a run directory holds up to when a user reruns into it: one job at a time, a resume with another
model refused (its config kept), a new learning rate on resume applied, the logged rate the applied one,
a finished run left as it is, and ``train.overwrite`` deleting only what runs wrote."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import corpus_fixtures as cf
import pytest
import yaml
from job_helpers import job_env

from pipelines.engine.launcher import free_port

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs/train/bert_tiny_cpu.yaml")
QUIET = ["train.eval_every=0", "data.num_workers=0", "train.log_every=1", "logging.tensorboard=false"]


def _train(*overrides: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipelines.cli", "train", CONFIG, *QUIET, *overrides]
    return subprocess.run(cmd, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=timeout)


def _train_lines(run_dir: Path) -> dict[int, dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if r.get("split") == "train"}


@pytest.mark.slow
def test_a_second_job_in_a_run_dir_in_use_is_refused_and_the_lock_dies_with_the_first(bert_corpus, tmp_path):
    run_dir = tmp_path / "run"
    args = [f"data.corpus={bert_corpus}", f"train.run_dir={run_dir}", "distributed.engine=ddp"]
    first = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "train", CONFIG, *QUIET, *args, "train.max_steps=100000"],
                             cwd=REPO, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not ((run_dir / "metrics.jsonl").exists() and '"split": "train"' in (run_dir / "metrics.jsonl").read_text()):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.5)
        before = (run_dir / "config.yaml").read_bytes()
        second = _train(*args, "train.max_steps=3", "optim.lr=0.5")
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"{run_dir} is in use: pid {first.pid} on " in second.stderr and "Traceback" not in second.stderr
        assert (run_dir / "config.yaml").read_bytes() == before  # the running job's config, untouched
    finally:
        first.send_signal(signal.SIGTERM)  # it checkpoints and ends
        first.communicate(timeout=120)
    assert first.returncode == 128 + signal.SIGTERM  # stopped as asked, as `kill PID` of `--nproc N` ends
    after = _train(*args, f"train.max_steps={max(_train_lines(run_dir)) + 1}")
    assert after.returncode == 0 and "Resuming from" in after.stdout, after.stderr[-3000:]


@pytest.mark.slow
def test_resuming_with_another_model_is_one_message_and_keeps_the_config(bert_corpus, tmp_path):
    run_dir = tmp_path / "run"
    args = [f"data.corpus={bert_corpus}", f"train.run_dir={run_dir}", "distributed.engine=ddp"]
    assert _train(*args, "train.max_steps=2").returncode == 0
    saved = (run_dir / "config.yaml").read_bytes()
    other = _train(*args, "train.max_steps=4", "model.overrides={num_layers: 3}")
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr[-3000:]
    assert "was written by another model than this run builds" in other.stderr
    assert "bert.blocks.2." in other.stderr and "absent in the checkpoint" in other.stderr
    assert (run_dir / "config.yaml").read_bytes() == saved  # still the config that wrote the checkpoints
    assert _train(*args, "train.max_steps=3").returncode == 0  # the same model resumes as before


@pytest.mark.slow
def test_a_start_refused_for_its_resume_checkpoint_leaves_no_run_dir(bert_corpus, tmp_path):
    """train.resume naming another model's checkpoint (or none) was refused, but left the new run dir behind,
    marked and locked, with an empty metrics.jsonl: the refused command now takes back what it created."""
    gpt_corpus = cf.make_gpt_corpus(tmp_path / "gpt")
    gpt = subprocess.run([sys.executable, "-m", "pipelines.cli", "train", str(REPO / "configs/train/gpt_tiny_cpu.yaml"),
                          *QUIET, f"data.corpus={gpt_corpus}", f"train.run_dir={tmp_path / 'gpt-run'}", "train.max_steps=1",
                          "distributed.engine=ddp"], cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=300)
    assert gpt.returncode == 0, gpt.stderr[-3000:]
    other = tmp_path / "gpt-run" / "checkpoints" / "step-00000001"
    for resume, said in ((other, "was written by another model than this run builds"), (tmp_path / "none", "not a complete checkpoint")):
        proc = _train(f"data.corpus={bert_corpus}", f"train.run_dir={tmp_path / 'bert-run'}", f"train.resume={resume}",
                      "distributed.engine=ddp")
        assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert not (tmp_path / "bert-run").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")  # a run dir that exists is never taken back
    proc = _train(f"data.corpus={bert_corpus}", f"train.run_dir={tmp_path / 'mine'}", f"train.resume={other}")
    assert proc.returncode == 2 and (tmp_path / "mine" / "notes.txt").read_text() == "keep"


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "deepspeed"])
def test_the_logged_lr_is_the_applied_one_and_a_new_lr_on_resume_applies(engine, bert_corpus, tmp_path):
    """Step k logs the rate its update used, lr * f(k-1) (LambdaLR: the first update runs at f(0)); a resume
    with another ``optim.lr`` and a longer run uses the new base rate and schedule from its first update."""
    from pipelines.engine.check import run_schedule
    from pipelines.engine.config import load_run_config

    run_dir = tmp_path / "run"
    args = [f"data.corpus={bert_corpus}", f"train.run_dir={run_dir}", f"distributed.engine={engine}",
            "schedule.warmup_steps=4"]
    assert _train(*args, "train.max_steps=3").returncode == 0
    first = load_run_config(CONFIG, [*QUIET, *args, "train.max_steps=3"])
    f = run_schedule(first)
    logged = _train_lines(run_dir)
    for k in (1, 2, 3):
        assert logged[k]["lr"] == pytest.approx(first.optim.lr * f(k - 1), rel=1e-6), (k, logged[k]["lr"])
    resumed = _train(*args, "train.max_steps=8", "optim.lr=0.01")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    second = load_run_config(CONFIG, [*QUIET, *args, "train.max_steps=8", "optim.lr=0.01"])
    g = run_schedule(second)
    logged = _train_lines(run_dir)
    for k in range(4, 9):
        assert logged[k]["lr"] == pytest.approx(0.01 * g(k - 1), rel=1e-6), (k, logged[k]["lr"])
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["optim"]["lr"] == 0.01


def _files(run_dir: Path) -> dict[str, tuple[bytes, int]]:
    """Every file of a run dir with its bytes and mtime, but the lock (it names the job holding it)."""
    return {p.relative_to(run_dir).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.mark.slow
def test_rerunning_a_finished_run_writes_nothing_and_says_so(bert_corpus, tmp_path):
    """The same command again, once the run is at train.max_steps: one line, exit 0, and not a byte written
    -- it used to evaluate again, rewrite the final checkpoint and append a second resume and eval line to
    metrics.jsonl. With --nproc 2 the launching process finds it before any rank starts; a higher max_steps trains on."""
    run_dir = tmp_path / "run"
    args = [f"data.corpus={bert_corpus}", f"train.run_dir={run_dir}", "train.eval_batches=2", "train.max_steps=2"]
    assert _train(*args).returncode == 0
    before = _files(run_dir)
    assert "checkpoints/step-00000002/trainer_state.json" in before
    said = (f"run {run_dir} is already at max_steps=2 (checkpoint {run_dir}/checkpoints/step-00000002): nothing to do. "
            f"Raise train.max_steps to train further.")
    for nproc in ("1", "2"):
        holder = (run_dir / ".lock").read_bytes()  # names the pid of the last process that opened the run dir
        again = _train(*args, "--nproc", nproc)
        assert again.returncode == 0, again.stderr[-3000:]
        assert again.stdout.count(said) == 1 and "Resuming from" not in again.stdout, again.stdout[-3000:]
        assert "Traceback" not in again.stderr, again.stderr[-3000:]
        assert _files(run_dir) == before, f"--nproc {nproc} wrote into the run dir"
        assert nproc == "1" or (run_dir / ".lock").read_bytes() == holder, "a rank was started to find the run finished"
    # ranks started without that check (torchrun itself, as a cluster script does) agree on it: each returns
    port = str(free_port())
    ranks = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
                            "-m", "pipelines.pretrain", CONFIG, *QUIET, *args], cwd=REPO, env=job_env(),
                           capture_output=True, text=True, timeout=300)
    assert ranks.returncode == 0 and ranks.stdout.count(said) == 1, ranks.stdout[-3000:] + ranks.stderr[-3000:]
    assert _files(run_dir) == before
    further = _train(*[a for a in args if a != "train.max_steps=2"], "train.max_steps=3")
    assert further.returncode == 0 and "Resuming from" in further.stdout, further.stderr[-3000:]
    assert sorted(_train_lines(run_dir)) == [1, 2, 3]
    assert (run_dir / "checkpoints" / "step-00000003" / "trainer_state.json").is_file()



@pytest.mark.slow
@pytest.mark.parametrize("budget", ["max_tokens", "max_time_minutes"])
def test_rerunning_a_run_that_reached_its_token_or_time_budget_writes_nothing(budget, bert_corpus, tmp_path):
    """A run stopped by train.max_tokens, or by train.max_time_minutes (the run's training time over all its
    invocations), is finished as one at max_steps is: the same command again, on 1 or 2 processes, says so in
    one line and writes nothing -- it used to train one step past the token budget, or another
    max_time_minutes. Raising the budget trains on from the checkpoint."""
    run_dir = tmp_path / "run"
    first = {"max_tokens": "300", "max_time_minutes": "0.01"}[budget]  # ~200 tokens a step; 0.6 s
    args = [f"data.corpus={bert_corpus}", f"train.run_dir={run_dir}", "train.eval_batches=2"]
    done = _train(*args, f"train.{budget}={first}")
    assert done.returncode == 0 and f"Budget reached ({budget.removesuffix('_minutes')})" in done.stdout, done.stdout[-3000:]
    before = _files(run_dir)
    checkpoint = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    step, tokens, minutes = state["step"], state["tokens"], state.get("train_seconds", 0.0) / 60
    assert step < 200 and tokens >= 300 if budget == "max_tokens" else step < 200, state
    detail = f"{tokens} tokens" if budget == "max_tokens" else f"{minutes:.2f} minutes of training"
    said = (f"run {run_dir} is already at {budget}={first} ({detail} at step {step}; checkpoint {checkpoint}): "
            f"nothing to do. Raise train.{budget} to train further.")
    for nproc in ("1", "2"):
        holder = (run_dir / ".lock").read_bytes()
        again = _train(*args, f"train.{budget}={first}", "--nproc", nproc)
        assert again.returncode == 0, again.stderr[-3000:]
        assert again.stdout.count(said) == 1 and "Resuming from" not in again.stdout, again.stdout[-3000:]
        assert "Traceback" not in again.stderr, again.stderr[-3000:]
        assert _files(run_dir) == before, f"--nproc {nproc} wrote into the run dir"
        assert nproc == "1" or (run_dir / ".lock").read_bytes() == holder, "a rank was started to find the run finished"
    assert budget == "max_tokens" or minutes >= 0.01, state  # the checkpoint holds the run's training time
    raised = tokens + 1 if budget == "max_tokens" else round(minutes + 0.01, 4)
    further = _train(*args, f"train.{budget}={raised}")
    assert further.returncode == 0 and f"Resuming from {checkpoint} (step {step})." in further.stdout, further.stderr[-3000:]
    trained = sorted(_train_lines(run_dir))
    assert trained[:step] == list(range(1, step + 1)) and len(trained) > step, trained
    if budget == "max_tokens":
        assert trained == list(range(1, step + 2))  # one step more reaches tokens + 1


def test_overwrite_deletes_the_runs_checkpoints_but_not_a_folder_of_yours_beside_them(tmp_path):
    from types import SimpleNamespace

    from pipelines.engine.checkpoint import list_checkpoints, refuse_fresh_start_over_checkpoints

    run_dir = tmp_path / "run"
    ck = run_dir / "checkpoints"
    for step in (10, 20):
        (ck / f"step-{step:08d}").mkdir(parents=True)
        (ck / f"step-{step:08d}" / "trainer_state.json").write_text("{}")
    (ck / "latest").write_text("step-00000020\n")
    (ck / "my_analysis").mkdir()
    (ck / "my_analysis" / "notes.txt").write_text("mine")
    (run_dir / "metrics.jsonl").write_text("{}\n")
    refuse_fresh_start_over_checkpoints(run_dir, SimpleNamespace(resume="never", overwrite=True))
    assert list_checkpoints(run_dir) == [] and not (ck / "latest").exists() and not (run_dir / "metrics.jsonl").exists()
    assert (ck / "my_analysis" / "notes.txt").read_text() == "mine"
