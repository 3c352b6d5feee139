"""Several jobs in one process (demo, sweeps, notebooks, this suite): a run leaves no global state behind."""

from __future__ import annotations

import pytest
import torch
from trainer_job import run_job


@pytest.mark.slow
def test_zero3_run_leaves_torch_linear_as_it_found_it(tmp_path):
    """ZeRO-3 replaces ``torch.nn.functional.linear`` with its autograd wrapper and never puts it back;
    every later in-process run (a DDP fine-tune after a ZeRO-3 pretrain) then ran through it."""
    original = torch.nn.functional.linear
    summary, _ = run_job({"run_dir": tmp_path / "z3", "steps": 3, "engine": "deepspeed", "zero_stage": 3})
    assert summary["steps"] == 3
    assert torch.nn.functional.linear is original
