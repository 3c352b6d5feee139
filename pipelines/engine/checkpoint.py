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
import re
import shutil
from pathlib import Path
from typing import Any, NamedTuple

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
    sha256_file,
    unlock_dir,
)
from models.safe_load import CheckpointError, safe_torch_load

__all__ = ["save_checkpoint", "load_rank_state", "find_resume", "rng_state", "set_rng_state", "list_checkpoints",
           "step_dir_name", "verify_checkpoint", "read_trainer_state", "CheckpointError", "claim_run_dir",
           "refuse_fresh_start_over_checkpoints", "Resume", "agree_on_resume", "open_for_resume", "open_run_dir", "param_shapes",
           "refuse_other_model"]

log = logging.getLogger(__name__)

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
        fsync_dir(Path(dirpath))


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint folders of a run (``step-NNNNNNNN``), oldest first.

    One without ``trainer_state.json`` is listed too: it was complete once (saves are renamed into place
    whole), so it is damage that resume and export must report, not skip in silence. An in-progress
    save (``.tmp-*``) is no checkpoint.
    """
    ck = Path(run_dir) / "checkpoints"
    if not ck.is_dir():
        return []
    found = [p for p in ck.iterdir() if p.is_dir() and _STEP_RE.match(p.name)]
    return sorted(found, key=lambda p: p.name)


def read_trainer_state(path: Path) -> dict[str, Any]:
    """``path/trainer_state.json`` as a dict; a clear error if it is missing, empty or not JSON."""
    f = Path(path) / "trainer_state.json"
    try:
        state = json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{f} is missing: {path} is not a complete checkpoint. Use another checkpoint.") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{f} is empty or damaged ({exc}); the checkpoint cannot be used. Use another "
                              f"checkpoint (run_dir/checkpoints/step-NNNNNNNN).") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{f} does not hold a JSON object; the checkpoint cannot be used. Use another checkpoint.")
    return state


def checkpoint_files(path: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file of a checkpoint but ``trainer_state.json`` (relative POSIX paths)."""
    out = {}
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file() and p.name != "trainer_state.json"):
        out[f.relative_to(path).as_posix()] = {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
    return out


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """The trainer state of ``path`` once every file it lists has its recorded size and sha256; else CheckpointError.

    Checkpoints written before checksums existed (no ``files`` entry) are accepted as they are.
    """
    path = Path(path)
    state = read_trainer_state(path)
    files = state.get("files") or {}
    root = path.resolve()
    for rel, meta in files.items():
        f = path / rel
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            raise CheckpointError(f"{path}/trainer_state.json lists {rel!r}, outside the checkpoint. Use another checkpoint.")
        if not f.is_file():
            raise CheckpointError(f"{f} is missing; the checkpoint is incomplete. Use another checkpoint.")
        if f.is_symlink() or not f.resolve().is_relative_to(root):
            raise CheckpointError(f"{f} is a symlink (or lies behind one); checkpoint files must be plain files inside "
                                  f"the checkpoint. Use another checkpoint.")
        size = f.stat().st_size
        if size != meta.get("bytes"):
            raise CheckpointError(f"{f} has {size} bytes, {meta.get('bytes')} were written: the file is truncated or "
                                  f"changed. Use another checkpoint.")
        if sha256_file(f) != meta.get("sha256"):
            raise CheckpointError(f"{f} does not match its sha256 in trainer_state.json: the file is damaged or "
                                  f"changed. Use another checkpoint.")
    if files:  # a tensor file nobody recorded was added afterwards (loaders glob for them)
        extra = sorted(p.relative_to(path).as_posix() for p in path.rglob("*.pt") if p.relative_to(path).as_posix() not in files)
        if extra:
            raise CheckpointError(f"{path / extra[0]} is not listed in {path}/trainer_state.json: it was added after the "
                                  f"checkpoint was written. Remove it or use another checkpoint.")
    return state


def find_resume(run_dir: str | Path, resume: str) -> Path | None:
    """The checkpoint ``train.resume`` asks for: ``never`` -> None, ``auto`` -> newest that verifies, else that path.

    ``auto`` logs a warning naming each newer checkpoint that fails verification; a named path must verify.
    """
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        if not (path / "trainer_state.json").is_file():
            raise ConfigError(f"train.resume={resume} is not a complete checkpoint (no trainer_state.json). Point it at a "
                              f"run_dir/checkpoints/step-NNNNNNNN directory, or use auto / never.")
        verify_checkpoint(path)
        return path
    ck = Path(run_dir) / "checkpoints"
    candidates = list(reversed(list_checkpoints(run_dir)))
    latest = ck / "latest"
    if latest.is_file():  # the pointer first (it names the newest completed save), then the rest, newest first
        named = ck / latest.read_text(encoding="utf-8").strip()
        if named in candidates:
            candidates.remove(named)
            candidates.insert(0, named)
    for path in candidates:
        try:
            verify_checkpoint(path)
        except CheckpointError as exc:
            log.warning("Skipping checkpoint %s for resume: %s", path, exc)
            print(f"warning: skipping damaged checkpoint {path}: {exc}", flush=True)
            continue
        return path
    return None


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


class Resume(NamedTuple):
    """The checkpoint every rank resumes from, its step, and the budget of ``train`` it has already reached
    (``TrainConfig.budget_reached``; None: train on)."""

    path: Path
    step: int
    finished: str | None

    def nothing_to_do(self, run_dir: Path, train_cfg: Any) -> str:
        """The one line a rerun of a finished run prints: where it is, which budget to raise."""
        t, state = train_cfg, read_trainer_state(self.path)
        tokens, minutes = int(state.get("tokens", 0)), float(state.get("train_seconds", 0.0)) / 60
        where, detail = {
            "max_steps": (f"step {self.step}, past train.max_steps={t.max_steps}" if self.step > t.max_steps
                          else f"max_steps={t.max_steps}", ""),
            "max_tokens": (f"max_tokens={t.max_tokens}", f"{tokens} tokens at step {self.step}"),
            "max_time_minutes": (f"max_time_minutes={t.max_time_minutes:g}", f"{minutes:.2f} minutes of training at step {self.step}"),
        }[self.finished]
        if self.path.parent.parent == Path(run_dir):  # else train.resume names another run's checkpoint
            what = f"run {run_dir} is already at {where} ({detail}{'; ' if detail else ''}checkpoint {self.path})"
        else:
            what = f"train.resume={self.path} is already at {where}" + (f" ({detail})" if detail else "")
        return f"{what}: nothing to do. Raise train.{self.finished} to train further."


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
        return _resume_of(found, train_cfg) if found is not None else None
    chosen = None
    if engine.rank == 0 and error is None:
        try:
            found = _resume_of_model(run_dir, resume, shapes)
            chosen = _resume_of(found, train_cfg) if found is not None else None
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



def _resume_of(path: Path, train_cfg: Any) -> Resume:
    """A verified checkpoint as a ``Resume``: its step and the budget its trainer state has reached."""
    state = read_trainer_state(path)
    step = int(state["step"])
    return Resume(path, step, train_cfg.budget_reached(step, int(state.get("tokens", 0)), float(state.get("train_seconds", 0.0))))


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
