"""A gallery of hostile checkpoints: pickle payloads (ours and DeepSpeed's file names), symlinked
files, an empty trainer_state.json and a truncated model.pt. Each is refused with a message naming
the file, its payload never runs (the marker file it would create stays absent), and nothing is written."""

from __future__ import annotations

import collections
import shutil

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
