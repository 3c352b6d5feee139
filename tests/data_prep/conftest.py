"""Shared fixtures: one local Ray cluster per test session and small real text corpora."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

PY_DOC_SOURCES = Path("/usr/share/doc/python3.11-doc/html/_sources")


@pytest.fixture(scope="session")
def ray_cluster():
    """One Ray for the whole session (2 CPUs, no dashboard); yields its address for subprocesses."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    ctx = ray.get_runtime_context()
    yield ray.get_runtime_context().gcs_address if hasattr(ctx, "gcs_address") else ray.worker.global_worker.node.address
    ray.shutdown()


def write_pydoc_corpus(root: Path, topics_per_file: int = 10) -> Path:
    """Python's own `pydoc_data.topics` (always installed) as text files of blank-line-separated documents."""
    from pydoc_data.topics import topics

    root.mkdir(parents=True, exist_ok=True)
    items = sorted(topics.items())
    for i in range(0, len(items), topics_per_file):
        (root / f"topics-{i:03d}.txt").write_text("\n\n".join(v for _, v in items[i : i + topics_per_file]), encoding="utf-8")
    return root


def python_doc_files(max_bytes: int) -> list[str]:
    """Up to `max_bytes` of the reST sources of the Python docs (Debian package python3.11-doc)."""
    files, size = [], 0
    for f in sorted((PY_DOC_SOURCES / "library").glob("*.rst.txt")):
        files.append(str(f))
        size += f.stat().st_size
        if size >= max_bytes:
            break
    return files


@pytest.fixture(scope="session")
def real_text(tmp_path_factory) -> dict:
    """A few MB of real text: python3.11-doc when installed, else pydoc topics (smaller)."""
    if PY_DOC_SOURCES.is_dir():
        return {"paths": python_doc_files(3_000_000), "name": "python3.11-doc"}
    root = write_pydoc_corpus(tmp_path_factory.mktemp("pydoc"))
    return {"paths": [str(root / "*.txt")], "name": "pydoc_data"}


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", os.environ.get("TOKENIZERS_PARALLELISM", "false"))
