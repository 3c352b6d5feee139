"""Suite-wide fixtures: the guard that no test leaves a torch.distributed world in os.environ, and
one small demo output (``pretrain demo --small``) shared by the demo test and the README script.

An in-process run writes RANK/WORLD_SIZE/MASTER_PORT into os.environ; left there, every later
in-process run and every job a later test starts reuses that MASTER_PORT, which the dead run's
store may still hold (EADDRINUSE far from the test that caused it). This fails the test that leaks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.engine.distributed import _RENDEZVOUS_VARS

WORLD_VARS = _RENDEZVOUS_VARS  # what init_env() writes and in_process_run puts back


@pytest.fixture(autouse=True)
def _no_world_left_in_the_environment():
    before = {k: os.environ.get(k) for k in WORLD_VARS}
    yield
    after = {k: os.environ.get(k) for k in WORLD_VARS}
    assert after == before, (f"this test left torch.distributed variables in os.environ: {before} -> {after}; run "
                             f"in-process jobs inside pipelines.engine.distributed.in_process_run (or monkeypatch)")


@pytest.fixture(scope="session")
def demo_output(tmp_path_factory) -> tuple[Path, str]:
    """``pretrain demo --small --steps 120 --out .../demo_out`` run once per session: (its output dir, its log).

    tests/pipelines/test_demo.py checks what it promises; tests/test_examples.py runs README.md after it."""
    out = tmp_path_factory.mktemp("demo") / "demo_out"
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "demo", "--small", "--steps", "120", "--out", str(out)],
                          capture_output=True, text=True, cwd=repo, timeout=1500)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    return out, log
