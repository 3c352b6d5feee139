"""Shared fixtures for the training-engine tests: tiny corpora (the job helpers are in job_helpers.py)."""

from __future__ import annotations

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
