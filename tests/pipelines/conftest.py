"""Shared fixtures for the training-engine tests: tiny corpora and a one-process DeepSpeed world (the job helpers are in job_helpers.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import corpus_fixtures as cf  # noqa: E402


@pytest.fixture(scope="session")
def bert_corpus(tmp_path_factory) -> Path:
    return cf.make_bert_corpus(tmp_path_factory.mktemp("corpora") / "bert")


@pytest.fixture(scope="session")
def gpt_corpus(tmp_path_factory) -> Path:
    return cf.make_gpt_corpus(tmp_path_factory.mktemp("corpora") / "gpt")


@pytest.fixture(scope="session")
def image_corpus(tmp_path_factory) -> Path:
    return cf.make_image_corpus(tmp_path_factory.mktemp("corpora") / "images")


@pytest.fixture(scope="module")
def ds_world():
    """A world of one for DeepSpeed, torn down as the product tears down an in-process run: later tests
    assert that no process group exists, and jobs they start must not inherit this world's port."""
    deepspeed = pytest.importorskip("deepspeed")
    import torch.distributed as dist

    from pipelines.engine.distributed import free_port, in_process_run

    with in_process_run():
        if not dist.is_initialized():
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                              LOCAL_RANK="0")
            deepspeed.init_distributed(dist_backend="gloo")
        yield deepspeed
