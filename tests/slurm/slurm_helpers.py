"""Helpers for the SLURM tests: run the CLI, follow a job through `scontrol show job`, read logs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}



def job_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


def pretrain_cli(*args: str, env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``pretrain ARGS`` in a child process (the installed entry point's code)."""
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *args], cwd=cwd, env=env or job_env(),
                          capture_output=True, text=True, timeout=120)


def submitted_id(proc: subprocess.CompletedProcess) -> str:
    m = re.search(r"Submitted job (\d+)", proc.stdout)
    assert proc.returncode == 0 and m, f"submit failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return m.group(1)


def job_info(job_id: str) -> dict[str, str]:
    """``scontrol show job -o`` as a dict (array jobs: the first record)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    line = out.splitlines()[0] if out.strip() else ""
    return dict(kv.split("=", 1) for kv in line.split() if "=" in kv)


def wait_job(job_id: str, timeout: float, *, logs: Path | None = None, until=None) -> dict[str, str]:
    """Poll until the job is in a terminal state (or ``until(info)`` is true); returns its record."""
    deadline = time.time() + timeout
    info: dict[str, str] = {}
    while time.time() < deadline:
        info = job_info(job_id)
        if until is not None and until(info):
            return info
        if info.get("JobState") in TERMINAL and until is None:
            return info
        time.sleep(1)
    # a hung job: its trainers and data workers print their Python stacks into the node logs first
    subprocess.run(["scancel", "--signal=USR2", job_id], capture_output=True)
    time.sleep(3)
    subprocess.run(["scancel", job_id], capture_output=True)
    pytest.fail(f"job {job_id} did not finish in {timeout:.0f} s: {info.get('JobState')}\n{dump_logs(logs)}")


def dump_logs(log_dir: Path | None, tail: int = 6000) -> str:
    if log_dir is None or not log_dir.is_dir():
        return "(no logs)"
    return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-tail:]}" for p in sorted(log_dir.glob("*.log"))
                     + sorted(log_dir.glob("*.out")))


def train_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("split") == "train" and "loss" in r]
