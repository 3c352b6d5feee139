"""Host syncs per training step: a step that is not a log step waits for nothing of its own.

On a GPU every read of a tensor's value (``.item()``, ``float()``, ``.tolist()``, ``.cpu()``) and every
collective makes the host wait for the device, so the host cannot queue the next step's work while
the device runs this one. A real run of ``python -m pipelines.pretrain`` (``sync_trace_job.py``)
counts the calls our code makes per step. Between log steps the trainer reads a step's values -- the
agreement (``Trainer._agreement``: loss, tokens, stop flags) and, with the fused optimizer, the
gradient norm -- one step late, through ``HostCopy`` (``pipelines/engine/host_reads.py``): those
reads appear in the *next* step and wait only for the step before it, long done on the device. What
remains of a step's own reads is the engine's gradient-norm read where the update still waits for it
(torch's default Adam; DeepSpeed's overflow check). Calls torch or DeepSpeed make inside their own code
are theirs (DeepSpeed's overflow check, torch's CPU optimizer step counters) and are not held against
us here -- except a device-wide wait (``synchronize``, ``empty_cache``), which no read count sees on the CPU
(DeepSpeed's throughput timer made one at every forward and step until its config turned the timer off):
none may run in a non-log step, ours or a library's. Periodic work (log, skew, eval, checkpoint steps) is
outside the hot path.

Below Python, the trace also counts the operators whose result the host must wait for (``nonzero``, a
boolean-mask index, ``masked_select``, a scalar read in C++): a sync that no Python read shows, as BERT's
MLM head had (``hidden[labels != -100]``). The GPU recipes' three models -- GPT, BERT (MLM + NSP) and
ViT -- are traced as their recipes run them, DeepSpeed ZeRO-2 with the fused AdamW.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from job_helpers import REPO, job_env

from pipelines.engine.distributed import free_port

JOB = Path(__file__).with_name("sync_trace_job.py")
STEPS, LOG_EVERY = 7, 3
LATE = "Tensor.tolist @ pipelines/engine/host_reads.py:tolist"  # a value of the step before, read one step late
ENGINE_NORM = "Tensor.__float__ @ pipelines/engine/engines.py:step"
OWN_READS = {  # what a non-log step reads of its own (world of 1; 2 ranks add the agreement's all_reduce)
    "ddp": {ENGINE_NORM: 1},  # torch's default Adam: the update waits for the norm
    "ddp_fused": {},  # optim.kernel=fused: the skip is decided on the device, the norm read a step late
    # the norm is read before the update, where DeepSpeed's overflow check waits for the device anyway
    # (pipelines/engine/zero_step.py), and the engine's step after the update reads nothing
    "deepspeed": {"Tensor.__float__ @ pipelines/engine/zero_step.py:scaled_global_norm": 1},
    "deepspeed_fused": {},  # optim.kernel=fused: the ZeRO step's skip is decided on the device too
    "deepspeed_stock": {ENGINE_NORM: 1},
}
LATE_READS = {"ddp": {LATE: 1}, "ddp_fused": {LATE: 2}, "deepspeed": {LATE: 1}, "deepspeed_fused": {LATE: 2},
              "deepspeed_stock": {LATE: 1}}


def _expected(kind: str, step: int, extra: dict[str, int] | None = None) -> dict[str, int]:
    """A non-log step's reads: its own, plus the previous step's values when that step was not read at once."""
    previous_deferred = step - 1 >= 2 and (step - 1) % LOG_EVERY != 0
    return {**OWN_READS[kind], **(extra or {}), **(LATE_READS[kind] if previous_deferred else {})}


def _traced_run(tmp_path: Path, corpus: Path, engine: str, processes: int, extra: tuple[str, ...] = (),
                config: str = "configs/train/gpt_tiny_cpu.yaml") -> list[dict]:
    overrides = [f"data.corpus={corpus}", f"train.run_dir={tmp_path / 'run'}", f"train.max_steps={STEPS}",
                 f"train.log_every={LOG_EVERY}", f"logging.skew_every={LOG_EVERY}", "train.eval_every=0",
                 "train.eval_batches=1", "train.checkpoint_every=0", "data.num_workers=0", "data.micro_batch_size=4",
                 "train.grad_accum_steps=2", f"distributed.engine={engine}", "logging.tensorboard=false", *extra]
    out = tmp_path / "syncs.json"
    launch = [sys.executable] if processes == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                                                      str(processes), "--master_port", str(free_port())]
    proc = subprocess.run([*launch, str(JOB), str(out), config, *overrides], cwd=REPO,
                          env=job_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return [json.loads(out.with_suffix(f".rank-{r}.json").read_text()) for r in range(processes)]


def _ours(counts: dict[str, int]) -> dict[str, int]:
    return {site: n for site, n in counts.items() if "<library>" not in site}


def _non_log_steps() -> list[str]:
    return [str(s) for s in range(2, STEPS) if s % LOG_EVERY]  # step 1 logs too; the last step ends the run


@pytest.mark.parametrize("kind", ["ddp", "ddp_fused", "deepspeed", "deepspeed_fused"])
def test_one_process_non_log_steps_wait_only_where_the_update_needs_the_norm(kind, gpt_corpus, tmp_path):
    engine, extra = kind.split("_")[0], ("optim.kernel=fused",) if kind.endswith("fused") else ()
    (trace,) = _traced_run(tmp_path, gpt_corpus, engine, processes=1, extra=extra)
    assert any(LATE in trace["steps"].get(step, {}) for step in _non_log_steps())  # some step was read late
    for step in _non_log_steps():
        assert _ours(trace["steps"].get(step, {})) == _expected(kind, int(step)), f"step {step}: {trace['steps'][step]}"
        if engine == "deepspeed":  # DeepSpeed's own, on one rank (pipelines.engine.one_rank): no collective, and of
            # its reads only the overflow decision on the norm (torch's Adam reads its CPU step counters: no sync),
            # which the fused optimizer takes on the device
            library = {site: n for site, n in trace["steps"].get(step, {}).items() if "<library>" in site}
            assert not [site for site in library if site.startswith(("dist.", "device."))], library
            overflow_reads = library.get("Tensor.__bool__ @ <library> via pipelines/engine/engines.py:backward", 0)
            assert overflow_reads == (0 if kind.endswith("fused") else 1), library
    # the log steps read more (that is where the metrics are reduced), and the trace sees them
    assert set(trace["steps"]) >= {str(s) for s in range(1, STEPS + 1) if s == 1 or s % LOG_EVERY == 0 or s == STEPS}


@pytest.mark.parametrize("recipe", ["bert", "vit"])
def test_bert_and_vit_steps_under_zero2_wait_for_nothing(recipe, bert_corpus, image_corpus, tmp_path):
    """The shipped GPU recipes' other two models: between log steps the ZeRO-2 step with the fused AdamW reads
    nothing of its own, and neither the model, the objective nor DeepSpeed runs an operator that waits for the
    device (the MLM head gathers its rows by the loader's ``masked_positions``; the ViT input is cropped and
    normalised without a data-dependent shape)."""
    corpus, config = (bert_corpus, "bert_tiny_cpu") if recipe == "bert" else (image_corpus, "vit_tiny_cpu")
    (trace,) = _traced_run(tmp_path, corpus, "deepspeed", processes=1, extra=("optim.kernel=fused",),
                           config=f"configs/train/{config}.yaml")
    assert any(LATE in trace["steps"].get(step, {}) for step in _non_log_steps())
    for step in _non_log_steps():
        reads = trace["steps"].get(step, {})
        assert _ours(reads) == _expected("deepspeed_fused", int(step)), f"step {step}: {reads}"
        assert not [site for site in reads if site.startswith(("aten.", "device."))], f"step {step}: {reads}"


def test_the_trace_sees_a_boolean_mask_in_the_forward(tmp_path):
    """What the trace would have caught: BERT's MLM head selecting its rows with ``labels != -100`` (the path
    without ``masked_positions``) runs ``aten.index`` on a boolean mask in ``models/bert.py``; the loader's
    positions run none."""
    import torch

    import models

    sys.path.insert(0, str(JOB.parent))
    import sync_trace_job as trace

    model = models.create("bert-tiny", vocab_size=64)
    ids = torch.randint(5, 64, (2, 16))
    labels = torch.full_like(ids, -100)
    labels[:, 3] = ids[:, 3]
    positions = torch.nonzero(labels.reshape(-1) != -100).reshape(-1)  # the loader's, made before the trace
    trace.counts.clear()
    trace.state["step"] = 1
    try:
        with trace.DataDependentOps():
            model(input_ids=ids, labels=labels, masked_positions=positions)
            gathered = dict(trace.counts.get(1, {}))
            model(input_ids=ids, labels=labels)
            masked = dict(trace.counts.get(1, {}))
    finally:
        trace.state["step"] = 0
    assert gathered == {}, gathered
    assert masked == {"aten.index.Tensor @ models/bert.py:forward": 2}, masked


def test_stock_deepspeed_on_request_makes_its_own_collectives(gpt_corpus, tmp_path):
    """``distributed.one_rank_fast_path=false`` runs stock DeepSpeed (the escape hatch, and the GPU check's
    before row): its collectives over the world of one are back on every step."""
    (trace,) = _traced_run(tmp_path, gpt_corpus, "deepspeed", processes=1, extra=("distributed.one_rank_fast_path=false",))
    for step in _non_log_steps():
        assert _ours(trace["steps"].get(step, {})) == _expected("deepspeed_stock", int(step)), f"step {step}: {trace['steps'][step]}"
        assert [site for site in trace["steps"].get(step, {}) if site.startswith("dist.") and "<library>" in site], trace["steps"].get(step, {})


DEEPSPEED_READS = "Tensor.__bool__ @ <library> via pipelines/engine/engines.py:backward"  # is_invalid_grad_norm


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["deepspeed", "deepspeed_fused", "deepspeed_stock", "ddp_fused"])
def test_two_ranks_wait_where_one_rank_waits(kind, gpt_corpus, tmp_path):
    """2 ranks: the ZeRO step reads what it reads on one (``zero_step``, any number of ranks) -- the norm once
    before the update with torch's default AdamW, nothing with the fused one -- and DeepSpeed's own reads of the
    norm's validity are gone but the one that decides the update. The only collective of ours is the agreement.
    ``distributed.zero_step_on_device=false`` runs DeepSpeed's own step: its reads (one in the step, one per
    parameter group in the clip) and our read of the norm after the update come back. DDP with the fused AdamW
    (its reduction is DDP's own, in C++) reads nothing either."""
    agreement = {"dist.all_reduce @ pipelines/engine/engines.py:all_reduce": 1}
    extra = {"deepspeed": (), "deepspeed_fused": ("optim.kernel=fused",), "ddp_fused": ("optim.kernel=fused",),
             "deepspeed_stock": ("distributed.zero_step_on_device=false",)}[kind]
    library_reads = {"deepspeed": {DEEPSPEED_READS: 1}, "deepspeed_stock": {DEEPSPEED_READS: 3}}.get(kind, {})
    for trace in _traced_run(tmp_path, gpt_corpus, kind.split("_")[0], processes=2, extra=extra):
        for step in _non_log_steps():
            reads = trace["steps"].get(step, {})
            assert _ours(reads) == _expected(kind, int(step), agreement), f"step {step}: {reads}"
            library = {site: n for site, n in reads.items() if site.startswith("Tensor.") and "<library>" in site}
            if not kind.endswith("fused"):  # torch's default Adam reads its step counters: CPU tensors, no device wait
                library.pop("Tensor.item @ <library> via pipelines/engine/engines.py:backward", None)
            assert library == library_reads, f"step {step}: {reads}"
