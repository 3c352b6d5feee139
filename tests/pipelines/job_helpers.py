"""Run real jobs from the tests and read what they leave (summary line, traces, metrics).

A module of its own, not conftest.py: several test folders have a conftest, and ``from conftest import``
gets whichever one was imported last.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def job_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def job_processes(marker: str) -> list[int]:
    """Live processes whose command line names ``marker`` (a run dir) and runs a rank (``pipelines.pretrain``):
    the launcher and its ranks."""
    pids = []
    for proc_dir in Path("/proc").iterdir():
        try:
            cmdline = (proc_dir / "cmdline").read_bytes().decode(errors="replace")
            state = (proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, IndexError):
            continue
        if proc_dir.name.isdigit() and marker in cmdline and "pipelines.pretrain" in cmdline and state != "Z":
            pids.append(int(proc_dir.name))
    return pids


def traced(overrides: list[str], trace_dir: Path | None) -> list[str]:
    """``overrides`` plus the per-step sample-key log (``logging.sample_keys``) into ``trace_dir``."""
    return [*overrides, f"logging.sample_keys={trace_dir}"] if trace_dir is not None else list(overrides)


def run_pretrain(config: str, overrides: list[str], *, processes: int = 1, launcher: str = "accelerate",
                 trace_dir: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run a real job (``distributed.launch`` in a child python, or one plain process); capture its output."""
    code = (
        "import sys; from pipelines.engine.launcher import launch; "
        f"sys.exit(launch({config!r}, {traced(overrides, trace_dir)!r}, {processes}, launcher={launcher!r}))"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=job_env(), capture_output=True,
                          text=True, timeout=timeout)


def summary_of(proc: subprocess.CompletedProcess) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert proc.returncode == 0 and lines, f"job failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("SUMMARY "):])


def read_trace(trace_dir: Path, rank: int) -> dict[int, dict]:
    """step -> {loss, keys} of one rank (``logging.sample_keys``); a step redone after a crash keeps its last record."""
    out: dict[int, dict] = {}
    path = trace_dir / f"rank-{rank}.jsonl"
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec
    return out


def train_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r.get("split") == "train" and "loss" in r]


def two_rank_results(job: Path, out: Path, timeout: int = 300) -> list[dict]:
    """Run ``job OUT`` on 2 ranks (torchrun; gloo on the CPU), each of which writes ``OUT.rank-N.json``; their contents."""
    from pipelines.engine.distributed import free_port

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(job), str(out)], cwd=REPO, env=job_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return [json.loads(out.with_suffix(f".rank-{rank}.json").read_text()) for rank in range(2)]


def communicate_or_dump(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """``proc.communicate(timeout)`` of a job started in its own session; on a hang, every process of it prints its
    Python stacks first (SIGUSR2: the trainer's and the sweep's stack dump), then the group is killed and the test
    fails with the output's tail, so a rare hang says where it was."""
    import pytest

    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    for sig, wait in ((signal.SIGUSR2, 3.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        time.sleep(wait)
    out, err = proc.communicate()
    pytest.fail(f"no exit within {timeout:.0f} s; every process printed its stacks (SIGUSR2), then was killed.\n"
                f"stdout tail:\n{out[-3000:]}\nstderr tail:\n{err[-12000:]}")
