"""``python -m pipelines.pretrain``: impossible configs and bad corpora fail with exit code 2 before any
process group starts; checkpoints are found, written atomically and hold weights_only-loadable state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from job_helpers import REPO, job_env

from pipelines.engine import checkpoint as ckpt
from pipelines.pretrain import main

CONFIG = str(REPO / "configs/train/bert_tiny_cpu.yaml")


@pytest.fixture()
def clean_env():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_help_and_bad_key_exit_2_without_traceback():
    help_out = subprocess.run([sys.executable, "-m", "pipelines.pretrain", "--help"], cwd=REPO, env=job_env(),
                              capture_output=True, text=True, timeout=120)
    assert help_out.returncode == 0 and "distributed.zero_stage" in help_out.stdout
    bad = subprocess.run([sys.executable, "-m", "pipelines.pretrain", CONFIG, "train.max_stpes=3"], cwd=REPO, env=job_env(),
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "train.max_steps" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("overrides, message", [
    (["distributed.zero_stage=3", "model.compile=true"], "model.compile=true is not supported with distributed.zero_stage=3"),
    (["train.precision=fp16"], "fp16 needs a GPU"),
    (["distributed.zero_stage=3", "model.overrides={loss_chunk_tokens: 64}"], "loss_chunk_tokens=64 is not supported"),
    (["model.pad_vocab_multiple=0"], "model.pad_vocab_multiple must be >= 1"),
    (["distributed.engine=ddp", "distributed.offload_optimizer=true"], "need engine=deepspeed"),
    (["data.micro_batch_size=500"], "fewer than one global batch"),
    (["train.task=causal_lm", "model.name=gpt-tiny"], "holds a 'bert_pairs' corpus but the task needs 'packed_lm'"),
    (["model.name=gpt-tiny"], "needs a bert model"),
    (["logging.profile_steps=5-2"], "logging.profile_steps='5-2' must be FIRST-LAST"),
    (["train.global_batch_size=-8"], "train.global_batch_size must be >= 0"),
])
def test_impossible_configs_fail_before_any_process_group(bert_corpus, tmp_path, capsys, clean_env, overrides, message):
    code = main([CONFIG, f"data.corpus={bert_corpus}", f"train.run_dir={tmp_path}/run", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert not torch.distributed.is_initialized()


def test_batch_that_does_not_divide_and_corrupt_shard(bert_corpus, tmp_path, capsys, clean_env):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 48, "train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}))
    code = main([CONFIG, f"data.corpus={bert_corpus}", f"train.run_dir={tmp_path}/run", f"distributed.deepspeed_config={ds}"])
    assert code == 2 and "train_batch_size=48 != micro_batch_size 8" in capsys.readouterr().err
    import shutil

    copy = tmp_path / "corpus"
    shutil.copytree(bert_corpus, copy)
    shard = copy / "validation-000000.tar"
    shard.write_bytes(shard.read_bytes()[:-2048])
    code = main([CONFIG, f"data.corpus={copy}", f"train.run_dir={tmp_path}/run"])
    err = capsys.readouterr().err  # the size check (manifest `bytes`) catches a truncation before the sha256
    assert code == 2 and "validation-000000.tar has " in err and "truncated" in err
    assert not torch.distributed.is_initialized()


def test_find_resume_and_rng_state(tmp_path):
    run = tmp_path / "run"
    assert ckpt.find_resume(run, "auto") is None
    for step in (4, 8):
        d = run / "checkpoints" / ckpt.step_dir_name(step)
        d.mkdir(parents=True)
        (d / "trainer_state.json").write_text(json.dumps({"step": step}))
    (run / "checkpoints" / ".tmp-step-00000012").mkdir()  # a crash mid-save
    (run / "checkpoints/latest").write_text("step-00000004\n")
    assert ckpt.find_resume(run, "auto").name == "step-00000004"
    (run / "checkpoints/latest").write_text("step-00000099\n")  # stale pointer: newest complete wins
    assert ckpt.find_resume(run, "auto").name == "step-00000008"
    assert ckpt.find_resume(run, "never") is None
    torch.manual_seed(5)
    state = ckpt.rng_state()
    torch.save(state, tmp_path / "rng.pt")
    a = torch.rand(3)
    ckpt.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert torch.equal(a, torch.rand(3))


def test_a_profiled_run_leaves_the_windows_operator_table(gpt_corpus, tmp_path):
    """``logging.profile_steps``: the run as a user runs it, profiled over steps 2-3 (on a GPU: after compilation);
    the table holds the heaviest operators, the trace every call, the step's host reads
    (``aten::_local_scalar_dense``) included."""
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "pipelines.pretrain", "configs/train/gpt_tiny_cpu.yaml",
                           f"data.corpus={gpt_corpus}", f"train.run_dir={run}", "train.max_steps=4", "train.eval_every=0",
                           "data.eval_split=none", "logging.tensorboard=false", "data.num_workers=0",
                           "logging.profile_steps=2-3"], cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    table = (run / "profile/rank-00000.txt").read_text()
    assert "optimizer steps 2-3 of the window 2-3 (2 steps)" in table
    assert "aten::mm" in table or "aten::addmm" in table
    events = {e.get("name") for e in json.loads((run / "profile/rank-00000.trace.json").read_text())["traceEvents"]}
    assert "aten::_local_scalar_dense" in events and "aten::scaled_dot_product_attention" in events


def test_a_global_batch_is_split_for_the_job_said_once_and_saved(gpt_corpus, tmp_path):
    """``train.global_batch_size`` (the GPU recipes'): the run takes it in micro-batches of at most
    data.micro_batch_size with the rest accumulated, says so, saves the split in config.yaml, and neither
    accelerate nor DeepSpeed complains about the accumulation."""
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "pipelines.pretrain", "configs/train/gpt_tiny_cpu.yaml",
                           f"data.corpus={gpt_corpus}", f"train.run_dir={run}", "train.max_steps=2", "train.eval_every=0",
                           "data.eval_split=none", "logging.tensorboard=false", "data.num_workers=0",
                           "train.global_batch_size=12", "data.micro_batch_size=5"],
                          cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stderr.count("train.global_batch_size 12 on 1 rank(s): data.micro_batch_size 4 x "
                             "train.grad_accum_steps 3 per rank") == 1, proc.stderr[-3000:]
    assert "mismatch" not in proc.stdout + proc.stderr
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert (saved["data"]["micro_batch_size"], saved["train"]["grad_accum_steps"], saved["train"]["global_batch_size"]) == (4, 3, 12)


def test_a_vit_of_other_channels_is_refused_before_training(image_corpus, tmp_path, capsys, clean_env):
    """The loader gives RGB whatever the corpus stores (grey expanded): a 1-channel patch conv would fail at step 1."""
    code = main(["configs/train/vit_tiny_cpu.yaml", f"data.corpus={image_corpus}", f"train.run_dir={tmp_path}/run",
                 "model.overrides={num_channels: 1}", "train.max_steps=1"])
    err = capsys.readouterr().err
    assert code == 2 and "model.overrides.num_channels=1 disagrees with the data (3" in err, err
    assert "Traceback" not in err and not (tmp_path / "run" / "checkpoints").exists()


_EXIT_PROBE = """import atexit, gc, sys
atexit.register(lambda: sys.stderr.write(f"FROZEN {gc.get_freeze_count()}\\n"))
"""


@pytest.mark.parametrize("command", [
    ["-m", "pipelines.pretrain", CONFIG, "train.max_stpes=3"],
    ["-m", "pipelines.finetune", str(REPO / "configs/finetune/classification.yaml"), "epochz=1"],
    ["pretrain", "train", CONFIG, "train.max_stpes=3"],
], ids=["rank", "finetune-rank", "pretrain-command"])
def test_every_entry_point_freezes_its_objects_before_it_exits(command, tmp_path):
    """Each process a job starts ends with ``core.shutdown.before_exit`` (shutdown's collection over torch's
    objects took 1.5-2 s a process); a ``sitecustomize`` reads the freeze from the process's own exit hooks.
    ``pretrain`` is the installed command, so the pyproject script is what is checked."""
    (tmp_path / "sitecustomize.py").write_text(_EXIT_PROBE)
    argv = [sys.executable, *command] if command[0] == "-m" else [str(Path(sys.executable).parent / command[0]), *command[1:]]
    env = {**job_env(), "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    frozen = [int(line.split()[1]) for line in proc.stderr.splitlines() if line.startswith("FROZEN ")]
    assert frozen and frozen[0] > 10_000, proc.stderr[-2000:]


def test_before_exit_finalizes_garbage_cycles_and_keeps_the_rest_reachable(tmp_path):
    """The one collection before the freeze runs the finalizers of cycles that are garbage already, as
    shutdown would have; what is frozen is only what is still reachable."""
    out = tmp_path / "finalized.txt"
    code = f"""import gc, json
from core.shutdown import before_exit
gc.disable()  # no automatic collection: only before_exit's may find the cycle
class Node:
    def __del__(self):
        with open({str(out)!r}, "a") as f:
            f.write("finalized ")
a, b = Node(), Node()
a.other, b.other = b, a
del a, b
kept = [Node() for _ in range(3)]
before_exit()
print(json.dumps({{"content": open({str(out)!r}).read(), "frozen": gc.get_freeze_count(), "garbage": len(gc.garbage)}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["content"] == "finalized finalized " and got["garbage"] == 0 and got["frozen"] > 0
