"""kill -9 at every phase of a checkpoint save, a corrupt newest checkpoint, and a full disk.

Each save runs in a real child process that SIGKILLs itself at one phase (a patched function in the
child script; nothing in the product knows about it). Afterwards: every checkpoint under its final name
is byte-identical to a complete one, the one ``resume=auto`` picks verifies, and nothing complete was lost.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from reliability_helpers import REPO, copy_run, tree

HERE = Path(__file__).parent

# each phase: code run in the child before the save, patching one step of it to end in SIGKILL
DIE = "import os, signal; die = lambda: os.kill(os.getpid(), signal.SIGKILL)"
PHASES = {
    # the temporary directory is complete and fsynced, not yet renamed
    "tmp_written": "orig = ck._fsync_tree\nck._fsync_tree = lambda p: (orig(p), die())",
    # renamed to its final name; `latest` not yet written
    "renamed": "orig = ck.atomic_write_text\n"
               "ck.atomic_write_text = lambda p, t: die() if Path(p).name == 'latest' else orig(p, t)",
    # `latest` written; pruning not started
    "latest_written": "orig = ck.atomic_write_text\n"
                      "ck.atomic_write_text = lambda p, t: (orig(p, t), Path(p).name == 'latest' and die())",
    # pruning the oldest checkpoint: killed after deleting one of its files
    "pruning": "import shutil\n"
               "def half_rmtree(p, *a, **k):\n"
               "    victim = next(f for f in sorted(Path(p).rglob('*')) if f.is_file())\n"
               "    victim.unlink(); die()\n"
               "shutil.rmtree = half_rmtree",
}


def _child(run_dir: Path, phase_code: str, step: int) -> subprocess.CompletedProcess:
    code = "\n".join([
        "import sys", "from pathlib import Path", f"sys.path.insert(0, {str(HERE)!r})", "import reliability_helpers as helpers",
        "from pipelines.engine import checkpoint as ck", DIE, phase_code,
        f"helpers.save_steps(Path({str(run_dir)!r}), [{step}], keep_last=2)", "print('SAVED')",
    ])
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _assert_intact(run_dir: Path, complete: dict[str, dict[str, bytes]]) -> str:
    """Every checkpoint under a final name equals a complete one; resume=auto picks one that verifies."""
    from pipelines.engine.checkpoint import find_resume, verify_checkpoint

    ck = run_dir / "checkpoints"
    names = sorted(p.name for p in ck.iterdir() if p.name.startswith("step-"))
    for name in names:
        got = tree(ck / name)
        if name in complete:
            assert got == complete[name], f"{name} was changed or half-deleted"
        verify_checkpoint(ck / name)
    chosen = find_resume(run_dir, "auto")
    assert chosen is not None and chosen.name in names
    verify_checkpoint(chosen)
    return chosen.name


@pytest.mark.parametrize("phase", list(PHASES))
def test_kill_9_during_a_new_save(phase, good_run, tmp_path):
    run = copy_run(good_run, tmp_path / "run")
    complete = {n: tree(run / "checkpoints" / n) for n in ("step-00000010", "step-00000020")}
    proc = _child(run, PHASES[phase], 30)
    assert proc.returncode == -9 and "SAVED" not in proc.stdout, proc.stderr[-3000:]
    chosen = _assert_intact(run, complete)
    # `latest` names the resume point: until it is rewritten, the previous checkpoint is the one
    assert chosen == ("step-00000020" if phase in ("tmp_written", "renamed") else "step-00000030")
    # the next save finishes what the killed one left: no .tmp-* / .trash-* remain, keep_last holds
    from reliability_helpers import save_steps

    save_steps(run, [40], keep_last=2)
    left = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert left == ["latest", "step-00000030", "step-00000040"] if phase != "tmp_written" else \
        left == ["latest", "step-00000020", "step-00000040"], left
    _assert_intact(run, {})


def test_kill_9_while_re_saving_a_step_keeps_a_complete_copy(good_run, tmp_path):
    """Re-saving step 20 (a signal right after a periodic save): killed while the old copy is deleted."""
    run = copy_run(good_run, tmp_path / "run")
    complete = {n: tree(run / "checkpoints" / n) for n in ("step-00000010", "step-00000020")}
    proc = _child(run, PHASES["pruning"], 20)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert (run / "checkpoints" / "step-00000020").is_dir()
    from pipelines.engine.checkpoint import verify_checkpoint

    verify_checkpoint(run / "checkpoints" / "step-00000020")  # the new copy, complete
    assert tree(run / "checkpoints" / "step-00000010") == complete["step-00000010"]
    assert _assert_intact(run, {"step-00000010": complete["step-00000010"]}) == "step-00000020"


def test_corrupt_newest_checkpoint_falls_back_with_a_warning(tmp_path, capsys):
    """A truncated optimizer file in the newest checkpoint: resume=auto takes the previous one (no crash loop)."""
    from trainer_job import run_job

    run_dir = tmp_path / "run"
    run_job({"run_dir": str(run_dir), "steps": 4, "checkpoint_every": 2, "resume": "auto"})
    bad = run_dir / "checkpoints" / "step-00000004" / "engine" / "optimizer.pt"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 3])
    capsys.readouterr()
    summary, _ = run_job({"run_dir": str(run_dir), "steps": 6, "checkpoint_every": 2, "resume": "auto"})
    out = capsys.readouterr().out
    assert summary["resumed_from"].endswith("step-00000002") and summary["steps"] == 6
    assert "skipping damaged checkpoint" in out and str(bad) in out


def test_newest_checkpoint_without_trainer_state_is_reported_by_resume_and_export(good_run, tmp_path, capsys):
    """A step folder whose trainer_state.json was lost is damage: resume=auto warns and falls back,
    export names it; neither takes the older checkpoint in silence. A .tmp-* save is no checkpoint."""
    from reliability_helpers import cli

    from pipelines.engine.checkpoint import find_resume

    run = copy_run(good_run, tmp_path / "run")
    newest = run / "checkpoints" / "step-00000020"
    (newest / "trainer_state.json").unlink()
    (run / "checkpoints" / ".tmp-step-00000030").mkdir()  # a save in progress: not worth a warning
    capsys.readouterr()
    assert find_resume(run, "auto") == run / "checkpoints" / "step-00000010"
    out = capsys.readouterr().out
    assert out.count("warning: skipping damaged checkpoint") == 1 and str(newest / "trainer_state.json") in out

    proc = cli("export", str(run), str(tmp_path / "release"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert str(newest / "trainer_state.json") in proc.stderr and not (tmp_path / "release").exists()


def test_resume_from_a_named_damaged_checkpoint_names_the_file(tmp_path):
    from trainer_job import run_job

    from core.config import ConfigError

    run_dir = tmp_path / "run"
    run_job({"run_dir": str(run_dir), "steps": 2, "checkpoint_every": 2, "resume": "auto"})
    ckpt = run_dir / "checkpoints" / "step-00000002"
    (ckpt / "engine" / "model.pt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(ConfigError, match=str(ckpt / "engine" / "model.pt")):
        run_job({"run_dir": str(run_dir), "steps": 4, "resume": str(ckpt)})


def _mount_small_tmpfs(where: Path, size: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    try:
        return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.parametrize("writer", ["torch", "safetensors"])
def test_disk_full_while_saving_keeps_the_previous_checkpoint(writer, good_run, tmp_path):
    """ENOSPC mid-save: a clear error naming the checkpoint, the partial copy gone, the previous one intact --
    also when safetensors (a ZeRO run's world-size-free copy, the default) is the writer that hits it.

    A small tmpfs when this process may mount one (root), else a child whose ``torch.save`` hits ENOSPC."""
    from reliability_helpers import WorldFreeFileEngine, save_steps

    from pipelines.engine.checkpoint import CheckpointError, find_resume

    engine_cls = WorldFreeFileEngine if writer == "safetensors" else None
    size = sum(f.stat().st_size for f in (good_run / "checkpoints" / "step-00000010").rglob("*") if f.is_file())
    mnt = tmp_path / "small"
    if writer == "safetensors":  # room for one checkpoint and its weights' copy, then a little: the next copy fails
        probe = save_steps(tmp_path / "probe", [10], engine_cls=engine_cls)[0]
        size = sum(f.stat().st_size for f in probe.rglob("*") if f.is_file())
    if _mount_small_tmpfs(mnt, f"{int(size * (1.12 if engine_cls else 1.6)) // 1024}k"):
        try:
            run = mnt / "run"
            save_steps(run, [10], keep_last=3, engine_cls=engine_cls)
            complete = tree(run / "checkpoints" / "step-00000010")
            with pytest.raises(CheckpointError) as err:
                save_steps(run, [20], keep_last=3, engine_cls=engine_cls)
            assert "step-00000020" in str(err.value) and "bytes free" in str(err.value)
            assert "step-00000010" in str(err.value)
            assert tree(run / "checkpoints" / "step-00000010") == complete
            assert find_resume(run, "auto").name == "step-00000010"
            assert not list((run / "checkpoints").glob(".tmp-*"))
        finally:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
        return
    if engine_cls is not None:
        pytest.skip("needs a small tmpfs (root) to fill")
    run = copy_run(good_run, tmp_path / "run")
    complete = tree(run / "checkpoints" / "step-00000020")
    patch = ("import errno, torch\norig = torch.save\n"
             "def full(obj, f, *a, **k):\n"
             "    raise OSError(errno.ENOSPC, 'No space left on device', str(f))\n"
             "torch.save = full")
    proc = _child(run, patch, 30)
    assert proc.returncode == 1 and "step-00000030" in proc.stderr and "No space left" in proc.stderr
    assert tree(run / "checkpoints" / "step-00000020") == complete
    assert find_resume(run, "auto").name == "step-00000020"


def test_disk_full_while_exporting_is_one_message_and_leaves_nothing(good_run, tmp_path):
    """ENOSPC while the release's safetensors are written: one message (which names the release and the
    free space), no temporary directory left behind, no release under the final name."""
    from pipelines.engine.export import export_checkpoint

    weights = (good_run / "checkpoints" / "step-00000020" / "engine" / "model.pt").stat().st_size
    mnt = tmp_path / "small"
    if not _mount_small_tmpfs(mnt, f"{max(64, weights // 2 // 1024)}k"):
        pytest.skip("needs a small tmpfs (root) to fill")
    try:
        from core.config import ConfigError

        with pytest.raises(ConfigError) as err:
            export_checkpoint(good_run / "checkpoints" / "step-00000020", mnt / "release")
        message = str(err.value)
        assert f"Writing the release {mnt / 'release'} failed" in message and "bytes free there" in message
        assert "Free space under" in message and "\n" not in message
        assert list(mnt.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
