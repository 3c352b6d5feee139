"""The launching process tells a finished run before any rank starts (``finished_before_launch``), without
torch, and leaves everything it is not sure of to the ranks: a damaged checkpoint, another model, resume=never."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from core.config import save_config
from core.files import sha256_file
from pipelines.engine.checkpoint_find import finished_before_launch
from pipelines.engine.config import load_run_config

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs/train/bert_tiny_cpu.yaml")


def _cfg(run_dir: Path, *overrides: str):
    return load_run_config(CONFIG, [f"train.run_dir={run_dir}", "data.corpus=corpus-bert", *overrides])


def _checkpoint(run_dir: Path, step: int, cfg, tokens: int = 1000) -> Path:
    """A checkpoint as ``save_checkpoint`` lays it out: its files listed with size and sha256 in trainer_state.json."""
    path = run_dir / "checkpoints" / f"step-{step:08d}"
    (path / "engine").mkdir(parents=True)
    (path / "engine" / "model.safetensors").write_bytes(b"weights of step %d" % step)
    save_config(cfg, path / "config.yaml")
    files = {f.relative_to(path).as_posix(): {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
             for f in sorted(path.rglob("*")) if f.is_file()}
    (path / "trainer_state.json").write_text(json.dumps({"step": step, "tokens": tokens, "files": files}))
    (run_dir / "checkpoints" / "latest").write_text(path.name)
    return path


def test_a_finished_run_is_told_before_launch_and_anything_unsure_is_left_to_the_ranks(tmp_path):
    run_dir = tmp_path / "run"
    done = _cfg(run_dir, "train.max_steps=4")
    path = _checkpoint(run_dir, 4, done)
    assert finished_before_launch(done) == (
        f"run {run_dir} is already at max_steps=4 (checkpoint {path}): nothing to do. Raise train.max_steps to train further.")
    assert finished_before_launch(_cfg(run_dir, "train.max_steps=5")) is None  # raised: train on
    assert finished_before_launch(_cfg(run_dir, "train.max_steps=4", "train.max_tokens=500")) is not None
    assert finished_before_launch(_cfg(tmp_path / "new", "train.max_steps=4")) is None  # no checkpoint yet
    # the ranks refuse a checkpoint of another model, or resume=never over checkpoints: not "nothing to do"
    assert finished_before_launch(_cfg(run_dir, "train.max_steps=4", "model.overrides={num_layers: 3}")) is None
    assert finished_before_launch(_cfg(run_dir, "train.max_steps=4", "train.resume=never")) is None
    assert finished_before_launch(_cfg(run_dir, "train.max_steps=4", "optim.lr=0.5")) is not None  # not the model's
    named = _cfg(tmp_path / "other", "train.max_steps=4", f"train.resume={path}", f"data.corpus={done.data.corpus}")
    assert finished_before_launch(named).startswith(f"train.resume={path} is already at max_steps=4: nothing to do.")

    (path / "engine" / "model.safetensors").write_bytes(b"damaged")  # the ranks warn and resume from an older one
    assert finished_before_launch(done) is None
    older = _checkpoint(run_dir, 2, done)
    (run_dir / "checkpoints" / "latest").write_text(path.name)
    assert finished_before_launch(done) is None  # step 2 verifies, and is not finished
    assert older.is_dir()


@pytest.mark.parametrize("state", ["", "{not json", "[]", '{"tokens": 3}'])
def test_an_unreadable_trainer_state_is_left_to_the_ranks(tmp_path, state):
    run_dir = tmp_path / "run"
    cfg = _cfg(run_dir, "train.max_steps=4")
    path = _checkpoint(run_dir, 4, cfg)
    (path / "trainer_state.json").write_text(state)
    assert finished_before_launch(cfg) is None


def test_the_check_before_launch_imports_no_torch(tmp_path):
    run_dir = tmp_path / "run"
    cfg = _cfg(run_dir, "train.max_steps=4")
    _checkpoint(run_dir, 4, cfg)
    code = ("import sys; from pipelines.engine.config import load_run_config; "
            "from pipelines.engine.checkpoint_find import finished_before_launch; "
            f"cfg = load_run_config({CONFIG!r}, ['train.run_dir={run_dir}', 'data.corpus=corpus-bert', 'train.max_steps=4']); "
            "line = finished_before_launch(cfg); assert line and 'nothing to do' in line, line; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
