"""Outputs: a command writes only into a directory it created or marked as its own, and never deletes
what it did not write (export destinations, run dirs, fresh runs over old checkpoints)."""

from __future__ import annotations

import json

import pytest
from reliability_helpers import cli, copy_run, tree

from core.files import MARKER, output_kind


@pytest.fixture()
def run(good_run, tmp_path):
    return copy_run(good_run, tmp_path / "run")


def test_export_refuses_a_users_folder_and_keeps_it(run, tmp_path):
    mine = tmp_path / "thesis"
    mine.mkdir()
    (mine / "chapter1.tex").write_text("years of work")
    before = tree(mine)
    proc = cli("export", str(run), str(mine))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert str(mine) in proc.stderr and MARKER in proc.stderr
    assert tree(mine) == before and not list(tmp_path.glob(".tmp-*"))


def test_export_onto_its_own_run_dir_is_refused_and_keeps_the_run(run):
    from core.config import ConfigError
    from pipelines.engine.export import export_checkpoint

    before = tree(run)
    proc = cli("export", str(run), str(run))  # `pretrain export runs/x runs/x`
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "overlaps the run directory" in proc.stderr and str(run) in proc.stderr
    for dest in (run / "checkpoints", run / "release", run.parent):
        with pytest.raises(ConfigError, match="overlaps the run directory"):
            export_checkpoint(run / "checkpoints" / "step-00000020", dest, overwrite=True)
    assert tree(run) == before


def test_export_onto_a_file_or_another_kind_is_refused(run, tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("keep me")
    other = tmp_path / "corpus"
    other.mkdir()
    (other / MARKER).write_text(json.dumps({"kind": "corpus"}))
    (other / "manifest.json").write_text("{}")
    from core.config import ConfigError
    from pipelines.engine.export import export_checkpoint

    with pytest.raises(ConfigError, match="not a directory"):
        export_checkpoint(run, f, overwrite=True)
    with pytest.raises(ConfigError, match="holds a pretrain corpus directory"):
        export_checkpoint(run, other, overwrite=True)
    assert f.read_text() == "keep me" and (other / "manifest.json").is_file()


def test_export_replaces_its_own_release_only_with_overwrite(run, tmp_path):
    from core.config import ConfigError
    from pipelines.engine.export import export_checkpoint

    rel = tmp_path / "release"
    export_checkpoint(run / "checkpoints" / "step-00000010", rel)
    assert output_kind(rel) == "release" and (rel / "model.safetensors").is_file()
    old = tree(rel)
    with pytest.raises(ConfigError, match="--overwrite"):
        export_checkpoint(run, rel)
    assert tree(rel) == old
    replaced = cli("export", str(run), str(rel), "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert tree(rel)["model.safetensors"] != old["model.safetensors"]  # step 20's weights now
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".trash-"))]


def _spec(run_dir, **kw):
    return {"run_dir": str(run_dir), "steps": 4, "checkpoint_every": 2, **kw}


def test_training_refuses_a_users_folder(tmp_path):
    from trainer_job import run_job

    from core.config import ConfigError

    mine = tmp_path / "photos"
    mine.mkdir()
    (mine / "cat.jpg").write_bytes(b"\xff\xd8 not really")
    with pytest.raises(ConfigError, match="not empty and was not created by pretrain"):
        run_job(_spec(mine))
    assert [p.name for p in mine.iterdir()] == ["cat.jpg"]


def test_fresh_run_over_checkpoints_is_refused_unless_asked(tmp_path):
    from trainer_job import run_job

    from core.config import ConfigError
    from pipelines.engine.checkpoint import find_resume, list_checkpoints

    run_dir = tmp_path / "run"
    run_job(_spec(run_dir, steps=6, resume="auto"))  # checkpoints 4 and 6 (keep_last 2)
    before = tree(run_dir / "checkpoints")
    with pytest.raises(ConfigError, match="already holds checkpoints") as err:
        run_job(_spec(run_dir, steps=4, resume="never"))
    assert "train.overwrite=true" in str(err.value)
    assert tree(run_dir / "checkpoints") == before

    # asked for: the old checkpoints go, the new run's stay, `latest` names one that exists
    summary, _ = run_job(_spec(run_dir, steps=4, resume="never", overwrite=True))
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-00000002", "step-00000004"]
    assert find_resume(run_dir, "auto").name == "step-00000004" == summary["checkpoint"].rsplit("/", 1)[-1]


def test_run_dir_of_an_older_version_is_adopted(tmp_path):
    """A run dir written before markers existed (config.yaml + checkpoints/) still resumes."""
    from trainer_job import run_job

    run_dir = tmp_path / "run"
    run_job(_spec(run_dir, resume="auto"))
    (run_dir / MARKER).unlink()
    summary, _ = run_job(_spec(run_dir, steps=6, resume="auto"))
    assert summary["resumed_from"] and summary["steps"] == 6 and output_kind(run_dir) == "run"


def test_prepare_refuses_a_users_folder_before_touching_it(tmp_path):
    """`pretrain prepare` output=<a user's folder>: refused before the manifest (or anything) is removed."""
    from core.config import ConfigError
    from data_prep.config import PrepConfig, SourceConfig
    from data_prep.job import run_prepare

    (tmp_path / "doc.txt").write_text("Some text. " * 50)
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "manifest.json").write_text('{"my": "own manifest"}')
    (mine / "train-000000.tar").write_bytes(b"my backup")
    before = tree(mine)
    cfg = PrepConfig(kind="packed_lm", output=str(mine), seq_len=16, progress=False,
                     sources=[SourceConfig(type="text", paths=[str(tmp_path / "doc.txt")])])
    with pytest.raises(ConfigError, match="not empty and was not created by pretrain"):
        run_prepare(cfg)
    assert tree(mine) == before
