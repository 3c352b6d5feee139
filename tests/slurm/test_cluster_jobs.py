"""Jobs on a real SLURM (slurm/ci/local_cluster.sh: nodes c1 and c2 on this machine): multi-node
pretraining, pre-emption -> checkpoint -> requeue -> resume, Ray on SLURM, a sweep as a job array."""

from __future__ import annotations

import collections
import json
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
    proc = pretrain_cli("submit", CONFIG, *_train_overrides(bert_corpus, run_dir, 8), "--nodes", "2",
                        "--gpus-per-node", "0", "--time", "10:00", "--signal-seconds", "60",
                        env=job_env(PRETRAIN_TRACE_DIR=str(trace)), cwd=tmp_path)
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
    steps = 150
    run_dir, trace = tmp_path / "run", tmp_path / "trace"
    proc = pretrain_cli("submit", CONFIG, *_train_overrides(bert_corpus, run_dir, steps), "--nodes", "2",
                        env=job_env(PRETRAIN_TRACE_DIR=str(trace)), cwd=tmp_path)
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
    assert "signal" in stop["message"] and 0 < stop["step"] == resume["step"] < steps, events
    assert (run_dir / "logs" / f"job-{job}-r1-node0.log").is_file()
    # the budget exactly, no step twice: in metrics.jsonl and in each rank's append-only trace
    train_steps = [r["step"] for r in train_records(run_dir)]
    assert train_steps == list(range(1, steps + 1))
    for rank in (0, 1):
        counts = collections.Counter(_trace_steps(trace, rank))
        assert sorted(counts) == list(range(1, steps + 1)) and set(counts.values()) == {1}, f"rank {rank} redid steps"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{steps:08d}"
