"""Finding the checkpoint a run resumes from, without torch: list, verify (sizes and sha256 against
``trainer_state.json``), pick (``find_resume``), and see which budget it has reached (``Resume``).

Torch-free so that the launching process (``pretrain train --nproc N``, which never imports torch) can tell
a finished run before it starts any rank (``finished_before_launch``); ``pipelines.engine.checkpoint``
writes checkpoints and re-exports these.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, NamedTuple

from core.config import ConfigError
from core.errors import CheckpointError
from core.files import sha256_file

__all__ = ["step_dir_name", "list_checkpoints", "read_trainer_state", "checkpoint_files", "verify_checkpoint",
           "find_resume", "Resume", "resume_of", "finished_before_launch", "newest_checkpoint"]

log = logging.getLogger("pipelines.engine.checkpoint")  # the warnings' logger is the checkpoint module's, as before

_STEP_RE = re.compile(r"^step-(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


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


def resume_of(path: Path, train_cfg: Any) -> Resume:
    """A verified checkpoint as a ``Resume``: its step and the budget its trainer state has reached."""
    state = read_trainer_state(path)
    step = int(state["step"])
    return Resume(path, step, train_cfg.budget_reached(step, int(state.get("tokens", 0)), float(state.get("train_seconds", 0.0))))




def finished_before_launch(cfg: Any) -> str | None:
    """The line a rerun of a finished run prints (``Resume.nothing_to_do``), found by the launching process before
    any rank starts, or None: train, and let the ranks decide as they always do (``agree_on_resume``).

    The checkpoint is the one the ranks would take when it verifies (``find_resume`` takes the newest that does),
    and its files are hashed only once its trainer state says the run is finished, so an unfinished run costs one
    small read. A damaged one, or one written under other ``model`` or ``data`` settings, is left to the ranks: they
    warn and take an older one, or refuse a checkpoint of another model before they look at budgets."""
    import yaml

    from core.config import to_dict

    t = cfg.train
    if t.resume == "never":
        return None
    run_dir = Path(t.run_dir)
    newest = Path(t.resume) if t.resume != "auto" else newest_checkpoint(run_dir)
    try:
        if newest is None or (resume := resume_of(newest, t)).finished is None:
            return None
        verify_checkpoint(newest)
        saved = yaml.safe_load((newest / "config.yaml").read_text(encoding="utf-8"))
    except (CheckpointError, OSError, ValueError, KeyError, yaml.YAMLError):
        return None  # the ranks report it, with the rest of their checks
    now = yaml.safe_load(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    if not isinstance(saved, dict) or any(saved.get(k) != now.get(k) for k in ("model", "data")):
        return None
    return resume.nothing_to_do(run_dir, t)


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint ``latest`` names, else the newest listed; not verified."""
    latest = run_dir / "checkpoints" / "latest"
    if latest.is_file():
        named = run_dir / "checkpoints" / latest.read_text(encoding="utf-8").strip()
        if named.is_dir():
            return named
    found = list_checkpoints(run_dir)
    return found[-1] if found else None
