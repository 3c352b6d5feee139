"""Atomic, complete checkpoints: ``run_dir/checkpoints/step-NNNNNNNN/`` plus a ``latest`` pointer.

Layout of one checkpoint::

    engine/             model, optimizer, LR scheduler (DeepSpeed: ZeRO partitions of every rank)
    rng/rank-00000.pt   torch / numpy / python (/ cuda) RNG state of each rank (tensors + ints only)
    data/rank-00000.json  data position of each rank and its loader workers
    trainer_state.json  step, tokens, samples, metrics, health/throughput state, model build args
    config.yaml         the resolved run config
    tokenizer/          copied from the corpus, so the checkpoint exports on its own

Every rank writes into ``.tmp-step-NNNNNNNN/``; after a barrier rank 0 fsyncs the tree, renames it
to its final name, fsyncs the parent, then writes ``latest`` (atomically) — so a complete name never
holds a partial checkpoint, and ``latest`` never names a missing one. A crash leaves at most a
``.tmp-*`` directory, ignored by ``find_resume`` and removed by the next save. Assumes a filesystem
shared by all ranks (the usual cluster setup).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.config import save_config
from core.files import atomic_write_text

__all__ = ["save_checkpoint", "load_rank_state", "find_resume", "rng_state", "set_rng_state", "list_checkpoints", "step_dir_name"]

_STEP_RE = re.compile(r"^step-(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors/ints (loadable with ``weights_only=True``)."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    out = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]), "numpy_has_gauss": int(np_state[3]), "numpy_gauss": float(np_state[4]),
        "python": torch.tensor(py_state[1], dtype=torch.int64), "python_version": int(py_state[0]),
        "python_gauss": py_state[2] if py_state[2] is not None else float("nan"),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    np.random.set_state(("MT19937", s["numpy_keys"].numpy().astype(np.uint32), s["numpy_pos"], s["numpy_has_gauss"], s["numpy_gauss"]))
    gauss = s["python_gauss"]
    random.setstate((s["python_version"], tuple(int(x) for x in s["python"].tolist()), None if gauss != gauss else gauss))
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    ck = Path(run_dir) / "checkpoints"
    if not ck.is_dir():
        return []
    found = [p for p in ck.iterdir() if p.is_dir() and _STEP_RE.match(p.name) and (p / "trainer_state.json").is_file()]
    return sorted(found, key=lambda p: p.name)


def find_resume(run_dir: str | Path, resume: str) -> Path | None:
    """The checkpoint ``train.resume`` asks for: ``never`` -> None, ``auto`` -> newest complete, else that path."""
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        if not (path / "trainer_state.json").is_file():
            from core.config import ConfigError

            raise ConfigError(f"train.resume={resume} is not a complete checkpoint (no trainer_state.json). Point it at a "
                              f"run_dir/checkpoints/step-NNNNNNNN directory, or use auto / never.")
        return path
    latest = Path(run_dir) / "checkpoints" / "latest"
    if latest.is_file():
        named = latest.parent / latest.read_text(encoding="utf-8").strip()
        if (named / "trainer_state.json").is_file():
            return named
    found = list_checkpoints(run_dir)  # `latest` lost or stale: fall back to a scan
    return found[-1] if found else None


def save_checkpoint(engine: Any, run_dir: str | Path, step: int, *, cfg: Any, trainer_state: dict[str, Any],
                    data_state: dict[str, Any], keep_last: int, tokenizer_dir: Path | None = None) -> Path:
    """Write the checkpoint of ``step`` atomically (collective: every rank calls it); returns its path."""
    ck = Path(run_dir) / "checkpoints"
    final = ck / step_dir_name(step)
    tmp = ck / f".tmp-{step_dir_name(step)}"
    rank = engine.rank
    if rank == 0:
        ck.mkdir(parents=True, exist_ok=True)
        for stale in ck.glob(".tmp-step-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    engine.barrier()
    engine.save(tmp)
    (tmp / "rng").mkdir(exist_ok=True)
    (tmp / "data").mkdir(exist_ok=True)
    torch.save(rng_state(), tmp / "rng" / f"rank-{rank:05d}.pt")
    atomic_write_text(tmp / "data" / f"rank-{rank:05d}.json", json.dumps(data_state, indent=1))
    if rank == 0:
        save_config(cfg, tmp / "config.yaml")
        if tokenizer_dir is not None and tokenizer_dir.is_dir():
            shutil.copytree(tokenizer_dir, tmp / "tokenizer")
        atomic_write_text(tmp / "trainer_state.json", json.dumps(trainer_state, indent=1, default=float))
    engine.barrier()
    if rank == 0:
        _fsync_tree(tmp)
        if final.exists():  # re-saving the same step (e.g. signal right after a periodic save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(ck)
        atomic_write_text(ck / "latest", final.name + "\n")
        for old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    engine.barrier()
    return final


def load_rank_state(path: Path, rank: int) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]:
    """(trainer_state, this rank's RNG state or None, this rank's data state or None)."""
    state = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
    rng_file = path / "rng" / f"rank-{rank:05d}.pt"
    data_file = path / "data" / f"rank-{rank:05d}.json"
    rng = torch.load(rng_file, weights_only=True) if rng_file.is_file() else None
    data = json.loads(data_file.read_text(encoding="utf-8")) if data_file.is_file() else None
    return state, rng, data
