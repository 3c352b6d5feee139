"""Atomic, complete checkpoints: ``run_dir/checkpoints/step-NNNNNNNN/`` plus a ``latest`` pointer.

Layout of one checkpoint::

    engine/             model, optimizer, LR scheduler (DeepSpeed: ZeRO partitions of every rank)
    rng/rank-00000.pt   torch / numpy / python (/ cuda) RNG state of each rank (tensors + ints only)
    data/rank-00000.json  data position (the global sample slot and per-corpus counts; the same on every
                        rank, so a run resumes on another world size; see docs/interfaces.md)
    trainer_state.json  step, tokens, samples, metrics, health/throughput state, model build args, and
                        ``files``: the size and sha256 of every other file (written last)
    config.yaml         the resolved run config
    tokenizer/          copied from the corpus, so the checkpoint exports on its own

Every rank writes into ``.tmp-step-NNNNNNNN/``; after a barrier rank 0 fsyncs the tree, renames it
to its final name (an existing one of the same step is swapped out in one atomic exchange), fsyncs the
parent, then writes ``latest`` (atomically) — so a complete name never holds a partial checkpoint, and
``latest`` never names a missing one. Old checkpoints are pruned by renaming to ``.trash-*`` first. A
crash leaves at most ``.tmp-*`` / ``.trash-*`` directories, ignored by ``find_resume`` and removed by the
next save. Assumes a filesystem shared by all ranks (the usual cluster setup).

``verify_checkpoint`` checks every file against ``trainer_state.json``; ``find_resume(.., "auto")``
takes the newest checkpoint that verifies and warns about each newer one that does not, so a damaged
newest checkpoint never turns a requeued job into a crash loop.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError

from core.config import ConfigError, save_config
from core.files import (
    LOCK,
    MARKER,
    atomic_write_text,
    claim_output_dir,
    clean_trash,
    copy_tree,
    discard,
    fsync_dir,
    lock_dir,
    replace_dir,
    unlock_dir,
)
from models.safe_load import CheckpointError, safe_torch_load
from pipelines.engine.checkpoint_find import (
    Resume,
    checkpoint_files,
    find_resume,
    list_checkpoints,
    read_trainer_state,
    resume_of,
    step_dir_name,
    verify_checkpoint,
)

__all__ = ["save_checkpoint", "load_rank_state", "find_resume", "rng_state", "set_rng_state", "list_checkpoints",
           "step_dir_name", "verify_checkpoint", "read_trainer_state", "CheckpointError", "claim_run_dir",
           "refuse_fresh_start_over_checkpoints", "Resume", "agree_on_resume", "open_for_resume", "open_run_dir", "param_shapes",
           "refuse_other_model"]

log = logging.getLogger(__name__)

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
        fsync_dir(Path(dirpath))


def claim_run_dir(run_dir: str | os.PathLike) -> Path:
    """Make ``run_dir`` ours (a ``run`` marker); a non-empty folder pretrain did not create is refused.

    A run dir written before markers existed is refused too (it may as well be a user's folder that
    holds a ``config.yaml`` and ``checkpoints/``); the message gives the command that marks it.
    """
    return claim_output_dir(run_dir, "run", what="train.run_dir")



def refuse_fresh_start_over_checkpoints(run_dir: Path, train_cfg: Any) -> None:
    """resume=never where checkpoints exist: refused (they would mix with the new run's), or, with
    ``train.overwrite``, the old checkpoints and metrics are deleted (trash first) before starting."""
    old = list_checkpoints(run_dir)
    if train_cfg.resume != "never" or not old:
        return
    if not train_cfg.overwrite:
        raise ConfigError(
            f"train.resume=never, but {run_dir} already holds checkpoints ({old[0].name} .. {old[-1].name}). "
            f"A fresh run there would mix with them. Use another train.run_dir, resume with train.resume=auto, or "
            f"set train.overwrite=true to delete the old checkpoints and metrics and start over."
        )
    log.warning("train.overwrite=true: deleting the old checkpoints and metrics of %s.", run_dir)
    ck = Path(run_dir) / "checkpoints"
    for path in [*old, ck / "latest", Path(run_dir) / "metrics.jsonl", Path(run_dir) / "tb"]:  # only what runs write
        discard(path)


def open_run_dir(run_dir: Path, train_cfg: Any) -> int | None:
    """Rank 0, before anything is written: claim ``run_dir``, lock it for this job (``core.files.lock_dir``),
    refuse a fresh start over old checkpoints. Returns the lock (``core.files.unlock_dir`` at the end)."""
    claim_run_dir(run_dir)
    lock = lock_dir(run_dir, what="run directory", fix="use another train.run_dir")
    try:
        refuse_fresh_start_over_checkpoints(run_dir, train_cfg)
    except BaseException:
        unlock_dir(lock)
        raise
    return lock


def param_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    """Name -> full shape of every parameter (ZeRO-3's partitioned ones by their ``ds_shape``)."""
    return {name: list(getattr(p, "ds_shape", p.shape)) for name, p in model.named_parameters()}


def refuse_other_model(path: Path, state: dict[str, Any], shapes: dict[str, list[int]]) -> None:
    """A resume whose model differs from the checkpoint's (another ``model.*``, a corpus with another
    vocabulary) is one message naming the differences, not a state-dict traceback deep in the engine.
    Checkpoints from before ``param_shapes`` was recorded are not checked."""
    saved = state.get("param_shapes")
    if saved is None or saved == shapes:
        return
    diffs = [f"{n} {saved.get(n, 'absent')} in the checkpoint, {shapes.get(n, 'absent')} now"
             for n in sorted(set(saved) | set(shapes)) if saved.get(n) != shapes.get(n)]
    raise CheckpointError(
        f"{path} was written by another model than this run builds ({len(diffs)} parameter(s) differ, e.g. "
        f"{'; '.join(diffs[:3])}). It was built with {state.get('model_build')}. Resume with the model.* settings and "
        f"corpus that wrote it (see {path / 'config.yaml'}), or start a new run in another train.run_dir."
    )


_BUDGETS = ("max_steps", "max_tokens", "max_time_minutes")  # how a budget travels in agree_on_resume's all-reduce


def open_for_resume(engine: Any, run_dir: Path, train_cfg: Any,
                    shapes: dict[str, list[int]] | None = None) -> tuple[int | None, Resume | None]:
    """Rank 0 opens ``run_dir`` (``open_run_dir``: claimed, locked); every rank gets the checkpoint to resume
    from, its step and its reached budget (``agree_on_resume``; one of another model than ``shapes`` is refused
    there). Returns (rank 0's lock or None, the resume or None). A refused start takes back a run dir it created."""
    lock, error = None, None
    created = engine.rank == 0 and not Path(run_dir).exists()
    if engine.rank == 0:
        try:
            lock = open_run_dir(run_dir, train_cfg)
        except ConfigError as exc:  # raised on every rank by agree_on_resume (no rank waits for a dead one)
            error = exc
    try:
        return lock, agree_on_resume(engine, run_dir, train_cfg, error, shapes)
    except BaseException:
        unlock_dir(lock)
        if created and Path(run_dir).is_dir() and {p.name for p in Path(run_dir).iterdir()} <= {MARKER, LOCK}:
            discard(run_dir)  # only our marker and lock: nothing of the user's, nothing of a run
        raise


def agree_on_resume(engine: Any, run_dir: Path, train_cfg: Any, error: ConfigError | None,
                    shapes: dict[str, list[int]] | None = None) -> Resume | None:
    """Rank 0 picks (and verifies) the checkpoint to resume from, refuses one of another model than ``shapes``
    and sees which budget it has reached; every rank gets its choice (or its error), so no rank trains on
    while another returns."""
    resume = train_cfg.resume
    if engine.world_size == 1:
        if error is not None:
            raise error
        found = _resume_of_model(run_dir, resume, shapes)
        return resume_of(found, train_cfg) if found is not None else None
    chosen = None
    if engine.rank == 0 and error is None:
        try:
            found = _resume_of_model(run_dir, resume, shapes)
            chosen = resume_of(found, train_cfg) if found is not None else None
        except ConfigError as exc:
            error = exc
    code = -2 if error is not None else (-1 if chosen is None else chosen.step)
    finished = _BUDGETS.index(chosen.finished) + 1 if chosen is not None and chosen.finished else 0
    mine = [float(code), float(finished)] if engine.rank == 0 else [0.0, 0.0]
    code, finished = (int(v) for v in engine.all_reduce(torch.tensor(mine, dtype=torch.float64), "sum").tolist())
    if error is not None:
        raise error
    if code == -2:
        raise ConfigError(f"rank 0 refused to start in {run_dir} (see its message).")
    if code == -1:
        return None
    path = Path(resume) if resume != "auto" else Path(run_dir) / "checkpoints" / step_dir_name(code)
    return Resume(path, code, _BUDGETS[finished - 1] if finished else None)


def _resume_of_model(run_dir: Path, resume: str, shapes: dict[str, list[int]] | None) -> Path | None:
    """``find_resume``'s checkpoint, refused (``refuse_other_model``) before anything is written if another model wrote it."""
    found = find_resume(run_dir, resume)
    if found is not None and shapes is not None:
        refuse_other_model(found, read_trainer_state(found), shapes)
    return found



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
        clean_trash(ck)
        tmp.mkdir()
    engine.barrier()
    try:
        engine.save(tmp)
        (tmp / "rng").mkdir(exist_ok=True)
        (tmp / "data").mkdir(exist_ok=True)
        torch.save(rng_state(), tmp / "rng" / f"rank-{rank:05d}.pt")
        atomic_write_text(tmp / "data" / f"rank-{rank:05d}.json", json.dumps(data_state, indent=1))
        if rank == 0:
            save_config(cfg, tmp / "config.yaml")
            if tokenizer_dir is not None and tokenizer_dir.is_dir():
                copy_tree(tokenizer_dir, tmp / "tokenizer", what="the corpus tokenizer")  # never follows a link
        engine.barrier()
        if rank == 0:
            state = {**trainer_state, "files": checkpoint_files(tmp)}  # every rank's files are complete now
            atomic_write_text(tmp / "trainer_state.json", json.dumps(state, indent=1, default=float))
            _fsync_tree(tmp)
    except (OSError, RuntimeError, SafetensorError) as exc:  # disk full (torch.save: RuntimeError), quota, I/O error
        shutil.rmtree(tmp, ignore_errors=True)  # drop the partial copy, keep every complete one
        kept = find_resume(run_dir, "auto")
        free = shutil.disk_usage(ck).free
        reason = next((line for line in str(exc).splitlines() if line.strip()), "")
        raise CheckpointError(
            f"Writing checkpoint {final} failed ({type(exc).__name__}: {reason}; {free} bytes free there). The partial copy was removed; "
            f"{kept if kept else 'no earlier checkpoint'} is the newest complete checkpoint and was not touched. "
            f"Free space under {ck} (or lower train.keep_last) and resume with train.resume=auto."
        ) from None
    if rank == 0:
        replace_dir(tmp, final)  # re-saving a step (signal right after a periodic save): one atomic swap
        fsync_dir(ck)
        atomic_write_text(ck / "latest", final.name + "\n")
        older = [p for p in list_checkpoints(run_dir) if p.name < final.name]
        for old in older[: max(0, len(older) - (keep_last - 1))] if keep_last > 0 else []:
            discard(old)
    engine.barrier()
    return final


def load_rank_state(path: Path, rank: int) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]:
    """(trainer_state, this rank's RNG state or None, this rank's data state or None)."""
    state = read_trainer_state(path)
    rng_file = path / "rng" / f"rank-{rank:05d}.pt"
    data_file = path / "data" / f"rank-{rank:05d}.json"
    rng = safe_torch_load(rng_file) if rng_file.is_file() else None
    data = json.loads(data_file.read_text(encoding="utf-8")) if data_file.is_file() else None
    return state, rng, data
