"""A gallery of hostile checkpoints: pickle payloads (ours and DeepSpeed's file names), symlinked
files, an empty trainer_state.json and a truncated model.pt. Each is refused with a message naming
the file, its payload never runs (the marker file it would create stays absent), and nothing is written."""

from __future__ import annotations

import collections
import shutil
from pathlib import Path

import pytest
import torch
from reliability_helpers import cli, copy_run, plant_payload, reseal

from core.config import ConfigError


@pytest.fixture()
def ckpt(good_run, tmp_path):
    return copy_run(good_run, tmp_path / "run") / "checkpoints" / "step-00000020"


def as_zero2(ckpt, marker, where: str) -> None:
    """Turn a checkpoint into DeepSpeed's ZeRO-2 layout with a payload in ``where`` (model_states / optim_states)."""
    sd = torch.load(ckpt / "engine" / "model.pt", weights_only=True)
    model_states = {"module": sd, "buffer_names": [], "param_shapes": [collections.OrderedDict((k, v.shape) for k, v in sd.items())],
                    "shared_params": {}, "ds_version": "0.19.8", "frozen_param_shapes": None, "frozen_param_fragments": None}
    for name in ("model.pt", "optimizer.pt"):
        (ckpt / "engine" / name).unlink()
    model_file = ckpt / "engine" / "mp_rank_00_model_states.pt"
    optim_file = ckpt / "engine" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save(model_states, model_file)
    optim = {"optimizer_state_dict": {"zero_stage": 2, "partition_count": 1}}
    plant_payload(model_file if where == "model_states" else optim_file, marker, model_states if where == "model_states" else optim)
    state = (ckpt / "trainer_state.json").read_text().replace('"zero_stage": null', '"zero_stage": 2').replace('"ddp"', '"deepspeed"')
    (ckpt / "trainer_state.json").write_text(state)
    reseal(ckpt)  # an attacker re-records the checksums


@pytest.mark.parametrize("where", ["optim_states", "model_states"])
def test_export_of_a_zero_checkpoint_never_runs_a_planted_payload(ckpt, tmp_path, where):
    from pipelines.engine.export import export_checkpoint

    marker = tmp_path / "PWNED"
    as_zero2(ckpt, marker, where)
    with pytest.raises(ConfigError, match="not plain tensor data") as err:
        export_checkpoint(ckpt, tmp_path / "release")
    assert f"{where}.pt" in str(err.value) and "nothing in it ran" in str(err.value)
    assert not marker.exists() and not (tmp_path / "release").exists()


def test_finetune_from_a_run_checkpoint_never_runs_a_planted_payload(ckpt, tmp_path):
    from pipelines.engine import distributed as dist
    from pipelines.finetune.runner import resolve_release

    marker = tmp_path / "PWNED"
    as_zero2(ckpt, marker, "optim_states")
    with dist.in_process_run(), pytest.raises(ConfigError, match="optim_states.pt is not plain tensor data"):
        resolve_release(str(ckpt), tmp_path / "ft", dist.init_env())
    assert not marker.exists() and not (tmp_path / "ft" / "base-release").exists()


def test_export_cli_refuses_a_payload_in_model_pt_without_traceback(ckpt, tmp_path):
    marker = tmp_path / "PWNED"
    plant_payload(ckpt / "engine" / "model.pt", marker, torch.load(ckpt / "engine" / "model.pt", weights_only=True))
    reseal(ckpt)
    proc = cli("export", str(ckpt), str(tmp_path / "release"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert str(ckpt / "engine" / "model.pt") in proc.stderr and not marker.exists()


def test_resume_never_runs_a_planted_payload(tmp_path):
    from trainer_job import run_job

    run_dir, marker = tmp_path / "run", tmp_path / "PWNED"
    run_job({"run_dir": str(run_dir), "steps": 2, "checkpoint_every": 2, "resume": "auto"})
    ck = run_dir / "checkpoints" / "step-00000002"
    plant_payload(ck / "engine" / "optimizer.pt", marker, torch.load(ck / "engine" / "optimizer.pt", weights_only=True))
    reseal(ck)
    with pytest.raises(ConfigError, match="optimizer.pt is not plain tensor data"):
        run_job({"run_dir": str(run_dir), "steps": 4, "resume": "auto"})
    assert not marker.exists()


def test_symlinked_checkpoint_files_are_refused(ckpt, tmp_path):
    """A tokenizer file pointing at a private file must not be read, let alone copied into a release."""
    from pipelines.engine.export import export_checkpoint

    secret = tmp_path / "id_rsa"
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----")
    link = ckpt / "tokenizer" / "tokenizer.json"
    link.unlink()
    link.symlink_to(secret)
    reseal(ckpt)
    with pytest.raises(ConfigError, match="is a symlink") as err:
        export_checkpoint(ckpt, tmp_path / "release")
    assert str(link) in str(err.value) and not (tmp_path / "release").exists()


def test_empty_trainer_state_and_truncated_model_get_messages(ckpt, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    (ckpt / "trainer_state.json").write_text("")
    proc = cli("export", str(ckpt), str(tmp_path / "r1"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert str(ckpt / "trainer_state.json") in proc.stderr and "empty or damaged" in proc.stderr

    from models.safe_load import safe_torch_load
    from pipelines.engine.export import consolidated_state_dict

    model = other / "engine" / "model.pt"
    model.write_bytes(model.read_bytes()[:1000])
    with pytest.raises(ConfigError, match="truncated or changed") as err:  # the recorded size says so
        consolidated_state_dict(other)
    assert str(model) in str(err.value)
    with pytest.raises(ConfigError, match="probably truncated or damaged"):  # a checkpoint without checksums
        safe_torch_load(model)


@pytest.mark.slow
def test_deepspeed_resume_never_runs_a_payload_in_optim_states(tmp_path):
    """A real DeepSpeed ZeRO-2 engine resuming (its own load_checkpoint asks for weights_only=False)."""
    from trainer_job import run_job

    run_dir, marker = tmp_path / "run", tmp_path / "PWNED"
    spec = {"run_dir": str(run_dir), "checkpoint_every": 2, "resume": "auto", "engine": "deepspeed", "zero_stage": 2}
    run_job({**spec, "steps": 2})
    ck = run_dir / "checkpoints" / "step-00000002"
    optim = next((ck / "engine").glob("*optim_states.pt"))
    plant_payload(optim, marker, torch.load(optim, weights_only=False))  # our own file, just written
    reseal(ck)
    with pytest.raises(ConfigError, match="optim_states.pt is not plain tensor data") as err:
        run_job({**spec, "steps": 4})
    assert str(optim) in str(err.value) and not marker.exists()


def test_symlinked_engine_dir_and_an_added_tensor_file_are_refused(ckpt, tmp_path):
    from pipelines.engine.checkpoint import verify_checkpoint

    elsewhere = tmp_path / "elsewhere"
    shutil.move(ckpt / "engine", elsewhere)
    (ckpt / "engine").symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="lies behind one") as err:
        verify_checkpoint(ckpt)
    assert str(ckpt / "engine") in str(err.value)
    (ckpt / "engine").unlink()
    shutil.move(elsewhere, ckpt / "engine")
    verify_checkpoint(ckpt)
    torch.save({"w": torch.zeros(2)}, ckpt / "engine" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(ConfigError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt is not listed"):
        verify_checkpoint(ckpt)


def _train_argv(corpus, run_dir, *extra: str) -> list[str]:
    return ["train", "configs/train/bert_tiny_cpu.yaml", f"data.corpus={corpus}", f"train.run_dir={run_dir}",
            "train.max_steps=2", "train.checkpoint_every=1", "train.eval_every=0", "data.num_workers=0",
            "data.micro_batch_size=4", "distributed.engine=ddp", "distributed.zero_stage=0", *extra]


def _main(argv, capsys, monkeypatch) -> tuple[int, str]:
    """`pretrain ARGV` in this process (the CLI's own main), from the repository root."""
    from reliability_helpers import REPO

    from pipelines.cli import main
    from pipelines.engine.distributed import in_process_run

    monkeypatch.chdir(REPO)
    with in_process_run():
        code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("link", ["tokenizer/tokenizer.json", "tokenizer/sub/vocab.txt"])
def test_a_corpus_file_linked_from_outside_is_never_read_or_copied(tmp_path, capsys, monkeypatch, link):
    """tokenizer/tokenizer.json (or a file in a folder inside it) a symlink to a file outside the corpus, in a
    manifest without a tokenizer sha256: refused before training; the outside file lands in no checkpoint."""
    import json

    import corpus_fixtures as cf

    corpus = cf.make_bert_corpus(tmp_path / "corpus", train_sizes=(32,), val_sizes=(8,))
    manifest = json.loads((corpus / "manifest.json").read_text())
    manifest["tokenizer"].pop("sha256", None)
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    secret = tmp_path / "secret.json"
    target = corpus / link
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        shutil.move(target, secret)  # a real tokenizer, so only the link gives it away
    else:
        secret.write_text("SECRET")
    target.symlink_to(secret)
    code, err = _main(_train_argv(corpus, tmp_path / "run"), capsys, monkeypatch)
    assert code != 0 and "Traceback" not in err, err[-2000:]
    assert str(target) in err and "outside" in err, err[-2000:]
    copied = [p for p in (tmp_path / "run").rglob("*") if p.is_file() and p.read_bytes() == secret.read_bytes()]
    assert not copied


def test_paths_relative_to_the_current_directory_are_read_as_the_readme_writes_them(good_run, tmp_path, capsys,
                                                                                     monkeypatch):
    """README commands name `demo_out/corpus` and `release/bert-tiny` relative to where the user stands: the
    inside-checks must not join such a path to itself (`demo_out/corpus/demo_out/corpus/tokenizer`)."""
    import corpus_fixtures as cf

    from core.corpus import load_manifest
    from models.hf import from_hf
    from pipelines.cli import main
    from pipelines.engine.export import export_checkpoint
    from pipelines.finetune.runner import resolve_release

    cf.make_bert_corpus(tmp_path / "demo_out" / "corpus", train_sizes=(16,), val_sizes=(8,))
    export_checkpoint(good_run, tmp_path / "release" / "bert-tiny")
    monkeypatch.chdir(tmp_path)
    assert load_manifest("demo_out/corpus").tokenizer_dir == Path("demo_out/corpus/tokenizer")
    assert main(["inspect", "demo_out/corpus"]) == 0 and "B: " in capsys.readouterr().out  # samples decoded
    assert resolve_release("release/bert-tiny", tmp_path / "ft", None) == Path("release/bert-tiny")
    model, report = from_hf("release/bert-tiny")
    assert not report.missing


def test_a_checkpoint_copy_never_follows_a_link(tmp_path):
    """Links that stay inside are readable, but a copy refuses them rather than following them."""
    from core.config import ConfigError
    from core.files import copy_tree

    src = tmp_path / "tok"
    (src / "sub").mkdir(parents=True)
    (src / "tokenizer.json").write_text("{}")
    (src / "sub" / "vocab.txt").symlink_to(src / "tokenizer.json")
    with pytest.raises(ConfigError, match="is a symlink") as err:
        copy_tree(src, tmp_path / "copy", what="the corpus tokenizer")
    assert str(src / "sub" / "vocab.txt") in str(err.value)


def test_a_pickle_payload_in_an_hf_pytorch_model_bin_is_one_clear_line(good_run, tmp_path, capsys, monkeypatch):
    """A Hugging Face directory (no safetensors) whose pytorch_model.bin is a pickle payload: refused by the
    project's safe loader with a message naming the file, never a traceback suggesting weights_only=False."""
    from pipelines.engine.export import export_checkpoint

    release, marker = export_checkpoint(good_run, tmp_path / "release"), tmp_path / "PWNED"
    from safetensors.torch import load_file

    sd = load_file(release / "model.safetensors")
    (release / "model.safetensors").unlink()
    plant_payload(release / "pytorch_model.bin", marker, sd)
    (tmp_path / "train.tsv").write_text("text\tlabel\n" + "".join(f"review {i}\t{'pos' if i % 2 else 'neg'}\n" for i in range(16)))
    code, err = _main(["finetune", "configs/finetune/classification.yaml", f"checkpoint={release}",
                       f"data.train={tmp_path / 'train.tsv'}", f"data.validation={tmp_path / 'train.tsv'}",
                       f"train.run_dir={tmp_path / 'ft'}", "epochs=1", "data.micro_batch_size=8"], capsys, monkeypatch)
    assert code != 0 and "Traceback" not in err and "weights_only=False" not in err, err[-2000:]
    assert str(release / "pytorch_model.bin") in err and "not plain tensor data" in err, err[-2000:]
    assert not marker.exists()


def test_inspect_reads_nothing_outside_the_corpus(tmp_path, capsys, monkeypatch):
    """`pretrain inspect`: a tokenizer linked from outside, then a manifest naming a shard outside: refused, named."""
    import json

    import corpus_fixtures as cf

    corpus = cf.make_bert_corpus(tmp_path / "corpus", train_sizes=(16,), val_sizes=(8,))
    tok = corpus / "tokenizer" / "tokenizer.json"
    shutil.move(tok, tmp_path / "elsewhere.json")
    tok.symlink_to(tmp_path / "elsewhere.json")
    code, err = _main(["inspect", str(corpus)], capsys, monkeypatch)
    assert code == 2 and "Traceback" not in err and str(tok) in err and "outside" in err, err[-2000:]
    tok.unlink()
    shutil.move(tmp_path / "elsewhere.json", tok)
    shutil.copy(corpus / "train-000000.tar", tmp_path / "outside.tar")
    raw = json.loads((corpus / "manifest.json").read_text())
    raw["splits"]["train"]["shards"][0]["name"] = "../outside.tar"
    (corpus / "manifest.json").write_text(json.dumps(raw))
    code, err = _main(["inspect", str(corpus)], capsys, monkeypatch)
    assert code == 2 and "Traceback" not in err and "'../outside.tar'" in err, err[-2000:]


def test_a_study_report_reads_no_run_outside_the_sweep(tmp_path, capsys, monkeypatch):
    """sweep.json naming a run `../../elsewhere`: `pretrain report SWEEP` refuses it instead of reading that dir."""
    import json

    sweep = tmp_path / "sweep"
    (sweep / "runs").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "metrics.jsonl").write_text(json.dumps({"step": 1, "split": "train", "loss": 1.0}) + "\n")
    (sweep / "sweep.json").write_text(json.dumps({"name": "s", "runs": [{"name": "../../elsewhere"}]}))
    code, err = _main(["report", str(sweep)], capsys, monkeypatch)
    assert code == 2 and "Traceback" not in err and "outside" in err and "elsewhere" in err, err[-2000:]
    assert not (sweep / "study").exists()
