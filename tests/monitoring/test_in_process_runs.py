"""Several jobs in one process (demo, sweeps, notebooks, this suite): a run leaves no global state behind."""

from __future__ import annotations

import os

import pytest
import torch
from trainer_job import run_job

from pipelines.engine.launcher import _RENDEZVOUS_VARS

WORLD_VARS = _RENDEZVOUS_VARS  # what init_env() writes and in_process_run puts back


@pytest.mark.slow
def test_zero3_run_leaves_torch_linear_and_the_environment_as_it_found_them(tmp_path, monkeypatch):
    """ZeRO-3 replaces ``torch.nn.functional.linear`` with its autograd wrapper and never puts it back;
    every later in-process run (a DDP fine-tune after a ZeRO-3 pretrain) then ran through it. And a run
    writes its world into os.environ: left there, every later run and every job started from this
    process reused its MASTER_PORT, which the dead run's store still held (EADDRINUSE)."""
    for name in WORLD_VARS:
        monkeypatch.delenv(name, raising=False)
    original = torch.nn.functional.linear
    summary, _ = run_job({"run_dir": tmp_path / "z3", "steps": 3, "engine": "deepspeed", "zero_stage": 3})
    assert summary["steps"] == 3
    assert torch.nn.functional.linear is original
    assert {name: os.environ.get(name) for name in WORLD_VARS} == dict.fromkeys(WORLD_VARS)
    assert not torch.distributed.is_initialized()
    summary, _ = run_job({"run_dir": tmp_path / "ddp", "steps": 2, "engine": "ddp"})  # the next run starts cleanly
    assert summary["steps"] == 2
