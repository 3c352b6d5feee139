"""The `pretrain` command: every subcommand's --help works and shows an example; errors exit cleanly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from core.config import ConfigError, parse_command_line
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


@pytest.mark.parametrize("command, config, cls", [
    ("prepare", "configs/data/demo_bert.yaml", "data_prep.config:PrepConfig"),
    ("train", "configs/train/bert_tiny_cpu.yaml", "pipelines.engine.config:RunConfig"),
    ("finetune", "configs/finetune/classification.yaml", "pipelines.finetune.config:FinetuneConfig"),
    ("submit", "configs/train/bert_tiny_cpu.yaml", "pipelines.engine.config:RunConfig"),
    ("plan", "configs/train/gpu/gpt2_small.yaml", "pipelines.engine.config:RunConfig"),
])
def test_the_override_a_help_page_shows_is_one_its_config_takes(command, config, cls, capsys):
    """`pretrain prepare --help` offered optim.lr=3e-4, a key a data-preparation config refuses."""
    import importlib
    import re

    from core.config import load_config

    with pytest.raises(SystemExit):
        main([command, "--help"])
    example = re.search(r"e\.g\. (\S+=\S+?)\.?\s", " ".join(capsys.readouterr().out.split())).group(1)
    module, name = cls.split(":")
    load_config(REPO / config, [example], cls=getattr(importlib.import_module(module), name))


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


def test_export_of_a_missing_path_says_so(tmp_path, capsys):
    assert main(["export", str(tmp_path / "runs" / "typo"), str(tmp_path / "release")]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"{tmp_path / 'runs' / 'typo'} does not exist" in line and "checkpoints/step-NNNNNNNN" in line
    assert not (tmp_path / "release").exists()


def test_prepare_missing_input_names_the_path(tmp_path, capsys):
    cfg = tmp_path / "prep.yaml"
    cfg.write_text(f"kind: bert_pairs\noutput: {tmp_path / 'out'}\nsources: [{{type: text, paths: ['{tmp_path / 'nope'}']}}]\n")
    code = main(["prepare", str(cfg)])
    err = capsys.readouterr().err
    assert code != 0 and str(tmp_path / "nope") in err
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize("what", ["prepare input", "finetune checkpoint", "finetune data", "inspect path", "report dir"])
def test_input_errors_exit_2_as_the_readme_promises(what, tmp_path, capsys):
    """PrepError, FinetuneError and FileNotFoundError are the user's to fix, like a ConfigError: exit 2, one line
    (1 is left for a run that crashed or diverged)."""
    from finetune_fixtures import save_hf_bert_checkpoint

    (tmp_path / "empty").mkdir()
    if what == "finetune data":
        save_hf_bert_checkpoint(tmp_path / "release")
    (tmp_path / "train.tsv").write_text("text\tlabel\n" + "".join(f"review {i}\t{'pos' if i % 2 else 'neg'}\n" for i in range(8)))
    (tmp_path / "latin1.tsv").write_bytes("text\tlabel\ncaf\xe9\tpos\n".encode("latin-1"))
    finetune = ["finetune", CLASSIFICATION, f"data.validation={tmp_path / 'train.tsv'}", f"train.run_dir={tmp_path / 'run'}"]
    argv, named = {
        "prepare input": (["prepare", "configs/data/demo_bert.yaml", f"output={tmp_path / 'out'}",
                           f"sources=[{{type: text, paths: ['{tmp_path / 'none'}/*.txt']}}]"], tmp_path / "none"),
        "finetune checkpoint": ([*finetune, f"checkpoint={tmp_path / 'empty'}", f"data.train={tmp_path / 'train.tsv'}"],
                                tmp_path / "empty"),
        "finetune data": ([*finetune, f"checkpoint={tmp_path / 'release'}", f"data.train={tmp_path / 'latin1.tsv'}"],
                          tmp_path / "latin1.tsv"),
        "inspect path": (["inspect", str(tmp_path / "corpus")], tmp_path / "corpus"),
        "report dir": (["report", str(tmp_path / "runs" / "typo"), "--out", str(tmp_path / "report")], tmp_path / "runs" / "typo"),
    }[what]
    capsys.readouterr()  # transformers' save_pretrained progress bar
    code = main(argv)
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and str(named) in line, line


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
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "'cat'" in err and str(tmp_path / "imgs") in err and "at least 2 classes" in err
    assert not (out / "manifest.json").exists()
    csv = tmp_path / "imgs" / "labels.csv"
    csv.write_text("file,kind,label\n" + "".join(f"cat/{i}.png,{i},animal\n" for i in range(3)))
    code = main(["prepare", "configs/data/digits_images.yaml", f"output={out}",
                 f"sources=[{{type: image_csv, paths: ['{csv}'], path_field: file, label_field: label}}]"])
    err = capsys.readouterr().err
    assert code == 2 and "column 'label'" in err and str(csv) in err and "label_field" in err, err


def test_finetune_names_an_image_release_before_its_image_folder(tmp_path, capsys):
    """A user fine-tuning a ViT release on a folder of class sub-folders was told the folder is "a directory, not a
    file"; pointing at a file only then showed that images are not fine-tuned at all. The model comes first."""
    import transformers

    transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8,
    )).save_pretrained(str(tmp_path / "vit"))
    for label in ("a", "b"):
        _png(tmp_path / "imgs" / label / "0.png", 10)
    capsys.readouterr()
    code = main(["finetune", str(REPO / "configs/finetune/classification_small.yaml"), f"checkpoint={tmp_path / 'vit'}",
                 f"data.train={tmp_path / 'imgs'}", f"data.validation={tmp_path / 'imgs'}", f"train.run_dir={tmp_path / 'run'}"])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and "holds a vit model; classification fine-tuning needs a BERT-architecture encoder" in line, line
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------ pre-launch checks


BERT_CPU = str(REPO / "configs/train/bert_tiny_cpu.yaml")
CLASSIFICATION = str(REPO / "configs/finetune/classification.yaml")


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err  # no per-rank copies, no traceback
    return lines[0]


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_train_with_a_missing_corpus_stops_before_any_process_starts(nproc, tmp_path, capsys):
    """README's `pretrain train CONFIG data.corpus=... --nproc N`: one line, exit 2, for every N."""
    code = main(["train", BERT_CPU, f"data.corpus={tmp_path / 'corpus'}",
                 f"train.run_dir={tmp_path / 'run'}", "--nproc", nproc])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and "manifest.json does not exist" in line and str(tmp_path / "corpus") in line
    assert not (tmp_path / "run").exists()


def test_overrides_may_follow_the_options_as_they_may_precede_them(tmp_path, capsys):
    """`pretrain train CONFIG --nproc 1 data.corpus=...`: argparse alone fills `overrides` at the first run of
    positionals only and refused the rest as "unrecognized arguments"; every word it leaves joins them, in order."""
    code = main(["train", BERT_CPU, "data.corpus=/absent-first", "--nproc", "1", f"data.corpus={tmp_path / 'corpus'}",
                 f"train.run_dir={tmp_path / 'run'}"])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and f"{tmp_path / 'corpus'}/manifest.json does not exist" in line  # the later override won
    assert main(["plan", str(REPO / "configs/train/gpu/gpt2_small.yaml"), "--gpus", "1", "data.micro_batch_size=32",
                 "--fs-gbps", "2"]) == 0
    assert "batch 512 = micro 32 x accum 16 x 1 GPUs" in capsys.readouterr().out
    from pipelines import pretrain
    from pipelines.engine.distributed import in_process_run

    with in_process_run():  # a rank with the deepspeed launcher's --local_rank between the config and its overrides
        assert pretrain.main([BERT_CPU, "--local_rank=0", f"data.corpus={tmp_path / 'corpus'}"]) == 2
    assert f"{tmp_path / 'corpus'}/manifest.json does not exist" in capsys.readouterr().err
    args = parse_command_line(build_parser(), ["report", "runs/a", "--out", "rep", "runs/b"])
    assert args.run_dirs == ["runs/a", "runs/b"] and args.out == "rep"
    for argv in (["train", BERT_CPU, "--nprocs", "2", "a=b"], ["export", "runs/a", "out", "extra"]):
        with pytest.raises(SystemExit) as exit_info:  # a misspelt option, or a word where no list takes it
            main(argv)
        assert exit_info.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--nproc", "2"])
    assert capsys.readouterr().err.splitlines()[-1].endswith("the following arguments are required: config")  # not key=value


def test_a_readme_command_run_outside_the_repository_names_the_root_and_a_misspelt_config_its_neighbour(
        tmp_path, monkeypatch, capsys):
    """The README's `pretrain train configs/train/...` from another directory said "check the path (configs live
    under configs/)" of a path that does start with configs/; a misspelt file name got the same advice."""
    monkeypatch.chdir(tmp_path)
    for nproc in ("1", "2"):
        code = main(["train", "configs/train/bert_tiny_cpu.yaml", "data.corpus=demo_out/corpus", "--nproc", nproc])
        line = _one_error_line(capsys.readouterr().err)
        assert code == 2 and f"current directory, {tmp_path}" in line and f"repository root, {REPO}" in line, line
        assert f"full path {REPO / 'configs/train/bert_tiny_cpu.yaml'}" in line
    code = main(["finetune", str(REPO / "configs/finetune/clasification_small.yaml")])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and f"Did you mean `{REPO / 'configs/finetune/classification_small.yaml'}`?" in line, line
    assert not any(tmp_path.iterdir())


def test_a_corpus_path_that_is_a_file_says_so_and_names_the_directory(tmp_path, capsys):
    """data.corpus=FILE said "FILE/manifest.json does not exist", a path inside a file; the manifest itself names
    the folder to use instead."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "manifest.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("mine\n")
    for corpus, fix in ((tmp_path / "notes.txt", "the directory `pretrain prepare` wrote"),
                        (tmp_path / "corpus" / "manifest.json", f"the folder holding it, {tmp_path / 'corpus'}")):
        code = main(["train", BERT_CPU, f"data.corpus={corpus}", f"train.run_dir={tmp_path / 'run'}", "--nproc", "2"])
        line = _one_error_line(capsys.readouterr().err)
        assert code == 2 and f"{corpus} is a file, not a corpus directory. Point at {fix}" in line, line
    assert (tmp_path / "notes.txt").read_text() == "mine\n" and not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["train", "finetune"])
def test_more_processes_than_the_machine_has_is_one_line_before_any_starts(command, bert_corpus, tmp_path, capsys):
    """`--nproc 64` on a 2-CPU machine launched 64 ranks (each a model copy and loader workers) onto 2 cores."""
    import os

    too_many = str(5 * len(os.sched_getaffinity(0)) + 64)  # past 4 ranks a core, and past any machine's GPUs
    run = tmp_path / "run"
    argv = (["train", BERT_CPU, f"data.corpus={bert_corpus}"] if command == "train" else
            ["finetune", CLASSIFICATION, f"checkpoint={tmp_path}", f"data.train={tmp_path / 'train.tsv'}",
             f"data.validation={tmp_path / 'train.tsv'}"])
    (tmp_path / "train.tsv").write_text("text\tlabel\n" + "".join(f"doc {i}\t{i % 2}\n" for i in range(8)))
    (tmp_path / "config.json").write_text("{}")
    code = main([*argv, f"train.run_dir={run}", "--nproc", too_many])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and f"--nproc {too_many} asks for {too_many} training processes" in line and "Use --nproc " in line, line
    assert not run.exists()


def test_a_few_more_ranks_than_cores_is_a_warning_on_cpu():
    """Two ranks on a one-core machine are how a laptop or a small CI runner tests a multi-rank run: said, not refused."""
    import os

    from pipelines.engine.launcher import CPU_PROCESSES_PER_CORE, accelerator_present, check_local_world

    if accelerator_present():
        pytest.skip("the CPU rule: a GPU machine refuses a rank past its last GPU")
    cores = len(os.sched_getaffinity(0))
    assert check_local_world(cores) is None
    warning = check_local_world(cores + 1)
    assert warning and f"on the {cores} CPU core(s)" in warning and f"slower than with --nproc {cores}" in warning
    assert check_local_world(CPU_PROCESSES_PER_CORE * cores) is not None
    with pytest.raises(ConfigError, match=rf"at most {CPU_PROCESSES_PER_CORE * cores}"):
        check_local_world(CPU_PROCESSES_PER_CORE * cores + 1)


@pytest.mark.parametrize("command, nproc", [("train", "2"), ("finetune", "1"), ("finetune", "2")])
def test_a_run_dir_of_the_users_own_files_is_one_line_before_any_rank_or_data(command, nproc, bert_corpus, tmp_path,
                                                                             capsys):
    """train.run_dir=FOLDER-OF-YOURS: refused by the ranks after a launch (the launcher's lines, then two errors), and
    by fine-tuning only after it had read the data; now one line first, the folder untouched."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    (tmp_path / "train.tsv").write_text("text\tlabel\n" + "".join(f"doc {i}\t{i % 2}\n" for i in range(8)))
    if command == "finetune":
        from finetune_fixtures import save_hf_bert_checkpoint

        save_hf_bert_checkpoint(tmp_path / "release")
        capsys.readouterr()  # transformers' save_pretrained progress bar
    argv = (["train", BERT_CPU, f"data.corpus={bert_corpus}"] if command == "train" else
            ["finetune", CLASSIFICATION, f"checkpoint={tmp_path / 'release'}", f"data.train={tmp_path / 'train.tsv'}",
             f"data.validation={tmp_path / 'train.tsv'}"])
    code = main([*argv, f"train.run_dir={mine}", "--nproc", nproc])
    out, err = capsys.readouterr()
    line = _one_error_line(err)
    assert code == 2 and f"train.run_dir {mine} is not empty and was not created by pretrain" in line, line
    assert not out and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def test_a_mixture_with_a_missing_corpus_names_it(bert_corpus, tmp_path, capsys):
    mixture = f"data.corpora=[{{path: {bert_corpus}, weight: 0.7}}, {{path: {tmp_path / 'absent'}, weight: 0.3}}]"
    code = main(["train", BERT_CPU, mixture, f"train.run_dir={tmp_path / 'run'}", "--nproc", "2"])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and f"{tmp_path / 'absent'}/manifest.json does not exist" in line


def test_finetune_with_a_missing_data_file_stops_before_any_process_starts(tmp_path, capsys):
    code = main(["finetune", CLASSIFICATION, f"checkpoint={tmp_path}",
                 f"data.train={tmp_path / 'train.tsv'}", f"train.run_dir={tmp_path / 'run'}", "--nproc", "2"])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and f"data.train={tmp_path / 'train.tsv'}: no such file" in line


def test_a_too_small_corpus_for_the_world_is_refused_before_launch(bert_corpus, tmp_path, capsys):
    code = main(["train", BERT_CPU, f"data.corpus={bert_corpus}",
                 "data.micro_batch_size=100000", f"train.run_dir={tmp_path / 'run'}", "--nproc", "2"])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and "fewer than one micro-batch per rank (world size 2 x data.micro_batch_size 100000" in line


def test_fp8_accelerate_file_is_refused_with_one_line(bert_corpus, tmp_path, capsys):
    """accelerate's own launcher answers `mixed_precision: fp8` with a traceback; we check the file first."""
    acc = tmp_path / "fp8.yaml"
    acc.write_text((REPO / "configs/accelerate/cpu_zero2.yaml").read_text().replace("mixed_precision: 'no'", "mixed_precision: fp8"))
    code = main(["train", BERT_CPU, f"data.corpus={bert_corpus}",
                 f"train.run_dir={tmp_path / 'run'}", "--nproc", "2", "--accelerate-config", str(acc)])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and f"{acc}: mixed_precision: fp8 is not supported" in line and "train.precision" in line


def test_accelerate_file_disagreeing_with_the_run_config_is_a_warning_naming_both(tmp_path, monkeypatch, capsys):
    """What a rank of `accelerate launch --config_file F -m pipelines.pretrain CONFIG` sees: accelerate exports
    the file's fields; the run config (bert_tiny_cpu.yaml: fp32, ZeRO-2) wins, loudly."""
    from pipelines.pretrain import main as rank_main

    for var, value in {"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
                       "ACCELERATE_GRADIENT_CLIPPING": "0.5", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(var, value)
    code = rank_main([BERT_CPU, f"data.corpus={tmp_path / 'absent'}",
                      f"train.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2  # then the missing corpus
    warnings = [line for line in err.splitlines() if " WARNING " in line]
    assert any("mixed_precision gives train.precision='bf16', but the run config sets train.precision='fp32': the "
               "run config wins" in w for w in warnings), err
    assert any("deepspeed_config.zero_stage gives distributed.zero_stage=3, but the run config sets "
               "distributed.zero_stage=2" in w for w in warnings), err
    assert "optim.grad_clip" in err and not any("grad_clip" in w for w in warnings)  # unset in the run config: applied


# ------------------------------------------------------------------------------------ dry runs


def test_submit_dry_run_renders_for_a_cluster_corpus_with_a_warning(capsys):
    """README: `pretrain submit configs/train/bert_tiny_cpu.yaml data.corpus=/shared/corpus ... --dry-run`."""
    argv = ["submit", BERT_CPU, "data.corpus=/nonexistent-shared/corpus",
            "train.run_dir=/nonexistent-shared/runs/bert", "--nodes", "4", "--gpus-per-node", "8"]
    assert main([*argv, "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "#SBATCH --nodes=4" in out
    assert "warning: /nonexistent-shared/corpus/manifest.json does not exist" in err
    assert main(argv) == 2  # a real submission still refuses it, before sbatch
    assert "manifest.json does not exist" in capsys.readouterr().err


def test_finetune_submit_dry_run_checks_data_and_the_shipped_config_requeues(capsys):
    argv = ["submit", CLASSIFICATION, "checkpoint=/nonexistent-shared/release",
            "data.train=/nonexistent-shared/train.tsv", "--kind", "finetune", "--gpus-per-node", "1", "--time", "1:00:00"]
    assert main([*argv, "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "#SBATCH" in out and "warning: data.train=/nonexistent-shared/train.tsv: no such file" in err
    assert "resume=never" not in err  # the shipped fine-tune configs resume (a requeued job continues)
    assert main(argv) == 2 and "data.train=/nonexistent-shared/train.tsv" in capsys.readouterr().err
