"""The activation bytes ``pretrain plan`` counts (pipelines/ops/model_shapes.py) against what autograd really keeps:
saved tensors of eager and compiled forwards, all-bf16 and under DDP's autocast, and the peak RSS of compiled steps.
The product path is torch-free; these tests import torch to check it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.ops.model_shapes import activation_bytes, loss_backward_bytes, model_shape

REPO = Path(__file__).resolve().parents[2]

_TINY = {"num_layers": 4, "hidden_size": 256, "num_heads": 4, "intermediate_size": 1024, "vocab_size": 1000,
         "attention_dropout": 0.0}  # SDPA's flash kernel on CPU (no attention dropout there)


def _saved_bytes(model, **inputs) -> int:
    """Distinct storages autograd saves for backward in one forward, + the logits the output holds (no parameters)."""
    import torch

    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**inputs)
    for p in model.parameters():
        seen.pop(p.untyped_storage().data_ptr(), None)
    for key in ("logits", "masked_prediction_logits"):
        if key in out:
            seen[out[key].untyped_storage().data_ptr()] = out[key].untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_bytes_are_what_autograd_saves(checkpointing):
    """Within 2 %: the attention matrix we do not count (flash) would be +10 %, a dropped term several %."""
    import torch

    import models

    torch.manual_seed(0)
    model = models.create("gpt-tiny", **_TINY).train()
    model.set_activation_checkpointing(checkpointing)
    x = torch.randint(0, 1000, (4, 128))
    got = _saved_bytes(model, input_ids=x, labels=x)
    # on CPU dropout keeps its mask in the activation dtype (CUDA: bool)
    want = activation_bytes(model_shape("gpt-tiny", _TINY), micro_batch=4, seq_len=128, act_bytes=4, mask_bytes=4,
                            checkpointing=checkpointing)["total"]
    assert got == pytest.approx(want, rel=0.02)


def test_activation_bytes_for_bert_and_vit():
    import torch

    import models

    torch.manual_seed(0)
    bert = {**_TINY, "num_layers": 2}
    x = torch.randint(5, 1000, (4, 128))
    labels = torch.full_like(x, -100)
    masked = torch.rand(x.shape) < 0.15
    labels[masked] = x[masked]
    got = _saved_bytes(models.create("bert-tiny", **bert).train(), input_ids=x, labels=labels,
                       next_sentence_label=torch.zeros(4, dtype=torch.long))
    want = activation_bytes(model_shape("bert-tiny", bert), micro_batch=4, seq_len=128, act_bytes=4, mask_bytes=4,
                            checkpointing=False, mlm_fraction=masked.float().mean().item())["total"]
    assert got == pytest.approx(want, rel=0.03)
    vit = {"num_layers": 2, "image_size": 64, "num_labels": 10}
    got = _saved_bytes(models.create("vit-tiny", **vit).train(), pixel_values=torch.randn(4, 3, 64, 64),
                       labels=torch.zeros(4, dtype=torch.long))
    want = activation_bytes(model_shape("vit-tiny", vit), micro_batch=4, seq_len=0, act_bytes=4, mask_bytes=4,
                            checkpointing=False)["total"]
    assert got == pytest.approx(want, rel=0.02)


def _saved_under(model, autocast: bool, **inputs) -> int:
    """``_saved_bytes`` of a forward under CPU bf16 autocast (the DDP engine's mixed precision) or without."""
    import torch

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return _saved_bytes(model, **inputs)


@pytest.mark.parametrize("name,checkpointing", [("gpt-tiny", False), ("bert-tiny", False), ("gpt-tiny", True)])
def test_autocast_keeps_the_residual_stream_in_fp32_and_the_weights_cast(name, checkpointing):
    """DDP's bf16 is autocast over fp32 weights: against the same model run all in bf16 (DeepSpeed's), every
    LayerNorm input is fp32 and every matmul keeps its weight's bf16 cast -- what the H100's ViT DDP row showed
    (0.9 GiB over the all-bf16 count, docs/benchmarks.md gpu_check). Pre-LN (GPT) and post-LN (BERT); with
    checkpointing each block keeps only its fp32 input, and its weights are cast again when it is recomputed."""
    import torch

    import models

    shape = {**_TINY, "hidden_dropout": 0.0}  # dropout masks take the dtype of what they drop on the CPU
    torch.manual_seed(0)
    x = torch.randint(5, 1000, (4, 128))
    inputs = {"input_ids": x, "labels": x}
    if name.startswith("bert"):
        labels = torch.full_like(x, -100)
        labels[:, ::7] = x[:, ::7]
        inputs = {"input_ids": x, "labels": labels, "next_sentence_label": torch.zeros(4, dtype=torch.long)}
    fp32_weights = models.create(name, **shape).train()
    bf16_weights = models.create(name, **shape).to(torch.bfloat16).train()
    for model in (fp32_weights, bf16_weights):
        model.set_activation_checkpointing(checkpointing)
    got = _saved_under(fp32_weights, True, **inputs) - _saved_under(bf16_weights, False, **inputs)
    kwargs = dict(micro_batch=4, seq_len=128, act_bytes=2, checkpointing=checkpointing, mlm_fraction=1 / 7)
    m = model_shape(name, shape)
    want = activation_bytes(m, autocast=True, **kwargs)["total"] - activation_bytes(m, **kwargs)["total"]
    assert want > 0 and got == pytest.approx(want, rel=0.05)


_COMPILED_GPT = {**_TINY, "num_layers": 2, "vocab_size": 8192, "hidden_dropout": 0.0}  # the GPU recipes: no dropout


@pytest.mark.slow  # compiles: 6-15 s
@pytest.mark.parametrize("train_logits", [False, True])
def test_a_compiled_lm_head_keeps_its_logits_not_the_log_softmax(train_logits):
    """What the GPU recipes run (bf16, torch.compile): the loss keeps the logits and their log-sum-exp and
    recomputes the softmax in backward, 2 B a logit; eager keeps the fp32 log-softmax, 4 B (+ the returned
    logits). Blocks keep the same bytes either way. Both within 2 % of ``activation_bytes``; GPT-2 small at
    16 x 1024 keeps 3.3 GB less compiled (1.6 GB of logits against 4.9 GB)."""
    import torch

    import models

    torch.manual_seed(0)
    overrides = {**_COMPILED_GPT, "train_logits": train_logits}
    model = models.create("gpt-tiny", **overrides).train().to(torch.bfloat16)  # bf16 weights: no autocast casts kept
    x = torch.randint(0, 8192, (4, 128))
    shape = model_shape("gpt-tiny", overrides)
    compiled = torch.compile(model)
    compiled(input_ids=x, labels=x)["loss"].backward()
    for name, run, is_compiled in (("eager", model, False), ("compiled", compiled, True)):
        got = _saved_bytes(run, input_ids=x, labels=x)
        want = activation_bytes(shape, micro_batch=4, seq_len=128, act_bytes=2, checkpointing=False,
                                compiled=is_compiled)["total"]
        assert got == pytest.approx(want, rel=0.02), name


_PEAK_COMPILED_RUN = """
import json, sys, torch, models
torch.set_num_threads(1); torch.manual_seed(0)
overrides, B, T = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
x = torch.randint(0, overrides["vocab_size"], (B, T))
model = torch.compile(models.create("gpt-tiny", **overrides).train().to(torch.bfloat16))
for p in model.parameters():
    p.grad = torch.zeros_like(p)  # gradients are no activations: in place before the baseline
model(x, labels=x)["loss"].backward()  # compiles, and loads every kernel's pages
with open("/proc/self/statm") as f:
    base = int(f.read().split()[1]) * 4096
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := RSS now
model(x, labels=x)["loss"].backward()
with open("/proc/self/status") as f:
    peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024
print(peak - base)
"""


_PEAK_B, _PEAK_T = 4, 256


def _peak_overrides(train_logits: bool) -> dict:
    return {**_COMPILED_GPT, "num_layers": 2, "vocab_size": 32768, "max_position_embeddings": _PEAK_T,
            "train_logits": train_logits}


@pytest.fixture(scope="module")
def compiled_peak_runs(request) -> dict:
    """One single-threaded subprocess per selected case, all started at once: each spends ~3 min in bf16 matmuls
    on a VM without bf16 instructions, so on two cores both take about the time of one (229 s against 182 + 182,
    2026-11-30). Peak RSS is per process, so running them side by side changes no figure."""
    selected = {item.callspec.params["train_logits"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_a_compiled_steps_peak_is_within_the_plans_activations"}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    procs = {flag: subprocess.Popen([sys.executable, "-c", _PEAK_COMPILED_RUN, json.dumps(_peak_overrides(flag)),
                                     str(_PEAK_B), str(_PEAK_T)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
             for flag in sorted(selected)}
    yield procs
    for proc in procs.values():
        proc.kill()
        proc.communicate()


@pytest.mark.slow  # a subprocess per case: 10-20 s with bf16 matmul instructions; both cases ~4 min on an AVX2 VM
@pytest.mark.parametrize("train_logits", [False, True])
def test_a_compiled_steps_peak_is_within_the_plans_activations(train_logits, compiled_peak_runs):
    """The peak RSS of a compiled bf16 forward + backward over the RSS before it (weights and gradients in place)
    against what the plan adds for it, the activations and the loss's backward: 0.82-0.90 of it without returned
    logits (inductor reuses the dead logits' buffer for part of their gradient; 0.82 where first measured, 0.90
    on an AVX2 VM without bf16 matmul instructions), 1.00 with (measured 2026-11-28). The eager figures were 2.6x
    these (420 and 488 MB against 124 and 219)."""
    try:
        stdout, stderr = compiled_peak_runs[train_logits].communicate(timeout=900)
    except subprocess.TimeoutExpired:
        pytest.fail("the compiled step did not finish in 900 s")
    assert compiled_peak_runs[train_logits].returncode == 0, stderr
    shape = model_shape("gpt-tiny", _peak_overrides(train_logits))
    B, T = _PEAK_B, _PEAK_T
    planned = (activation_bytes(shape, micro_batch=B, seq_len=T, act_bytes=2, checkpointing=False, compiled=True)["total"]
               + loss_backward_bytes(shape, micro_batch=B, seq_len=T, act_bytes=2, compiled=True))
    assert 0.75 <= int(stdout.split()[-1]) / planned <= 1.03, (int(stdout.split()[-1]), planned)
