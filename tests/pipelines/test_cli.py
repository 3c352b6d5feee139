"""The `pretrain` command: every subcommand's --help works and shows an example; errors exit cleanly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]
SUBCOMMANDS = sorted(build_parser()._subparsers._group_actions[0].choices)  # noqa: SLF001


def test_expected_subcommands_exist():
    assert {"demo", "prepare", "inspect", "train", "finetune", "export", "report"} <= set(SUBCOMMANDS)


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_subcommand_help_has_an_example(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "Example:" in out and f"pretrain {command}" in out


def test_console_script_and_module_help():
    exe = Path(sys.executable).parent / "pretrain"
    for cmd in ([str(exe), "--help"], [sys.executable, "-m", "pipelines.pretrain", "--help"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "usage" in proc.stdout.lower()


def test_missing_config_file_exits_2(tmp_path, capsys):
    assert main(["train", str(tmp_path / "absent.yaml")]) == 2
    err = capsys.readouterr().err
    assert "absent.yaml does not exist" in err


def test_prepare_missing_input_names_the_path(tmp_path, capsys):
    cfg = tmp_path / "prep.yaml"
    cfg.write_text(f"kind: bert_pairs\noutput: {tmp_path / 'out'}\nsources: [{{type: text, paths: ['{tmp_path / 'nope'}']}}]\n")
    code = main(["prepare", str(cfg)])
    err = capsys.readouterr().err
    assert code != 0 and str(tmp_path / "nope") in err
    assert not (tmp_path / "out" / "manifest.json").exists()


def _png(path, value: int) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), (value, value, value)).save(path)


def test_prepare_refuses_a_one_class_image_corpus_naming_the_folder_or_column(tmp_path, capsys):
    """One class trains to loss 0 and learns nothing: refused before anything is read, with where the labels came from."""
    for i in range(3):
        _png(tmp_path / "imgs" / "cat" / f"{i}.png", 10 * i)
    out = tmp_path / "out"
    code = main(["prepare", "configs/data/digits_images.yaml", f"output={out}",
                 f"sources=[{{type: image_folder, paths: ['{tmp_path / 'imgs'}']}}]"])
    err = capsys.readouterr().err
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "'cat'" in err and str(tmp_path / "imgs") in err and "at least 2 classes" in err
    assert not (out / "manifest.json").exists()
    csv = tmp_path / "imgs" / "labels.csv"
    csv.write_text("file,kind,label\n" + "".join(f"cat/{i}.png,{i},animal\n" for i in range(3)))
    code = main(["prepare", "configs/data/digits_images.yaml", f"output={out}",
                 f"sources=[{{type: image_csv, paths: ['{csv}'], path_field: file, label_field: label}}]"])
    err = capsys.readouterr().err
    assert code == 1 and "column 'label'" in err and str(csv) in err and "label_field" in err, err
