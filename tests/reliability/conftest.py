"""Fixtures of the fault-injection suite (helpers live in reliability_helpers.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from reliability_helpers import save_steps  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    import corpus_fixtures as cf

    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    cf.write_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def good_run(tmp_path_factory, tokenizer_dir) -> Path:
    """A run dir with complete checkpoints at steps 10 and 20 (read-only: tests copy it)."""
    run = tmp_path_factory.mktemp("good") / "run"
    from pipelines.engine.checkpoint import claim_run_dir

    claim_run_dir(run)
    save_steps(run, [10, 20], tokenizer=tokenizer_dir)
    return run
