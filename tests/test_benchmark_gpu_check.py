"""benchmarks/gpu_check.py checks every row it is asked for before the first run: a lease is minutes, and a
misspelt row or override must not cost the rows before it (docs/benchmarks.md, gpu_check)."""

import json
from pathlib import Path

from benchmarks.gpu_check import ENGINE_OVERRIDES, RECIPES, build_parser, check_rows, run, write_row_files


def _args(*argv: str):
    return build_parser().parse_args(["run", *argv])


def test_every_row_of_every_recipe_loads_and_passes_the_check(tmp_path):
    write_row_files(tmp_path)
    args = _args("--recipes", ",".join(RECIPES), "--engines", ",".join(ENGINE_OVERRIDES))
    assert check_rows(args, tmp_path / "corpora", tmp_path) == []


def test_a_cuda_graph_row_that_would_accumulate_is_refused_with_the_reason(tmp_path):
    # the GPT recipe's global batch of 512 is 32 micro-batches of 16 on one GPU: CUDA graphs cannot accumulate
    args = _args("--recipes", "gpt", "--engines", "deepspeed,zero2-cudagraphs", "--set", "train.global_batch_size=512")
    (error,) = check_rows(args, tmp_path / "corpora", tmp_path)
    assert error.startswith("gpt zero2-cudagraphs: model.compile_mode=reduce-overhead replays CUDA graphs"), error


def test_a_misspelt_row_or_override_stops_the_check_before_its_first_run(tmp_path, capsys):
    corpora = tmp_path / "corpora"
    for name in RECIPES:  # manifests only: nothing may read them, since no run may start
        (corpora / name).mkdir(parents=True)
        (corpora / name / "manifest.json").write_text(json.dumps({}))
    work = tmp_path / "work"
    rc = run(_args("--corpora", str(corpora), "--work", str(work), "--recipes", "gpt,bert",
                   "--engines", "deepspeed,zero2-cudagrahps", "--set", "train.global_batch_sise=512"))
    err = capsys.readouterr().err
    assert rc == 2 and "no run started" in err
    assert "--engines zero2-cudagrahps: no such row (did you mean zero2-cudagraphs?)" in err
    assert "gpt deepspeed: " in err and "Did you mean `train.global_batch_size`?" in err
    assert sorted(p.name for p in work.iterdir()) == ["timer_on.json"]  # no run directory, no log


def test_the_rows_run_what_the_table_says(tmp_path):
    from benchmarks.gpu_check import run_command

    args = _args("--set", "data.micro_batch_size=32", "--profile")
    cmd = run_command("bert", "ddp-cppwrapper", tmp_path / "bert", tmp_path, args, 32)
    at = cmd.index("pipelines.pretrain")
    assert cmd[at + 1] == "configs/train/gpu/bert_base_phase1.yaml" and f"data.corpus={tmp_path / 'bert'}" in cmd
    tail = cmd[cmd.index("train.global_batch_size=32"):]  # one micro-batch a step, then the row, then --set
    assert tail[:4] == ["train.global_batch_size=32", "distributed.engine=ddp", "model.compile_options={cpp_wrapper: true}",
                        "data.micro_batch_size=32"]
    assert tail[4].startswith("logging.profile_steps=") and Path(cmd[0]).name.startswith("python")


def test_prepare_redoes_a_raw_corpus_of_an_older_prepare_only(tmp_path):
    """A corpus of raw pixels resized by an older prepare (no ``crop`` in its manifest) is refused by training,
    so ``gpu_check.py prepare`` makes it again instead of reporting it prepared already."""
    from benchmarks.gpu_check import _prepared
    from core.corpus_kinds import corpus_kind

    new = corpus_kind("images").manifest_fields({"images": {"format": "raw", "size": 224}})
    old = {"images": {k: v for k, v in new["images"].items() if k not in ("resize", "crop")}}
    png = corpus_kind("images").manifest_fields({"images": {"format": "png", "resize_shorter": 256}})
    for name, manifest in {"new": new, "old": old, "png": png}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(json.dumps({"kind": "images", **manifest}))
    assert [_prepared(tmp_path / n) for n in ("new", "old", "png", "absent")] == [True, False, True, False]
