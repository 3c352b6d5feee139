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
