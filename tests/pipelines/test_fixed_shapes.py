"""``data.fixed_shapes``: every BERT batch in one shape, the same loss, one compiled graph (issue #30).

Batches of the ``bert_pairs`` task are as long as their longest pair (rounded up to 8) and carry as many
masked rows as the masking drew, so a compiled model first recompiles and then runs a dynamic-shape graph.
With ``fixed_shapes`` each batch is padded to the corpus's seq_len and its masked rows to
ceil(seq_len x p) per sequence; these tests check that the shapes are fixed, that the loss, gradients and
evaluation sums are those of the unpadded batch, and that a compiled model compiles once.
"""

from __future__ import annotations

import math

import corpus_fixtures as cf
import numpy as np
import pytest
import torch
from job_helpers import run_pretrain, summary_of

import models
from core.config import load_config
from core.corpus import load_manifest
from pipelines.engine import objectives as tasks
from pipelines.engine.config import RunConfig
from pipelines.engine.model_build import compile_kwargs
from pipelines.loading import loader as data

SEQ_LEN, ROWS = 32, 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return load_manifest(cf.make_bert_corpus(tmp_path_factory.mktemp("fixed") / "c", train_sizes=(24,), val_sizes=(8,),
                                             seq_len=SEQ_LEN))


def _batches(manifest, fixed: bool) -> list[dict]:
    task = tasks.MLMNSPTask(manifest, seed=0, fixed_shapes=fixed)
    samples = [data.decode_sample("bert_pairs", k, p) for _, k, p in data.read_samples(manifest, manifest.shards("train"), 0, 24)]
    return [task.collate(samples[i:i + ROWS], epoch=0, train=True) for i in range(0, len(samples), ROWS)]


def _model(manifest):
    torch.manual_seed(0)
    return models.create("bert-tiny", vocab_size=manifest.vocab_size, hidden_dropout=0.0, attention_dropout=0.0)


def test_fixed_shapes_pad_every_batch_to_one_shape(corpus):
    dynamic, fixed = _batches(corpus, False), _batches(corpus, True)
    assert len({b["input_ids"].shape for b in dynamic}) > 1  # what the option removes
    slots = ROWS * math.ceil(SEQ_LEN * 0.15)
    for d, f in zip(dynamic, fixed, strict=True):
        assert f["input_ids"].shape == (ROWS, SEQ_LEN) and f["masked_positions"].shape == (slots,)
        n = len(d["masked_positions"])
        assert n < slots
        rows_d = d["labels"].reshape(-1)[d["masked_positions"]]
        rows_f = f["labels"].reshape(-1)[f["masked_positions"]]
        assert torch.equal(rows_f[:n], rows_d) and bool((rows_f[n:] == -100).all())  # padding rows are never scored
        length = d["input_ids"].shape[1]
        assert torch.equal(f["input_ids"][:, :length], d["input_ids"]) and bool((f["attention_mask"][:, length:] == 0).all())


def test_more_masked_rows_than_slots_round_up_to_a_multiple_of_them(corpus):
    task = tasks.MLMNSPTask(corpus, seed=0, fixed_shapes=True)
    labels = np.full(2 * SEQ_LEN, -100)
    labels[1:14] = 7  # 13 masked rows; 2 sequences x 5 slots = 10
    positions = task._masked_positions(labels, rows=2).numpy()
    assert len(positions) == 20 and list(positions[:13]) == list(range(1, 14)) and (labels[positions[13:]] == -100).all()


def test_fixed_shapes_keep_the_loss_gradients_and_eval_sums(corpus):
    task_d = tasks.MLMNSPTask(corpus, seed=0)
    task_f = tasks.MLMNSPTask(corpus, seed=0, fixed_shapes=True)
    model = _model(corpus)
    for d, f in list(zip(_batches(corpus, False), _batches(corpus, True), strict=True))[:3]:
        results = []
        for task, batch in ((task_d, d), (task_f, f)):
            model.zero_grad(set_to_none=True)
            out = model(**task.model_inputs(batch))
            out["loss"].backward()
            results.append((out, task.eval_sums({k: v.detach() for k, v in out.items()}, batch), [p.grad.clone() for p in model.parameters()]))
        (out_d, sums_d, grads_d), (out_f, sums_f, grads_f) = results
        torch.testing.assert_close(out_f["loss"], out_d["loss"], rtol=1e-6, atol=1e-6)
        for a, b in zip(grads_f, grads_d, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert sums_f["mlm_count"] == sums_d["mlm_count"] and sums_f["mlm_correct"] == sums_d["mlm_correct"]
        assert sums_f["nsp_correct"] == sums_d["nsp_correct"]
        assert sums_f["mlm_loss_sum"] == pytest.approx(sums_d["mlm_loss_sum"], rel=1e-6)


@pytest.mark.parametrize("fixed", [True, False])
def test_a_compiled_bert_compiles_once_with_fixed_shapes(corpus, fixed):
    """As the engines compile it (``compile_kwargs``): one static graph for every batch with the option, a
    recompile without it (the batches differ in length and in masked rows)."""
    from torch._dynamo.utils import counters

    cfg = load_config(None, [f"data.fixed_shapes={str(fixed).lower()}"], cls=RunConfig)
    task = tasks.MLMNSPTask(corpus, seed=0, fixed_shapes=fixed)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_model(corpus), **compile_kwargs(cfg))
    with torch.no_grad():
        for batch in _batches(corpus, fixed)[:4]:
            compiled(**task.model_inputs(batch))
    assert (counters["stats"]["unique_graphs"] == 1) is fixed, dict(counters["stats"])


def test_a_bert_run_with_fixed_shapes_trains_and_evaluates(corpus, tmp_path):
    """``pretrain`` with the option, evaluation included: the padded rows are not counted."""
    run = tmp_path / "run"
    proc = run_pretrain("configs/train/bert_tiny_cpu.yaml", [f"data.corpus={corpus.root}", f"train.run_dir={run}",
                        "data.fixed_shapes=true", "train.max_steps=6", "train.eval_every=3", "train.eval_batches=2",
                        "data.micro_batch_size=4", "data.num_workers=0", "train.checkpoint_every=0"],
                        processes=1, launcher="python")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = summary_of(proc)
    assert summary["steps"] == 6 and 0.0 <= summary["eval"]["mlm_accuracy"] <= 1.0
