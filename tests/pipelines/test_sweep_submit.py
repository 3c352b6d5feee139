"""`pretrain sweep ... --slurm` builds the array the --local sweep would run, and overrides never fight the grid.

A fake `sbatch` on PATH records its argv and the environment it got (no SLURM needed); tests/slurm/ runs a
real array.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from test_sweep import TINY_RUN, write_sweep

from pipelines import cli

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_sbatch(tmp_path, monkeypatch) -> Path:
    """An `sbatch` first on PATH that writes {argv, PRETRAIN_REPO, PRETRAIN_PYTHON} to the returned file."""
    record = tmp_path / "sbatch-call.json"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "sbatch"
    script.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'repo': os.environ.get('PRETRAIN_REPO'), "
        f"'python': os.environ.get('PRETRAIN_PYTHON')}}, open({str(record)!r}, 'w'))\n"
        "print('Submitted batch job 42')\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("PRETRAIN_REPO", raising=False)
    monkeypatch.delenv("PRETRAIN_PYTHON", raising=False)
    return record


def _sweep(tmp_path: Path, corpus: Path) -> Path:
    return write_sweep(tmp_path / "s.yaml", out_dir="sw", corpus=str(corpus), run=TINY_RUN,
                       warmups={"none": ["schedule.warmup=none"], "linear": ["schedule.warmup=linear"]})


def test_slurm_array_gets_the_set_overrides_and_this_checkout_from_any_directory(
        tmp_path, bert_corpus, fake_sbatch, monkeypatch, capsys):
    """`--set` used to be dropped on the way to the array (its runs trained with the sweep file's settings), and
    a submission from outside the repo ran every task in a directory without slurm/common.sh."""
    project = tmp_path / "project"  # the user's directory, not the checkout
    project.mkdir()
    monkeypatch.chdir(project)
    sweep = _sweep(tmp_path, bert_corpus)
    assert cli.main(["sweep", str(sweep), "seeds=[0,1]", "--set", "train.max_steps=3", "--slurm"]) == 0
    call = json.loads(fake_sbatch.read_text())
    argv = call["argv"]
    assert argv[0] == "--array=0-3" and argv[2] == str(REPO / "slurm" / "sweep_array.sbatch")
    assert argv[3:] == [str(sweep), "seeds=[0,1]", "--set", "train.max_steps=3"]
    assert call["repo"] == str(REPO) and call["python"] == sys.executable
    assert (project / "sw" / "sweep.json").is_file()

    # what each array task runs with those arguments: the --set value reaches the run's config
    from pipelines.study.sweep import expand, load_sweep, run_config

    loaded = load_sweep(sweep, ["seeds=[0,1]"])
    assert run_config(loaded, expand(loaded)[0], ["train.max_steps=3"]).train.max_steps == 3
    assert "Submitted batch job 42" in capsys.readouterr().out


def test_slurm_dry_run_writes_nothing_and_prints_a_command_that_pastes(tmp_path, bert_corpus, fake_sbatch,
                                                                       monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    sweep = _sweep(tmp_path, bert_corpus)
    assert cli.main(["sweep", str(sweep), "only=[adam-*]", "--set", "train.max_steps=3", "--slurm", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "sw").exists() and not fake_sbatch.exists()
    assert "'only=[adam-*]'" in out and "--set train.max_steps=3" in out and f"PRETRAIN_REPO={REPO}" in out


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--set", "train.run_dir=elsewhere", "--local"], "sets train.run_dir, which the sweep sets for every run"),
        (["--set", "train.seed=7", "--local"], "use the sweep field seeds=[...]"),
        (["--set", "optim.lr=1e-4", "--slurm"], "use the sweep field lrs=[...]"),
        (["optimizers.adam=[optim.name=adam, optim.lr=1e-4]", "--local"], "in optimizers.adam sets optim.lr"),
        (["--set", "schedule.warmup=none", "--local"], "which the sweep's warmups axis sets per run"),
        (["axes.opt={x: [optim.name=radam]}", "--local"], "optimizers and axes.opt both set optim.name"),
        (["--dry-run"], "add --slurm"),
        (["--force", "--slurm"], "--local only"),
    ],
)
def test_an_override_that_fights_the_grid_is_refused_before_anything_is_written(
        tmp_path, bert_corpus, fake_sbatch, monkeypatch, capsys, args, says):
    """`--set train.run_dir=X` made every grid point train in X (the second resumed the first's checkpoint);
    `--set optim.lr` / `train.seed` or an arm setting them trained every run alike under names that differ."""
    monkeypatch.chdir(tmp_path)
    sweep = _sweep(tmp_path, bert_corpus)
    assert cli.main(["sweep", str(sweep), *args]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err
    assert "--dry-run" in args or "--force" in args or str(sweep) in err  # names the sweep file
    assert not (tmp_path / "sw").exists() and not (tmp_path / "elsewhere").exists() and not fake_sbatch.exists()


def test_a_missing_corpus_is_refused_before_the_array_is_submitted(tmp_path, fake_sbatch, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    sweep = _sweep(tmp_path, tmp_path / "nowhere")
    assert cli.main(["sweep", str(sweep), "--slurm"]) == cli.EXIT_CONFIG
    assert "manifest.json does not exist" in capsys.readouterr().err
    assert not fake_sbatch.exists() and not (tmp_path / "sw").exists()
