"""Exact resume with real 2-process DeepSpeed jobs (gloo on CPU) and 2 loader workers per rank.

A reference run and an interrupted+resumed run must consume the same sample keys in the same order
on every rank and produce bitwise-identical per-rank losses at every step (CPU, fp32, deterministic).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from job_helpers import REPO, job_env, read_trace, run_pretrain, summary_of, traced

pytestmark = pytest.mark.slow

CONFIG = "configs/train/bert_tiny_cpu.yaml"


def _overrides(corpus: Path, run_dir: Path, stage: int, steps: int, every: int) -> list[str]:
    return [
        f"data.corpus={corpus}", f"train.run_dir={run_dir}", f"train.max_steps={steps}", f"train.checkpoint_every={every}",
        f"distributed.zero_stage={stage}", "data.micro_batch_size=4", "data.num_workers=2", "data.shuffle_buffer=16",
        "train.deterministic=true", "train.eval_every=0", "train.eval_batches=2", "train.log_every=1", "optim.lr=3e-3",
        "schedule.warmup_steps=3",
    ]


def _assert_same(ref_dir: Path, got_dir: Path, steps: int) -> None:
    for rank in (0, 1):
        ref, got = read_trace(ref_dir, rank), read_trace(got_dir, rank)
        assert sorted(ref) == sorted(got) == list(range(1, steps + 1)), f"rank {rank}: steps differ"
        for step in ref:
            assert got[step]["keys"] == ref[step]["keys"], f"rank {rank} step {step}: different samples"
            assert got[step]["loss"] == ref[step]["loss"], f"rank {rank} step {step}: {got[step]['loss']!r} != {ref[step]['loss']!r}"


def _launch_background(config: str, overrides: list[str], trace: Path) -> subprocess.Popen:
    code = f"import sys; from pipelines.engine.launcher import launch; sys.exit(launch({config!r}, {traced(overrides, trace)!r}, 2))"
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=job_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for_step(trace: Path, rank: int, step: int, proc: subprocess.Popen, timeout: float = 240) -> int:
    """Return the pid of ``rank`` once it has logged ``step``."""
    deadline = time.time() + timeout
    path = trace / f"rank-{rank}.jsonl"
    while time.time() < deadline:
        assert proc.poll() is None, f"job ended before step {step}:\n{proc.stdout.read()[-4000:]}"
        if path.is_file():
            recs = read_trace(trace, rank)
            if max(recs, default=0) >= step:
                return recs[max(recs)]["pid"]
        time.sleep(0.02)
    raise AssertionError(f"rank {rank} did not reach step {step} in {timeout}s")


def test_exact_resume_after_kill_9_zero2(bert_corpus, tmp_path):
    steps = 14
    # the GPU recipes' padded vocabulary (model.pad_vocab_multiple) must resume as exactly as the plain one
    padded = ["model.pad_vocab_multiple=64"]
    ref = run_pretrain(CONFIG, _overrides(bert_corpus, tmp_path / "ref", 2, steps, 4) + padded, processes=2,
                       trace_dir=tmp_path / "tref")
    summary_of(ref)

    trace = tmp_path / "tcut"
    job = _launch_background(CONFIG, _overrides(bert_corpus, tmp_path / "cut", 2, steps, 4) + padded, trace)
    pid = _wait_for_step(trace, 1, 5, job)
    os.kill(pid, signal.SIGKILL)  # one rank dies mid-run; the launcher tears the job down
    out, _ = job.communicate(timeout=120)
    assert job.returncode != 0, out[-3000:]
    assert (tmp_path / "cut/checkpoints/latest").read_text().strip() in ("step-00000004", "step-00000008")

    resumed = run_pretrain(CONFIG, _overrides(bert_corpus, tmp_path / "cut", 2, steps, 4) + padded, processes=2,
                           trace_dir=trace)
    s = summary_of(resumed)
    assert s["resumed_from"] and s["steps"] == steps
    assert "Resuming from" in resumed.stdout
    _assert_same(tmp_path / "tref", trace, steps)
    assert not list((tmp_path / "cut/checkpoints").glob(".tmp-*"))
    assert len(list((tmp_path / "cut/checkpoints").glob("step-*"))) == 2  # keep_last=2


def test_exact_resume_after_sigusr1_zero3(bert_corpus, tmp_path):
    steps = 10
    ref = run_pretrain(CONFIG, _overrides(bert_corpus, tmp_path / "ref", 3, steps, 0), processes=2, trace_dir=tmp_path / "tref")
    summary_of(ref)

    trace = tmp_path / "tcut"
    job = _launch_background(CONFIG, _overrides(bert_corpus, tmp_path / "cut", 3, steps, 0), trace)
    pid = _wait_for_step(trace, 1, 3, job)
    # SLURM's pre-emption notice reaches every process of a task (its loader workers too), and only
    # this rank's task here: the workers must survive it and all ranks stop at the same step.
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for p in [pid, *map(int, children)]:
        os.kill(p, signal.SIGUSR1)
    out, _ = job.communicate(timeout=180)
    assert job.returncode == 0, out[-4000:]
    cut = summary_of(subprocess.CompletedProcess([], 0, out, ""))
    assert cut["stopped_by"] == "signal" and 3 <= cut["steps"] < steps

    resumed = run_pretrain(CONFIG, _overrides(bert_corpus, tmp_path / "cut", 3, steps, 0), processes=2, trace_dir=trace)
    s = summary_of(resumed)
    assert s["resumed_from"].endswith(f"step-{cut['steps']:08d}") and s["steps"] == steps
    _assert_same(tmp_path / "tref", trace, steps)


_REFERENCES: dict[str, Path] = {}  # one uninterrupted run per engine, shared by both directions
REFERENCE_WORLD = (1, 4, 2)  # (processes, micro batch, accumulation) of the uninterrupted run


def _elastic_overrides(corpus: Path, run_dir: Path, engine: str, steps: int, mb: int, accum: int) -> list[str]:
    stage = {"ddp": [], "zero2": ["distributed.zero_stage=2"], "zero3": ["distributed.zero_stage=3"]}[engine]
    return [f"data.corpus={corpus}", f"train.run_dir={run_dir}", f"train.max_steps={steps}", "train.checkpoint_every=3",
            f"distributed.engine={'ddp' if engine == 'ddp' else 'deepspeed'}", *stage, f"data.micro_batch_size={mb}",
            f"train.grad_accum_steps={accum}" if accum else "train.global_batch_size=8", "data.num_workers=2", "data.shuffle_buffer=16", "train.eval_every=0",
            "train.eval_batches=2", "train.log_every=1", "optim.lr=3e-3", "schedule.warmup_steps=2",
            "schedule.decay=constant",  # constant: the first leg stops at max_steps=3 with the same LRs
            "train.deterministic=true", "model.overrides={hidden_dropout: 0.0, attention_dropout: 0.0}"]


def _world_free(step_dir: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted((step_dir / "engine/world_free").glob("rank-*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("engine", ["ddp", "zero2", "zero3"])
@pytest.mark.parametrize(("first", "then"), [((2, 4, 1), (1, 4, 0)), ((1, 4, 2), (2, 2, 2))],
                         ids=["2-ranks-then-1", "1-rank-then-2"])
def test_resume_on_another_world_size_continues_the_global_sample_sequence(gpt_corpus, tmp_path_factory, tmp_path,
                                                                           engine, first, then):
    """(processes, micro batch, accumulation) before and after the switch, global batch 8 throughout (accumulation
    0: derived from ``train.global_batch_size=8``, as the GPU recipes do: 2 micro-batches of 4 on one rank).
    The samples of every step are the uninterrupted run's, in the same order; without dropout (whose
    draws are per rank) the losses continue it to 1e-4 (not bitwise: the reduction order changes with
    the world size). DDP state is whole on every rank; ZeRO-2/3 partitions are rebuilt from the
    checkpoint's world-size-free copy, and at the switch (the new world re-saves the step it resumed
    from) every fp32 master weight and Adam moment is the same tensor as the old world saved."""
    config = "configs/train/gpt_tiny_cpu.yaml"
    if engine not in _REFERENCES:
        ref_dir = tmp_path_factory.mktemp(f"elastic-ref-{engine}")
        summary_of(run_pretrain(config, _elastic_overrides(gpt_corpus, ref_dir / "run", engine, 6, *REFERENCE_WORLD[1:]),
                                trace_dir=ref_dir / "trace"))
        _REFERENCES[engine] = ref_dir
    ref_dir = _REFERENCES[engine]
    (p0, mb0, a0), (p1, mb1, a1) = first, then
    run = tmp_path / "run"
    if first == REFERENCE_WORLD:  # the first leg is the reference's own steps 1-3: its run, stopped after step 3's save
        shutil.copytree(ref_dir / "run", run)
        shutil.rmtree(run / "checkpoints/step-00000006")
        (run / "checkpoints/latest").write_text("step-00000003\n")
        trace_a = ref_dir / "trace"
    else:
        trace_a = tmp_path / "t-a"
        summary_of(run_pretrain(config, _elastic_overrides(gpt_corpus, run, engine, 3, mb0, a0), processes=p0,
                                trace_dir=trace_a))
    if engine != "ddp":
        before = _world_free(run / "checkpoints/step-00000003")
        switch = summary_of(run_pretrain(config, _elastic_overrides(gpt_corpus, run, engine, 3, mb1, a1), processes=p1))
        assert switch["resumed_from"].endswith("step-00000003") and switch["world_size"] == p1
        after = _world_free(run / "checkpoints/step-00000003")  # written by the new world from what it loaded
        assert sorted(before) == sorted(after) and any(k.startswith("exp_avg_sq/") for k in before)
        assert all(torch.equal(before[k], after[k]) for k in before), [k for k in before if not torch.equal(before[k], after[k])]
    resumed = summary_of(run_pretrain(config, _elastic_overrides(gpt_corpus, run, engine, 6, mb1, a1), processes=p1,
                                      trace_dir=tmp_path / "t-b"))
    assert resumed["resumed_from"].endswith("step-00000003") and resumed["world_size"] == p1

    def global_keys(trace: Path, processes: int) -> dict[int, list[str]]:
        per_rank = [read_trace(trace, r) for r in range(processes)]
        return {step: [k for recs in per_rank for k in recs[step]["keys"]] for step in per_rank[0]}

    ref = global_keys(ref_dir / "trace", 1)
    got = {**global_keys(trace_a, p0), **global_keys(tmp_path / "t-b", p1)}
    assert sorted(got) == list(range(1, 7)) and all(got[s] == ref[s] for s in ref)  # no sample repeated or skipped
    losses = {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if r.get("split") == "train" and "loss" in r}
    ref_losses = {r["step"]: r["loss"] for r in map(json.loads, (ref_dir / "run/metrics.jsonl").read_text().splitlines())
                  if r.get("split") == "train" and "loss" in r}
    assert all(abs(losses[s] - ref_losses[s]) < 1e-4 * ref_losses[s] for s in range(1, 7)), (losses, ref_losses)


@pytest.mark.parametrize("engine", ["deepspeed", "ddp"])
def test_a_run_read_a_step_late_resumes_exactly_with_the_gpu_recipes_optimizer_path(engine, gpt_corpus, tmp_path):
    """The GPU recipes' step on one process -- torch's fused AdamW, its skip decided on the device (DDP, and
    DeepSpeed ZeRO-2's one-rank step), bf16, each step's values read once the next is queued -- stopped at a
    checkpoint and resumed: the losses logged after the resume and the final evaluation are bitwise those of
    a run that never stopped (the checkpoint falls inside the warmup: the LR schedule's position must be exact).
    The LR is constant after warmup, so the stopped run's shorter max_steps changes nothing but where it stops."""
    def overrides(run_dir: Path, steps: int) -> list[str]:
        return [f"data.corpus={gpt_corpus}", f"train.run_dir={run_dir}", f"train.max_steps={steps}", "train.checkpoint_every=4",
                f"distributed.engine={engine}", "distributed.zero_stage=2", "train.precision=bf16", "optim.kernel=fused",
                "optim.grad_clip=0.05", "data.micro_batch_size=4", "data.num_workers=1", "train.deterministic=true",
                "train.eval_every=0", "train.eval_batches=2", "train.log_every=3", "schedule.warmup_steps=6",
                "schedule.decay=constant", "optim.lr=3e-3", "logging.tensorboard=false"]

    def logged(run_dir: Path) -> dict[tuple[int, str], float]:
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {(r["step"], r["split"]): r["loss"] for r in rows if r.get("split") in ("train", "eval") and "loss" in r}

    config = "configs/train/gpt_tiny_cpu.yaml"
    ref_summary = summary_of(run_pretrain(config, overrides(tmp_path / "ref", 8)))
    summary_of(run_pretrain(config, overrides(tmp_path / "cut", 4)))  # its last step, 4, is checkpointed
    resumed = summary_of(run_pretrain(config, overrides(tmp_path / "cut", 8)))
    assert resumed["resumed_from"].endswith("step-00000004") and resumed["steps"] == 8
    assert resumed["tokens"] == ref_summary["tokens"] and resumed["end_loss"] == ref_summary["end_loss"]
    ref, got = logged(tmp_path / "ref"), logged(tmp_path / "cut")
    after = {k: v for k, v in ref.items() if k[0] > 4}
    assert set(after) == {(6, "train"), (8, "eval")}  # steps 5 and 7 were read a step late
    assert {k: got[k] for k in after} == after
