"""Diagnostics against closed forms after one Adam step; histogram counts; injectable getters.

Run this file as a script for the overhead benchmark (no timed assertions in the tests):
    python tests/monitoring/test_diagnostics.py
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from core.optim_math import radam_rectification
from monitoring.diagnostics import collect_diagnostics, gradient_histogram, layer_group
from pipelines.engine.optim import Lamb


def test_layer_group():
    assert layer_group("encoder.layers.0.attn.q.weight") == "encoder.layers.0"
    assert layer_group("module.encoder.layers.11.mlp.fc1.bias") == "encoder.layers.11"
    assert layer_group("_orig_mod.h.3.ln_1.weight") == "h.3"
    assert layer_group("embeddings.word_embeddings.weight") == "embeddings"
    assert layer_group("cls_token") == "_root"


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(4, 3), nn.Linear(3, 2)])


def adam_one_step(lr=0.01):
    model = TwoLayer()
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8)
    torch.manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return model, opt, grads


def test_closed_forms_after_one_adam_step():
    # after t = 1: m^ = g, v^ = g^2, so step size = 1/(|g| + eps) and the direction is g/(|g| + eps)
    lr = 0.01
    model, opt, grads = adam_one_step(lr)
    out = collect_diagnostics(model.named_parameters(), opt, step=1, lr=lr)
    assert out["lr"] == lr
    g_all = torch.cat([g.reshape(-1) for g in grads.values()]).double()
    assert out["grad_norm"] == pytest.approx(float(g_all.norm()), rel=1e-6)
    for i in (0, 1):
        gi = torch.cat([grads[f"layers.{i}.weight"].reshape(-1), grads[f"layers.{i}.bias"]]).double()
        assert out[f"grad_norm/layers.{i}"] == pytest.approx(float(gi.norm()), rel=1e-6)
    size = 1.0 / (g_all.abs() + 1e-8)
    assert out["adam/step_size_mean"] == pytest.approx(float(size.mean()), rel=1e-6)
    assert out["adam/step_size_var"] == pytest.approx(float(size.var(unbiased=False)), rel=1e-5)
    w_all = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    upd = g_all / (g_all.abs() + 1e-8)
    assert out["update_ratio"] == pytest.approx(lr * float(upd.norm() / w_all.norm()), rel=1e-6)
    w0 = torch.cat([model.layers[0].weight.detach().reshape(-1), model.layers[0].bias.detach()]).double()
    assert out["update_ratio/layers.0"] == pytest.approx(lr * math.sqrt(w0.numel()) / float(w0.norm()), rel=1e-6)
    # RAdam statistics at t = 1 with beta2 = 0.999: rho_1 = 1, not rectified, no r_t
    assert out["radam/rho_t"] == pytest.approx(1.0) and out["radam/rectified"] == 0.0 and "radam/r_t" not in out


def test_step_from_state_wins_and_rectified_r_t():
    model, opt, _ = adam_one_step()
    for _ in range(9):
        opt.step()  # same grads, 10 steps in all
    out = collect_diagnostics(model.named_parameters(), opt, step=0, lr=0.01)
    rho, r = radam_rectification(10, 0.999)
    assert out["radam/rho_t"] == pytest.approx(rho) and out["radam/r_t"] == pytest.approx(r)
    assert out["radam/rectified"] == 1.0


def test_injected_getters_are_used():
    model, opt, grads = adam_one_step()
    params = dict(model.named_parameters())
    doubled = collect_diagnostics(params.items(), opt, step=1, lr=0.01, get_grad=lambda p: 2 * p.grad)
    plain = collect_diagnostics(params.items(), opt, step=1, lr=0.01)
    assert doubled["grad_norm"] == pytest.approx(2 * plain["grad_norm"])

    # an injected state: t = 1, m = 0, v = 0.004, so v^ = 0.004 / (1 - 0.999) = 4 and 1/(sqrt(v^) + 0) = 0.5
    def get_state(p):
        return {"step": 1, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.full_like(p, 0.004)}

    out = collect_diagnostics(params.items(), None, step=1, lr=0.01, get_state=get_state, eps=0.0)
    assert out["adam/step_size_mean"] == pytest.approx(0.5) and out["adam/step_size_var"] == pytest.approx(0.0)
    assert out["update_ratio"] == 0.0
    # no optimizer state at all: only lr, grad norms and the RAdam curve of the given step
    bare = collect_diagnostics(params.items(), None, step=20, lr=0.01, get_state=lambda p: None)
    assert "adam/step_size_mean" not in bare and bare["radam/rho_t"] == pytest.approx(radam_rectification(20, 0.999)[0])


def test_lamb_trust_ratios_reported():
    model = TwoLayer()
    opt = Lamb(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    out = collect_diagnostics(model.named_parameters(), opt, step=1, lr=0.01)
    ratios = [float(opt.state[p]["trust_ratio"]) for p in model.parameters()]
    assert out["lamb/trust_ratio_mean"] == pytest.approx(sum(ratios) / 4)
    assert out["lamb/trust_ratio_max"] == max(ratios) and out["lamb/trust_ratio_min"] == min(ratios)


def test_gradient_histogram_counts_and_edges():
    a = nn.Parameter(torch.zeros(2))
    b = nn.Parameter(torch.zeros(3))
    c = nn.Parameter(torch.zeros(1))  # no grad: ignored
    a.grad = torch.tensor([0.0, 1.0])
    b.grad = torch.tensor([2.0, 3.0, float("nan")])  # non-finite entries are dropped
    counts, edges = gradient_histogram([("a", a), ("b", b), ("c", c)], bins=3)
    np.testing.assert_allclose(edges, [0.0, 1.0, 2.0, 3.0])
    np.testing.assert_allclose(counts, [1, 1, 2])
    counts, edges = gradient_histogram([("a", a), ("b", b)], bins=2, log10_abs=True)  # log10 of 1, 2, 3
    np.testing.assert_allclose(edges, [0.0, math.log10(3) / 2, math.log10(3)])
    np.testing.assert_allclose(counts, [1, 2])
    counts, edges = gradient_histogram([("c", c)])
    assert counts.size == 0 and edges.size == 0


@pytest.mark.parametrize("layers", [2, 12])
def test_host_reads_do_not_grow_with_the_number_of_tensors(layers, monkeypatch):
    """On a GPU each read of a device value waits for the device; the study's diagnostics ran ~5 per tensor
    (thousands a diagnostics step at 24 layers). Now: one for the step counters, one for the sums, one for
    the histogram's range, whatever the model's size."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(4, 8)).square().sum().backward()
        opt.step()
    reads = []
    for method in ("tolist", "item", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method, lambda t, *a, _m=method, _o=original: (reads.append(_m), _o(t, *a))[1])
    out = collect_diagnostics(model.named_parameters(), opt, step=2, lr=1e-3)
    counts, _ = gradient_histogram(model.named_parameters(), log10_abs=True)
    monkeypatch.undo()
    assert "update_ratio" in out and counts.sum() == sum(p.numel() for p in model.parameters())
    assert reads == ["tolist", "tolist", "tolist"], reads


def test_gradient_histogram_counts_where_the_gradients_live():
    """Counts are summed on the gradients' device, not the default one: on a GPU the sweep's
    diagnostics crashed on update 1 (CUDA histc into a CPU counter). Here the default device is
    ``meta`` and the gradients are on the CPU: the same mismatch without a GPU."""
    a = nn.Parameter(torch.zeros(3))
    a.grad = torch.tensor([1.0, 10.0, 100.0])
    with torch.device("meta"):
        counts, edges = gradient_histogram([("a", a)], bins=2, log10_abs=True)
    np.testing.assert_allclose(edges, [0.0, 1.0, 2.0])
    np.testing.assert_allclose(counts, [1, 2])


# --------------------------------------------------------------------------------------------
# Overhead benchmark (python tests/monitoring/test_diagnostics.py)
# --------------------------------------------------------------------------------------------


def _benchmark(repeats: int = 10) -> None:
    import time

    torch.manual_seed(0)
    torch.set_num_threads(1)
    d, layers, vocab, seq, batch = 128, 2, 1000, 128, 8
    layer = nn.TransformerEncoderLayer(d, 2, 4 * d, batch_first=True, dropout=0.0)
    model = nn.ModuleDict(
        {
            "embeddings": nn.Embedding(vocab, d),
            "encoder": nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
            "head": nn.Linear(d, vocab),
        }
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, vocab, (batch, seq))

    def train_step():
        opt.zero_grad()
        h = model["encoder"](model["embeddings"](ids))
        loss = nn.functional.cross_entropy(model["head"](h).reshape(-1, vocab), ids.reshape(-1))
        loss.backward()
        opt.step()

    for _ in range(2):
        train_step()

    def timed(fn):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats

    t_step = timed(train_step)
    t_diag = timed(lambda: collect_diagnostics(model.named_parameters(), opt, step=3, lr=1e-3))
    t_hist = timed(lambda: gradient_histogram(model.named_parameters()))
    n = sum(p.numel() for p in model.parameters())
    print(
        f"params={n / 1e6:.2f}M  train step {t_step * 1e3:.1f} ms  collect_diagnostics {t_diag * 1e3:.1f} ms "
        f"({t_diag / t_step:.1%})  gradient_histogram {t_hist * 1e3:.1f} ms ({t_hist / t_step:.1%})"
    )


if __name__ == "__main__":
    _benchmark()
