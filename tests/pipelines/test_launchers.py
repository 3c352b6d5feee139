"""What launchers hand our entry points: the DeepSpeed launcher's ``--local_rank``, the fields of an
``accelerate launch --config_file`` file, and console logging on rank 0."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from job_helpers import job_env, job_processes, summary_of

from core.config import ConfigError
from pipelines.engine.distributed import accelerate_file_settings, load_launched_config

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs/train/bert_tiny_cpu.yaml")


@pytest.mark.parametrize("flag", ["--local_rank=1", "--local-rank=1"])
def test_finetune_entry_accepts_the_local_rank_the_deepspeed_launcher_appends(flag, capsys):
    from pipelines.finetune.__main__ import main

    # the deepspeed launcher runs `python -u -m pipelines.finetune --local_rank=N CONFIG k=v...`
    code = main([flag, str(REPO / "configs/finetune/classification.yaml"), "epochs=0"])
    err = capsys.readouterr().err
    assert code == 2 and "epochs must be >= 1" in err and "unrecognized arguments" not in err


def test_accelerate_file_fields_sit_between_our_defaults_and_the_run_config(tmp_path, caplog):
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"extends": CONFIG, "distributed": {"zero_stage": 3}}))
    bert = yaml.safe_load(Path(CONFIG).read_text())
    assert "precision" in bert["train"] and "grad_accum_steps" not in bert["train"]
    ds_json = str(REPO / "configs/deepspeed/zero3.json")
    environ = {"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "1",
               "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4",
               "ACCELERATE_DEEPSPEED_CONFIG_FILE": ds_json, "RANK": "0"}
    with caplog.at_level(logging.INFO, logger="pipelines"):
        cfg = load_launched_config(run, [], environ=environ)
    assert cfg.train.grad_accum_steps == 4  # the file's value: the run config does not set it
    assert cfg.distributed.offload_optimizer is True and cfg.distributed.deepspeed_config == ds_json
    assert cfg.distributed.zero_stage == 3  # the run config wins over the file
    assert cfg.train.precision == "fp32"  # set by bert_tiny_cpu.yaml (extended): the run config wins
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("deepspeed_config.zero_stage gives distributed.zero_stage=1, but the run config sets "
               "distributed.zero_stage=3: the run config wins" in m for m in warned), warned
    assert any("mixed_precision gives train.precision='bf16', but the run config sets train.precision='fp32'" in m
               for m in warned), warned
    assert "deepspeed_config.gradient_accumulation_steps applied as train.grad_accum_steps=4" in caplog.text
    overridden = load_launched_config(run, ["train.grad_accum_steps=2"], environ=environ)
    assert overridden.train.grad_accum_steps == 2  # key=value overrides win over everything
    assert load_launched_config(None, [], environ=environ).train.precision == "bf16"  # over our default fp32


def test_accelerate_fields_we_cannot_honour_name_the_run_config_key():
    with pytest.raises(ConfigError, match=r"offload_optimizer_device=nvme.*distributed.offload_optimizer=true"):
        accelerate_file_settings({"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "nvme"})
    with pytest.raises(ConfigError, match=r"mixed_precision=fp8.*train.precision"):
        accelerate_file_settings({"ACCELERATE_MIXED_PRECISION": "fp8"})
    assert accelerate_file_settings({}) == {}


def test_pretrain_entry_shows_our_info_lines_on_rank_0_only(tmp_path):
    """configure_logging: the accelerate-file line (a WARNING: the run config's fp32 wins) reaches the console
    of rank 0, not of rank 1."""
    out = {}
    for rank in ("0", "1"):
        env = {**job_env(), "ACCELERATE_MIXED_PRECISION": "bf16", "RANK": rank}
        proc = subprocess.run([sys.executable, "-m", "pipelines.pretrain", CONFIG, "data.corpus=", "train.max_steps=1",
                               f"train.run_dir={tmp_path}/r{rank}"], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=300)
        out[rank] = proc.stderr
    assert ("WARNING pipelines.engine.distributed: accelerate config file: mixed_precision gives train.precision='bf16', "
            "but the run config sets train.precision='fp32'") in out["0"]
    assert "accelerate config file" not in out["1"]


@pytest.mark.slow
def test_accelerate_launch_config_file_precision_reaches_the_run(bert_corpus, tmp_path):
    """A real `accelerate launch --config_file F` whose file says mixed_precision: bf16 and ZeRO stage 1:
    the run config does not set them, so the run trains with them and saves them in config.yaml."""
    acc = tmp_path / "acc.yaml"
    acc.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED",
                                   "deepspeed_config": {"zero_stage": 1}, "mixed_precision": "bf16", "num_machines": 1,
                                   "num_processes": 1, "machine_rank": 0, "use_cpu": False, "rdzv_backend": "static",
                                   "same_network": True}))
    run = tmp_path / "run.yaml"
    tiny = {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64}
    run.write_text(yaml.safe_dump({
        "data": {"corpus": str(bert_corpus), "micro_batch_size": 4, "num_workers": 0},
        "model": {"name": "bert-tiny", "overrides": tiny},
        "train": {"task": "mlm_nsp", "max_steps": 2, "run_dir": str(tmp_path / "run"), "resume": "never"},
        "distributed": {"engine": "deepspeed"}, "logging": {"progress": False, "tensorboard": False},
    }))
    code = ("import sys; from pipelines.engine.launcher import launch; "
            f"sys.exit(launch({str(run)!r}, [], 2, accelerate_config={str(acc)!r}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=job_env(), capture_output=True, text=True,
                          timeout=600)
    summary = summary_of(proc)
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["train"]["precision"] == "bf16" and saved["distributed"]["zero_stage"] == 1
    state = json.loads((Path(summary["checkpoint"]) / "trainer_state.json").read_text())
    assert state["precision"] == "bf16" and state["zero_stage"] == 1
    assert "mixed_precision applied as train.precision='bf16'" in proc.stderr


@pytest.mark.slow
def test_pretrain_finetune_under_the_real_deepspeed_launcher_reaches_our_config_check(tmp_path):
    """`pretrain finetune --launcher deepspeed --nproc 2`: every rank gets `--local_rank=N` and must get
    past argument parsing to our own config check (here: a bad value the CLI's check cannot see)."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 5}))  # 5 != micro 32 x accum 1 x world 2: a per-rank refusal
    code = ("import sys; from pipelines.engine.launcher import launch; "
            f"sys.exit(launch({str(REPO / 'configs/finetune/classification.yaml')!r}, "
            f"['distributed.engine=deepspeed', 'distributed.zero_stage=2', 'distributed.deepspeed_config={ds}'], 2, "
            "launcher='deepspeed', module='pipelines.finetune'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=job_env(), capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "unrecognized arguments" not in out
    assert "train_batch_size=5 != micro_batch_size 32 x grad_accum_steps 1 x world size 2" in out


def test_the_launching_process_starts_a_two_rank_job_without_importing_torch(tmp_path):
    """``pretrain train --nproc 2`` (and every job the tests start) only builds a command line and relays
    output and signals: importing torch there cost a second or more per job, for nothing. A real
    ``accelerate launch`` of two ranks of a probe module; the launching process must end without torch."""
    (tmp_path / "probe_rank.py").write_text("import os, sys\nprint('RANK', os.environ['RANK'], sys.argv[1:])\n")
    code = ("import json, sys; from pipelines.engine.launcher import launch; "
            f"code = launch({CONFIG!r}, ['train.max_steps=1'], 2, module='probe_rank'); "
            "print('PARENT', json.dumps({'code': code, 'torch': 'torch' in sys.modules}))")
    env = {**job_env(), "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    lines = proc.stdout.splitlines()
    parent = json.loads(next(line for line in lines if line.startswith("PARENT "))[len("PARENT "):])
    assert parent == {"code": 0, "torch": False}, proc.stderr[-3000:]
    assert sorted(line.split()[1] for line in lines if line.startswith("RANK ")) == ["0", "1"]
    assert f"RANK 0 [{CONFIG!r}, 'train.max_steps=1']" in lines


def test_a_rendezvous_port_is_free_and_outside_the_range_outgoing_connections_take():
    """``free_port`` (every local MASTER_PORT): a port below the kernel's ephemeral range, which no outgoing
    connection can grab between the check and the store's bind (the EADDRINUSE a Ray cluster beside a run
    caused), bindable, and drawn without touching the seeded ``random`` stream a run's data order uses."""
    import random
    import socket

    from pipelines.engine.launcher import _ephemeral_low, free_port

    random.seed(0)
    expected = random.random()
    random.seed(0)
    ports = {free_port() for _ in range(8)}
    assert random.random() == expected
    assert all(1024 <= p < _ephemeral_low() for p in ports) and len(ports) > 1
    with socket.socket() as server:
        server.bind(("127.0.0.1", ports.pop()))
        server.listen()


@pytest.mark.slow
def test_sigterm_to_a_multi_process_train_stops_every_rank_with_a_checkpoint(bert_corpus, tmp_path):
    """`kill PID` of `pretrain train --nproc 2` reaches only that process: it must pass the signal on, so the
    ranks checkpoint and exit (they used to train on, orphaned, while the command had died at once)."""
    import signal
    import time

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "pipelines.cli", "train", CONFIG, f"data.corpus={bert_corpus}", "train.max_steps=100000",
           "train.eval_every=0", "train.log_every=1", f"train.run_dir={run_dir}", "--nproc", "2"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and '"split": "train"' in metrics.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    time.sleep(1)
    assert job_processes(str(run_dir)) == [], "ranks outlived the command"
    assert proc.returncode == 128 + signal.SIGTERM, (out[-2000:], err[-4000:])
    stop = [json.loads(line) for line in metrics.read_text().splitlines() if '"event": "stop"' in line]
    assert stop and stop[-1]["reason"] == "signal"
    step = max(json.loads(line)["step"] for line in metrics.read_text().splitlines())
    assert (run_dir / "checkpoints" / f"step-{step:08d}" / "trainer_state.json").is_file()
    assert "Traceback" not in err and "SignalException" not in err, err[-4000:]
