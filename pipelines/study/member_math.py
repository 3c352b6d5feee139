"""The optimizer and the diagnostics of an ensemble (``pipelines.study.ensemble``): N runs' weights as rows of one
``[N, P]`` tensor, each row stepped and measured with its own run's hyperparameters.

``MemberAdam.step`` is Adam (Kingma & Ba 2015, Alg. 1) or RAdam (Liu et al. 2020, arXiv:1908.03265, Alg. 2), as
``torch.optim.Adam`` / ``torch.optim.RAdam`` compute them, for every row at once. Per row, with t its update number,
lr its scheduled rate, bc1 = 1 - b1^t, bc2 = 1 - b2^t and r_t RAdam's rectification (``radam_rectification``):

    g <- g + wd w (L2 decay, decayed columns only);  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
    Adam:              w <- w - lr/bc1 m / (sqrt(v)/sqrt(bc2) + eps)  =  w - m A / (sqrt(v) + E),
                       A = lr sqrt(bc2)/bc1, E = eps sqrt(bc2)
    RAdam, rho_t > 5:  w <- w - lr/bc1 r_t sqrt(bc2) m / (sqrt(v) + eps)  (A = lr r_t sqrt(bc2)/bc1, E = eps)
    RAdam, rho_t <= 5: w <- w - lr/bc1 m                                  (B = lr/bc1)

so one update of all rows is ``w -= m (A / (sqrt(v) + E) + B)`` with per-row A, E, B computed on the host: a handful
of elementwise kernels whatever N is. A row that skips its update (a non-finite loss, a stopped run) gets
1 - b1 = 1 - b2 = A = B = 0: its weights and moments stay exactly as they were.

``member_diagnostics`` computes, for every row, what ``monitoring.diagnostics.log_diagnostics`` logs for one run
(the same keys and formulas: gradient norms per layer group, Adam's step-size mean and variance, the update
ratio, RAdam's rho_t / r_t, the log10|g| and log10|update| histograms) with reductions along the rows and one
host read for all of them. tests/pipelines/test_ensemble.py checks both against the single-run path.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from core.optim_math import radam_rectification
from monitoring.diagnostics import layer_group

__all__ = ["MemberHyper", "ColumnLayout", "MemberAdam", "member_diagnostics"]

_BLOCK_PARAM = re.compile(r"\.\d+\.")  # a transformer block's tensor (what the ``_blocks`` step-size statistics cover)


@dataclass(frozen=True)
class MemberHyper:
    """One row's optimizer: its run's ``optim`` section and schedule."""

    rectified: bool  # RAdam
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip: float
    schedule: Any  # the run's LR multiplier of the 0-based update index (``check.run_schedule``)

    def lr_at(self, updates_done: int) -> float:
        return self.lr * self.schedule(updates_done)


class ColumnLayout:
    """Where each named tensor lives in a row of P columns, and the column labels the diagnostics sum by."""

    def __init__(self, names: list[str], shapes: list[torch.Size], no_decay: list[bool], device: torch.device) -> None:
        self.names, self.shapes = names, shapes
        self.sizes = [math.prod(s) for s in shapes]
        self.groups = sorted({layer_group(n) for n in names})
        group_of = {g: i for i, g in enumerate(self.groups)}
        self.columns = sum(self.sizes)

        def per_column(values: list[Any], dtype: torch.dtype) -> torch.Tensor:
            return torch.cat([torch.full((size,), v, dtype=dtype) for v, size in zip(values, self.sizes, strict=True)]).to(device)

        self.group_index = per_column([group_of[layer_group(n)] for n in names], torch.long)
        self.in_blocks = per_column([bool(_BLOCK_PARAM.search(n)) for n in names], torch.bool)
        self.decayed = per_column([not nd for nd in no_decay], torch.bool)
        self.block_columns = int(sum(size for n, size in zip(names, self.sizes, strict=True) if _BLOCK_PARAM.search(n)))

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{name: [N, *shape] view}`` of an ``[N, P]`` tensor (autograd flows back into ``flat``)."""
        rows = flat.shape[0]
        return {n: part.view(rows, *shape)
                for n, part, shape in zip(self.names, flat.split(self.sizes, dim=1), self.shapes, strict=True)}


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype).to(like.device, non_blocking=True)[:, None]


class MemberAdam:
    """Adam / RAdam state (``m``, ``v``: ``[N, P]`` fp32) and the per-row step described in the module docstring."""

    def __init__(self, weights: torch.Tensor, layout: ColumnLayout, members: list[MemberHyper]) -> None:
        self.weights, self.layout, self.members = weights, layout, members
        self.exp_avg = torch.zeros_like(weights)
        self.exp_avg_sq = torch.zeros_like(weights)
        self.updates_done = [0] * len(members)  # per row: torch's ``state["step"]``

    def lrs(self) -> list[float]:
        """Each row's rate for its next update (what its optimizer's param group holds now)."""
        return [h.lr_at(t) for h, t in zip(self.members, self.updates_done, strict=True)]

    def clip_coefficients(self, grad_norms: list[float]) -> list[float]:
        """torch's ``clip_grad_norm_``: max_norm / (norm + 1e-6), at most 1; 1 without clipping."""
        return [min(1.0, h.grad_clip / (n + 1e-6)) if h.grad_clip > 0 and math.isfinite(n) else 1.0
                for h, n in zip(self.members, grad_norms, strict=True)]

    @torch.no_grad()
    def step(self, grads: torch.Tensor, apply: list[bool], clip: list[float]) -> None:
        """One update of every row whose ``apply`` is True (the others keep weights and moments)."""
        one_minus_b1, one_minus_b2, a_coef, e_coef, b_coef, wd = [], [], [], [], [], []
        for i, (h, go) in enumerate(zip(self.members, apply, strict=True)):
            if not go:
                for col in (one_minus_b1, one_minus_b2, a_coef, b_coef, wd):
                    col.append(0.0)
                e_coef.append(1.0)
                continue
            t = self.updates_done[i] + 1
            lr, bc1, bc2 = h.lr_at(t - 1), 1.0 - h.beta1**t, 1.0 - h.beta2**t
            one_minus_b1.append(1.0 - h.beta1)
            one_minus_b2.append(1.0 - h.beta2)
            wd.append(h.weight_decay)
            if not h.rectified:
                a, e, b = lr * math.sqrt(bc2) / bc1, h.eps * math.sqrt(bc2), 0.0
            else:
                _, r_t = radam_rectification(t, h.beta2)
                a, e, b = (0.0, h.eps, lr / bc1) if r_t is None else (lr * r_t * math.sqrt(bc2) / bc1, h.eps, 0.0)
            a_coef.append(a)
            e_coef.append(e)
            b_coef.append(b)
            self.updates_done[i] = t
        w, m, v = self.weights, self.exp_avg, self.exp_avg_sq
        if not all(apply):  # a skipped row's gradient may be NaN/Inf: 0 x NaN would reach its moments and weights
            grads = torch.where(torch.tensor(apply, device=w.device)[:, None], grads, 0.0)
        g = grads if all(c == 1.0 for c in clip) else grads * _column(clip, w)
        if any(wd):
            g = g + _column(wd, w) * w * self.layout.decayed
        m.lerp_(g, _column(one_minus_b1, w))
        v.lerp_(g * g, _column(one_minus_b2, w))
        w.sub_(torch.addcdiv(m * _column(b_coef, w), m * _column(a_coef, w), v.sqrt().add_(_column(e_coef, w))))


def _histogram_parts(values: torch.Tensor, bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``values`` (float32 [n, P]): [lo, hi, finite count] and the ``torch.histc`` counts over
    [lo, hi] of its finite entries (``gradient_histogram``'s range rule, ``histc``'s binning), on the device."""
    finite = torch.isfinite(values)
    inf = torch.tensor(float("inf"), device=values.device)
    lo = torch.where(finite, values, inf).amin(1).double()
    hi = torch.where(finite, values, -inf).amax(1).double()
    n = finite.sum(1).double()
    flat = hi <= lo  # all entries equal: one unit-wide range around them
    lo, hi = torch.where(flat, lo - 0.5, lo), torch.where(flat, hi + 0.5, hi)
    lo32, hi32 = lo.float()[:, None], hi.float()[:, None]
    pos = ((values - lo32) * bins / (hi32 - lo32)).floor().clamp(0, bins - 1).long()
    keep = finite & (values >= lo32) & (values <= hi32)
    rows = torch.arange(values.shape[0], device=values.device)[:, None] * bins
    counts = torch.zeros(values.shape[0] * bins, dtype=torch.float64, device=values.device)
    counts.scatter_add_(0, (rows + pos).reshape(-1), keep.reshape(-1).double())
    return torch.stack([lo, hi, n], 1), counts.view(-1, bins)


@torch.no_grad()
def member_diagnostics(
    opt: MemberAdam, grads: torch.Tensor, rows: list[int], *, update: list[int], bins: int = 64,
    chunk_elements: int = 1 << 24,
) -> list[dict[str, Any]]:
    """``log_diagnostics``' record (scalars and histograms) for each row in ``rows``, before this update.

    ``update``: each row's update number (the trainer's step, skipped steps included). Float64 sums on the device,
    as many rows at a time as keep each of the ~15 float64 temporaries within ``chunk_elements`` (128 MiB), read
    back with one ``tolist()``.
    """
    layout, w_all = opt.layout, opt.weights
    chunk = max(1, chunk_elements // layout.columns)
    lrs = opt.lrs()
    pieces: list[torch.Tensor] = []
    idx = torch.tensor(rows, dtype=torch.long, device=w_all.device)
    for start in range(0, len(rows), chunk):
        sel = idx[start:start + chunk]
        hyper = [opt.members[r] for r in rows[start:start + chunk]]
        done = [opt.updates_done[r] for r in rows[start:start + chunk]]
        g = grads.index_select(0, sel)
        g64, m, v, w = g.double(), opt.exp_avg.index_select(0, sel), opt.exp_avg_sq.index_select(0, sel), w_all.index_select(0, sel)
        groups = len(layout.groups)
        grad_sq = torch.zeros(len(sel), groups, dtype=torch.float64, device=g.device).index_add_(1, layout.group_index, g64 * g64)
        # Adam statistics of the state after ``done`` updates (rows with done = 0 have none; dropped on the host)
        t = [max(d, 1) for d in done]
        bc1 = _column([1.0 - h.beta1**ti for h, ti in zip(hyper, t, strict=True)], g64)
        bc2 = _column([1.0 - h.beta2**ti for h, ti in zip(hyper, t, strict=True)], g64)
        eps = _column([h.eps for h in hyper], g64)
        size = 1.0 / ((v.double() / bc2).sqrt() + eps)
        upd = (m.double() / bc1) * size
        blocks = layout.in_blocks
        sums = [size.sum(1), size.square().sum(1), (size * blocks).sum(1), (size.square() * blocks).sum(1)]
        upd_sq = torch.zeros_like(grad_sq).index_add_(1, layout.group_index, upd * upd)
        w_sq = torch.zeros_like(grad_sq).index_add_(1, layout.group_index, w.double().square())
        # the update about to be applied (``adam_update``: float64, eps on sqrt(v^) for RAdam too), clipped gradients
        max_norm = _column([h.grad_clip for h in hyper], g64)
        clip = torch.where(max_norm > 0, (max_norm / (grad_sq.sum(1, keepdim=True).sqrt() + 1e-6)).clamp(max=1.0), 1.0)
        gc = g64 * clip
        wd = _column([h.weight_decay for h in hyper], g64)
        if any(h.weight_decay for h in hyper):
            gc = gc + wd * w.double() * layout.decayed
        t1 = [d + 1 for d in done]
        b1 = _column([h.beta1 for h in hyper], g64)
        b2 = _column([h.beta2 for h in hyper], g64)
        m_hat = (b1 * m.double() + (1 - b1) * gc) / _column([1.0 - h.beta1**ti for h, ti in zip(hyper, t1, strict=True)], g64)
        v_hat = (b2 * v.double() + (1 - b2) * gc * gc) / _column([1.0 - h.beta2**ti for h, ti in zip(hyper, t1, strict=True)], g64)
        ratio = []
        for h, ti in zip(hyper, t1, strict=True):
            r_t = radam_rectification(ti, h.beta2)[1] if h.rectified else 1.0
            ratio.append(0.0 if r_t is None else r_t)
        adaptive = _column(ratio, g64)
        plain = _column([float(h.rectified and radam_rectification(ti, h.beta2)[1] is None)
                         for h, ti in zip(hyper, t1, strict=True)], g64)
        step = -_column([lrs[r] for r in rows[start:start + chunk]], g64) * (
            adaptive * m_hat / (v_hat.sqrt() + eps) + plain * m_hat)
        grad_range, grad_counts = _histogram_parts(g.float().abs().log10(), bins)
        upd_range, upd_counts = _histogram_parts(step.float().abs().log10(), bins)
        pieces.append(torch.cat([grad_sq, upd_sq, w_sq, torch.stack(sums, 1), grad_range, grad_counts, upd_range,
                                 upd_counts], 1))
    values = torch.cat(pieces).tolist()
    return [_member_record(values[i], opt, r, layout, lrs[r], update[i], bins) for i, r in enumerate(rows)]


def _member_record(row: list[float], opt: MemberAdam, r: int, layout: ColumnLayout, lr: float, update: int,
                   bins: int) -> dict[str, Any]:
    """One row of ``member_diagnostics``' read-back as ``log_diagnostics`` names it."""
    h, done, groups = opt.members[r], opt.updates_done[r], len(layout.groups)
    grad_sq, upd_sq, w_sq = row[:groups], row[groups:2 * groups], row[2 * groups:3 * groups]
    s_sum, s_sq, s_sum_blocks, s_sq_blocks = row[3 * groups:3 * groups + 4]
    rest = row[3 * groups + 4:]
    grad_range, grad_counts = rest[:3], rest[3:3 + bins]
    upd_range, upd_counts = rest[3 + bins:6 + bins], rest[6 + bins:6 + 2 * bins]
    out: dict[str, Any] = {"lr": lr, "grad_norm": sum(grad_sq) ** 0.5}
    for name, sq in zip(layout.groups, grad_sq, strict=True):
        out[f"grad_norm/{name}"] = sq**0.5
    if done >= 1:
        mean = s_sum / layout.columns
        out["adam/step_size_mean"] = mean
        out["adam/step_size_var"] = max(0.0, s_sq / layout.columns - mean * mean)
        total_w = sum(w_sq)
        if total_w > 0:
            out["update_ratio"] = lr * sum(upd_sq) ** 0.5 / total_w**0.5
        for name, u, wq in zip(layout.groups, upd_sq, w_sq, strict=True):
            if wq > 0:
                out[f"update_ratio/{name}"] = lr * u**0.5 / wq**0.5
    rho_t, r_t = radam_rectification(update, h.beta2)
    out["radam/rho_t"], out["radam/rectified"] = rho_t, float(r_t is not None)
    if r_t is not None:
        out["radam/r_t"] = r_t
    if h.rectified:
        out["radam/effective_lr"] = lr * (r_t or 0.0)
    if done >= 1 and layout.block_columns:
        mean = s_sum_blocks / layout.block_columns
        out["adam/step_size_var_blocks"] = max(0.0, s_sq_blocks / layout.block_columns - mean * mean)
        out["adam/step_size_mean_blocks"] = mean
    for key, (lo, hi, n), counts in (("grad_log10", grad_range, grad_counts), ("update_log10", upd_range, upd_counts)):
        if n > 0:
            out[f"{key}_counts"], out[f"{key}_edges"] = counts, np.linspace(lo, hi, bins + 1).tolist()
    return out
