"""Suite-wide guard: no test leaves a torch.distributed world in os.environ.

An in-process run writes RANK/WORLD_SIZE/MASTER_PORT into os.environ; left there, every later
in-process run and every job a later test starts reuses that MASTER_PORT, which the dead run's
store may still hold (EADDRINUSE far from the test that caused it). This fails the test that leaks.
"""

from __future__ import annotations

import os

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
