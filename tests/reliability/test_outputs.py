"""Outputs: a command writes only into a directory it created or marked as its own, and never deletes
what it did not write (export destinations, run dirs, fresh runs over old checkpoints)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from reliability_helpers import REPO, cli, copy_run, tree

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


def test_a_folder_that_looks_like_an_older_run_dir_is_refused_until_marked(tmp_path):
    """config.yaml + checkpoints/ is not proof of ours: refused (the user's config and checkpoints kept)
    until its owner adds the marker with the command the message gives; then it resumes."""
    import subprocess

    from trainer_job import run_job

    from core.config import ConfigError

    run_dir = tmp_path / "run"
    run_job(_spec(run_dir, resume="auto"))
    (run_dir / MARKER).unlink()
    before = tree(run_dir)
    with pytest.raises(ConfigError, match="not created by pretrain") as err:
        run_job(_spec(run_dir, steps=6, resume="auto"))
    assert tree(run_dir) == before and output_kind(run_dir) is None
    command = str(err.value).split("yourself: ", 1)[1]
    subprocess.run(command, shell=True, check=True)  # what the message tells the owner to run
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


@pytest.fixture(scope="module")
def cli_inputs(good_run, tmp_path_factory):
    """What the writing subcommands need to get as far as their output: a corpus, a release, a task, a doc."""
    import corpus_fixtures as cf

    from pipelines.engine.export import export_checkpoint

    root = tmp_path_factory.mktemp("cli-inputs")
    cf.make_bert_corpus(root / "corpus", train_sizes=(48,), val_sizes=(16,))
    export_checkpoint(good_run, root / "release")
    (root / "train.tsv").write_text("text\tlabel\n" + "".join(f"review {i}\t{'pos' if i % 2 else 'neg'}\n" for i in range(16)))
    (root / "doc.txt").write_text("Some text. " * 50)
    return root


def _writing_commands(inputs, run, occupied) -> dict[str, list[str]]:
    """Per subcommand that writes, an invocation that writes its output into ``occupied``."""
    occ, corpus = str(occupied), str(inputs / "corpus")
    return {
        "demo": ["demo", "--out", occ, "--small", "--steps", "1"],
        "prepare": ["prepare", "configs/data/demo_bert.yaml", f"output={occ}", "progress=false",
                    f"sources=[{{type: text, paths: ['{inputs / 'doc.txt'}']}}]"],
        "train": ["train", "configs/train/bert_tiny_cpu.yaml", f"data.corpus={corpus}", f"train.run_dir={occ}",
                  "train.max_steps=1", "data.num_workers=0", "distributed.engine=ddp", "distributed.zero_stage=0"],
        "finetune": ["finetune", "configs/finetune/classification.yaml", f"checkpoint={inputs / 'release'}",
                     f"data.train={inputs / 'train.tsv'}", f"data.validation={inputs / 'train.tsv'}", f"train.run_dir={occ}",
                     "epochs=1", "data.micro_batch_size=8", "data.max_seq_len=64"],  # the release has 64 positions
        "export": ["export", str(run), occ],
        "sweep": ["sweep", "configs/sweeps/warmup_post_ln_bert.yaml", f"corpus={corpus}", f"out_dir={occ}", "seeds=[0]"],
        "report": ["report", str(run), "--out", occ],
        "submit": ["submit", "configs/train/bert_tiny_cpu.yaml", f"data.corpus={corpus}", f"train.run_dir={occ}"],
    }


READ_ONLY_COMMANDS = {"inspect", "plan"}


def test_every_writing_subcommand_is_listed():
    """A new subcommand must be added to the walk below (or to READ_ONLY_COMMANDS)."""
    from pipelines.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(sub.choices) == set(_writing_commands(REPO, REPO, REPO)) | READ_ONLY_COMMANDS


@pytest.mark.parametrize("command", sorted(_writing_commands(Path("."), Path("."), Path("."))))
def test_cli_walk_no_command_writes_into_a_users_folder(command, cli_inputs, run, tmp_path, capsys, monkeypatch):
    """Every `pretrain` subcommand that writes, pointed at a user's folder that looks like ours (a
    config.yaml next to checkpoints/, a report.html and PNGs): refused with one message, nothing changed."""
    from pipelines.cli import main
    from pipelines.engine.distributed import in_process_run

    mine = tmp_path / "mine"
    (mine / "checkpoints" / "step-00000001").mkdir(parents=True)
    (mine / "checkpoints" / "step-00000001" / "notes.txt").write_text("my own checkpoint notes")
    (mine / "config.yaml").write_text("my: config\n")
    (mine / "report.html").write_text("<p>my report</p>")
    (mine / "loss.png").write_bytes(b"\x89PNG my plot")
    before = tree(mine)
    monkeypatch.chdir(REPO)
    with in_process_run():
        code = main(_writing_commands(cli_inputs, run, mine)[command])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err, err[-2000:]
    assert "not created by pretrain" in err and str(mine) in err, err[-2000:]
    assert tree(mine) == before and sorted(p.name for p in mine.iterdir()) == ["checkpoints", "config.yaml", "loss.png",
                                                                                "report.html"]
