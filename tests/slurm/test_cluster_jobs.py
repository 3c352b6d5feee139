"""Jobs on a real SLURM (slurm/ci/local_cluster.sh: nodes c1 and c2 on this machine): multi-node
pretraining, pre-emption -> checkpoint -> requeue -> resume, Ray on SLURM, a sweep as a job array."""

from __future__ import annotations

import collections
import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from slurm_helpers import REPO, dump_logs, job_env, pretrain_cli, submitted_id, train_records, wait_job

pytestmark = pytest.mark.slow

CONFIG = str(REPO / "configs/train/bert_tiny_cpu.yaml")


def _train_overrides(corpus: Path, run_dir: Path, steps: int, *extra: str) -> list[str]:
    return [f"data.corpus={corpus}", f"train.run_dir={run_dir}", f"train.max_steps={steps}", "data.micro_batch_size=4",
            "data.num_workers=1", "data.shuffle_buffer=16", "train.log_every=1", "train.eval_every=0",
            "train.eval_batches=2", "train.checkpoint_every=0", "logging.tensorboard=false", *extra]


def _trace_steps(trace: Path, rank: int) -> list[int]:
    return [json.loads(line)["step"] for line in (trace / f"rank-{rank}.jsonl").read_text().splitlines()]


def test_two_node_pretraining(slurm_cluster, bert_corpus, tmp_path):
    run_dir, trace = tmp_path / "run", tmp_path / "trace"
    proc = pretrain_cli("submit", CONFIG, *_train_overrides(bert_corpus, run_dir, 8, f"logging.sample_keys={trace}"),
                        "--nodes", "2", "--gpus-per-node", "0", "--time", "10:00", "--signal-seconds", "60",
                        env=job_env(), cwd=tmp_path)
    job = submitted_id(proc)
    assert str(run_dir) in proc.stdout and f"slurm-{job}.out" in proc.stdout
    info = wait_job(job, 240, logs=run_dir / "logs")
    logs = dump_logs(run_dir / "logs")
    assert info["JobState"] == "COMPLETED", logs
    assert info["NumNodes"] == "2" and info["NodeList"] == "c[1-2]"
    # one task per node; both agree on the rendezvous; node 0 hosts rank 0, node 1 rank 1
    hello = {}
    for node in (0, 1):
        text = (run_dir / "logs" / f"job-{job}-r0-node{node}.log").read_text()
        line = next(ln for ln in text.splitlines() if ln.startswith(f"[node {node} of 2"))
        hello[node] = line.split("rendezvous ", 1)[1]
        assert ("SUMMARY " in text) == (node == 0), logs
    assert hello[0] == hello[1] and hello[0].endswith("world size 2"), hello
    for rank in (0, 1):
        assert _trace_steps(trace, rank) == list(range(1, 9))
    summary = json.loads(next(ln for ln in (run_dir / "logs" / f"job-{job}-r0-node0.log").read_text().splitlines()
                              if ln.startswith("SUMMARY "))[8:])
    assert summary["world_size"] == 2 and summary["steps"] == 8
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000008"
    assert (run_dir / "logs" / f"submit-{job}.sbatch").is_file()


def test_preemption_checkpoints_requeues_and_resumes(slurm_cluster, bert_corpus, tmp_path):
    steps = 100
    run_dir, trace = tmp_path / "run", tmp_path / "trace"
    proc = pretrain_cli("submit", CONFIG, *_train_overrides(bert_corpus, run_dir, steps, f"logging.sample_keys={trace}"),
                        "--nodes", "2", env=job_env(), cwd=tmp_path)
    job = submitted_id(proc)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 180
    while not (metrics.is_file() and len(train_records(run_dir)) >= 3):
        assert time.time() < deadline, f"no training progress:\n{dump_logs(run_dir / 'logs')}"
        assert wait_job(job, 5, until=lambda i: True)["JobState"] in ("PENDING", "RUNNING", "CONFIGURING")
        time.sleep(0.5)
    # what SLURM does at --signal=B:USR1@T before the time limit, now
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    info = wait_job(job, 300, logs=run_dir / "logs")
    logs = dump_logs(run_dir / "logs")
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", logs
    batch_log = (run_dir / "logs" / f"slurm-{job}.out").read_text()
    assert "USR1 received" in batch_log and f"requeueing job {job}" in batch_log
    assert "restart 1:" in batch_log
    # the signal checkpointed mid-run, the requeued job resumed there
    events = [json.loads(ln) for ln in metrics.read_text().splitlines() if '"event"' in ln]
    stop = next(e for e in events if e["event"] == "stop")
    resume = next(e for e in events if e["event"] == "resume")
    assert stop["reason"] == "signal" and "(SIGUSR1)" in stop["message"] and 0 < stop["step"] == resume["step"] < steps, events
    assert (run_dir / "logs" / f"job-{job}-r1-node0.log").is_file()
    # the budget exactly, no step twice: in metrics.jsonl and in each rank's append-only trace
    train_steps = [r["step"] for r in train_records(run_dir)]
    assert train_steps == list(range(1, steps + 1))
    for rank in (0, 1):
        counts = collections.Counter(_trace_steps(trace, rank))
        assert sorted(counts) == list(range(1, steps + 1)) and set(counts.values()) == {1}, f"rank {rank} redid steps"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{steps:08d}"


def test_resume_on_fewer_nodes_continues_the_sample_sequence(slurm_cluster, bert_corpus, tmp_path):
    """A run checkpointed by a 2-node job (ZeRO-2, one rank per node) goes on as a 1-node job in the same
    run dir, the global batch kept at 8 by accumulation: no step twice, no sample twice, ZeRO state
    rebuilt from the checkpoint's world-size-free copy."""
    run_dir, trace = tmp_path / "run", tmp_path / "trace"
    env, keys_log = job_env(), f"logging.sample_keys={trace}"
    first = submitted_id(pretrain_cli("submit", CONFIG, *_train_overrides(bert_corpus, run_dir, 4, keys_log), "--nodes", "2",
                                      "--gpus-per-node", "0", "--time", "10:00", env=env, cwd=tmp_path))
    assert wait_job(first, 240, logs=run_dir / "logs")["JobState"] == "COMPLETED", dump_logs(run_dir / "logs")
    second = submitted_id(pretrain_cli("submit", CONFIG, *_train_overrides(bert_corpus, run_dir, 8, "train.grad_accum_steps=2", keys_log),
                                       "--nodes", "1", "--gpus-per-node", "0", "--time", "10:00", env=env, cwd=tmp_path))
    info = wait_job(second, 240, logs=run_dir / "logs")
    logs = dump_logs(run_dir / "logs")
    assert info["JobState"] == "COMPLETED" and info["NumNodes"] == "1", logs
    text = (run_dir / "logs" / f"job-{second}-r0-node0.log").read_text()
    summary = json.loads(next(ln for ln in text.splitlines() if ln.startswith("SUMMARY "))[8:])
    assert summary["world_size"] == 1 and summary["steps"] == 8 and summary["resumed_from"].endswith("step-00000004"), logs
    assert [r["step"] for r in train_records(run_dir)] == list(range(1, 9))
    keys = [k for rank in (0, 1) for line in (trace / f"rank-{rank}.jsonl").read_text().splitlines()
            for k in json.loads(line)["keys"]]
    assert len(keys) == 8 * 8 and len(set(keys)) == len(keys)  # 64 of the corpus's 128 training samples, each once


def _pydoc_text(root: Path, per_file: int = 20) -> Path:
    """Python's own pydoc topics as text files of blank-line-separated documents (always installed)."""
    from pydoc_data.topics import topics

    root.mkdir(parents=True)
    items = sorted(topics.items())
    for i in range(0, len(items), per_file):
        (root / f"topics-{i:03d}.txt").write_text("\n\n".join(v for _, v in items[i:i + per_file]), encoding="utf-8")
    return root


def test_prepare_ray_on_two_nodes_matches_local(slurm_cluster, tmp_path):
    text = _pydoc_text(tmp_path / "text")
    cfg = tmp_path / "prep.yaml"
    cfg.write_text(f"extends: {REPO}/configs/data/demo_bert.yaml\nsources: [{{type: text, paths: ['{text}/*.txt']}}]\n"
                   "seq_len: 64\nshard_target_mb: 0.1\nprogress: false\ntokenizer: {vocab_size: 2000}\n")
    proc = subprocess.run(["sbatch", "--parsable", f"--chdir={tmp_path}", "--cpus-per-task=2",
                           str(REPO / "slurm/prepare_ray.sbatch"), str(cfg), f"output={tmp_path / 'ray_corpus'}"],
                          env=job_env(), capture_output=True, text=True, check=True)
    job = proc.stdout.strip().split(";")[0]
    local = pretrain_cli("prepare", str(cfg), f"output={tmp_path / 'local_corpus'}", "num_workers=1", cwd=tmp_path)
    assert local.returncode == 0, local.stderr[-3000:]
    info = wait_job(job, 300, logs=tmp_path)
    batch_log = (tmp_path / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", batch_log[-4000:] + dump_logs(tmp_path)
    assert "Ray cluster ready: 2 nodes" in batch_log and "stopping Ray on 2 node(s)" in batch_log
    assert sorted(p.name for p in tmp_path.glob(f"ray-{job}-*.log")) == [f"ray-{job}-c1.log", f"ray-{job}-c2.log"]
    ray_m = json.loads((tmp_path / "ray_corpus" / "manifest.json").read_text())
    local_m = json.loads((tmp_path / "local_corpus" / "manifest.json").read_text())
    assert ray_m["splits"] == local_m["splits"] and len(ray_m["splits"]["train"]["shards"]) > 1
    assert subprocess.run(["pgrep", "-f", f"ray-{job}-"], capture_output=True).returncode == 1, "Ray processes left behind"
    assert not list(Path("/tmp").glob(f"ray-{job}-*")), "Ray temp dirs left behind"


def _array_states(job: str) -> list[str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    return [dict(kv.split("=", 1) for kv in ln.split() if "=" in kv).get("JobState", "?") for ln in out.splitlines()]


def test_sweep_as_job_array_and_report(slurm_cluster, bert_corpus, tmp_path):
    sweep_dir = tmp_path / "sweep"
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"""
name: slurm_ci
base: {REPO}/configs/train/bert_tiny_cpu.yaml
corpus: {bert_corpus}
out_dir: {sweep_dir}
slurm_script: {REPO}/slurm/sweep_array.sbatch
run:
  data: {{micro_batch_size: 4, num_workers: 0, shuffle_buffer: 16}}
  train: {{max_steps: 8, eval_every: 4, eval_batches: 2, checkpoint_every: 0, log_every: 1, resume: auto}}
  distributed: {{engine: ddp}}
  logging: {{progress: false, tensorboard: false}}
optimizers: {{adam: [optim.name=adam], radam: [optim.name=radam]}}
warmups: {{none: [schedule.warmup=none], linear: [schedule.warmup=linear, schedule.warmup_steps=4]}}
lrs: [1.0e-3]
seeds: [0]
""")
    env = job_env(PRETRAIN_REPO=str(REPO))
    proc = pretrain_cli("sweep", str(sweep), "--slurm", env=env, cwd=tmp_path)
    m = re.search(r"Submitted batch job (\d+)", proc.stdout)
    assert proc.returncode == 0 and m, proc.stdout + proc.stderr
    job = m.group(1)
    assert re.search(r"--array=(0-3|0,1,2,3) ", proc.stdout), proc.stdout
    deadline = time.time() + 300
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
        assert time.time() < deadline, f"array {job} still running: {_array_states(job)}"
        time.sleep(2)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted(tmp_path.glob(f"slurm-{job}_*.out")))
    assert _array_states(job) == ["COMPLETED"] * 4, logs
    assert len(list(tmp_path.glob(f"slurm-{job}_*.out"))) == 4
    runs = sorted(p.name for p in (sweep_dir / "runs").iterdir())
    assert runs == ["adam-linear-lr1e-3-s0", "adam-none-lr1e-3-s0", "radam-linear-lr1e-3-s0", "radam-none-lr1e-3-s0"]
    for name in runs:
        assert json.loads((sweep_dir / "runs" / name / "done").read_text())["status"] == "ok", logs
    report = pretrain_cli("report", str(sweep_dir), env=env, cwd=tmp_path)
    assert report.returncode == 0, report.stderr[-3000:]
    page = Path(report.stdout.strip().rsplit(" ", 1)[-1])
    assert page.is_file() and page.stat().st_size > 0, report.stdout
