"""Optimizer and gradient diagnostics, computed every K steps on rank 0.

``collect_diagnostics`` returns a flat ``{name: float}`` dict for ``RunLogger.log``;
``gradient_histogram`` returns ``(counts, edges)`` for TensorBoard's ``add_histogram_raw``.
Both read gradients, weights and optimizer state only through injectable getters, so the caller passes
whatever it has:

- plain PyTorch: the defaults, ``p.grad`` and ``optimizer.state[p]``;
- DeepSpeed ZeRO (any stage): ``deepspeed_getters(engine.optimizer)``, built on ``deepspeed.utils.safe_get_full_grad``
  and ``safe_get_full_optimizer_state``. These are collectives under ZeRO-3, so *every* rank must
  call ``collect_diagnostics`` (only rank 0 logs); gradients exist only between ``backward`` and
  ``step`` (call it there, e.g. from a ``before_step`` callback).

Quantities (``t`` = Adam step count, from the state's ``step`` or else the ``step`` argument):

- ``lr``; ``grad_norm`` = ||g||_2 over all parameters and ``grad_norm/<group>`` per module prefix
  (``layer_group``: the name up to its first integer component, e.g. ``encoder.layers.0``, else
  the first component, e.g. ``embeddings``).
- ``update_ratio`` (and ``update_ratio/<group>``) = lr ||u|| / ||w|| with the Adam direction
  u = m^ / (sqrt(v^) + eps), m^ = m / (1 - b1^t), v^ = v / (1 - b2^t) (Kingma & Ba 2015, Alg. 1).
  It leaves out decoupled weight decay, RAdam's r_t and LAMB's trust ratio (reported separately).
- ``adam/step_size_mean`` and ``adam/step_size_var``: mean and variance over all elements of the
  adaptive step size 1 / (sqrt(v^) + eps), the quantity whose early variance motivates warmup
  (Liu et al. 2020, arXiv:1908.03265, sec. 3; Ma & Yarats 2019, arXiv:1910.04209, sec. 4).
- ``radam/rho_t``, ``radam/rectified`` (1/0) and, when rectified, ``radam/r_t``
  (``core.optim_math.radam_rectification``), for every Adam-family optimizer: the rectification
  is the implicit warmup the study compares against.
- ``lamb/trust_ratio_mean`` / ``_min`` / ``_max`` when the state holds LAMB trust ratios.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from core.optim_math import radam_rectification

__all__ = [
    "layer_group",
    "collect_diagnostics",
    "gradient_histogram",
    "deepspeed_getters",
    "diagnostics_due",
    "adam_update",
    "log_diagnostics",
]

GradGetter = Callable[[torch.Tensor], "torch.Tensor | None"]
StateGetter = Callable[[torch.Tensor], "dict[str, Any] | None"]

_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_forward_module.")
_INT = re.compile(r"^\d+$")


def layer_group(name: str) -> str:
    """Module prefix a parameter is reported under: up to the first integer component, else the first component."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix) :], True
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if _INT.match(part):
            return ".".join(parts[: i + 1])
    return parts[0] if len(parts) > 1 else "_root"


def deepspeed_getters(
    zero_optimizer: Any = None, state_keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
) -> dict[str, Callable]:
    """``{"get_grad", "get_state", "get_param"}`` for ZeRO-partitioned parameters (DeepSpeed's safe_get_full_* API).

    Use as ``collect_diagnostics(engine.module.named_parameters(), engine.optimizer, step=..., lr=...,
    **deepspeed_getters(engine.optimizer))``; ``get_grad`` also fits ``gradient_histogram``.

    Pass the engine's ZeRO optimizer to work around a DeepSpeed 0.19 ZeRO-1/2 gap: it links each
    parameter to its optimizer-state fragment once, right after the *first* param group's first
    step, before later groups have state, so parameters of the no-decay group never get
    ``exp_avg``/``exp_avg_sq`` through ``safe_get_full_optimizer_state``. We relink (cheap views)
    when the optimizer exposes that hook. A key still missing is left out (the parameter is skipped).
    Parameters DeepSpeed does not partition (ZeRO stage 0) are read from ``zero_optimizer.state``.
    """
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state

    relink = getattr(zero_optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if relink is not None and hasattr(zero_optimizer, "_hp_optimizer_states_linked"):
        inner = getattr(zero_optimizer, "optimizer", None)
        if inner is not None and len(inner.state) >= len(inner.param_groups):  # every group has stepped
            zero_optimizer._hp_optimizer_states_linked = False
            relink()

    def get_state(p: torch.Tensor) -> dict[str, Any] | None:
        if getattr(p, "_hp_mapping", None) is None and not hasattr(p, "ds_id"):  # not partitioned (ZeRO-0)
            inner_state = getattr(zero_optimizer, "state", None)
            return inner_state.get(p) if inner_state is not None else None
        state = {}
        for key in state_keys:
            try:
                value = safe_get_full_optimizer_state(p, key)
            except (ValueError, KeyError, TypeError):  # no state yet, or not linked
                value = None
            if value is not None:
                state[key] = value
        return state or None

    def get_param(p: torch.Tensor) -> torch.Tensor:
        full = safe_get_full_fp32_param(p)
        return full if full is not None else p

    return {"get_grad": safe_get_full_grad, "get_state": get_state, "get_param": get_param}


def _as_int(value: Any) -> int:
    return int(value.item()) if isinstance(value, torch.Tensor) else int(value)


def collect_diagnostics(
    named_params: Iterable[tuple[str, torch.Tensor]],
    optimizer: torch.optim.Optimizer | None,
    *,
    step: int,
    lr: float,
    get_grad: GradGetter | None = None,
    get_state: StateGetter | None = None,
    get_param: Callable[[torch.Tensor], torch.Tensor] | None = None,
    betas: tuple[float, float] | None = None,
    eps: float | None = None,
) -> dict[str, float]:
    """The flat diagnostics dict described in the module docstring.

    ``step`` is the number of optimizer updates already applied (used for bias correction and
    RAdam's rho_t when the state has no ``step``). ``betas``/``eps`` default to the optimizer's
    first parameter group (or Adam's 0.9/0.999/1e-8 without an optimizer).
    """
    if get_grad is None:

        def get_grad(p: torch.Tensor) -> torch.Tensor | None:
            return p.grad

    if get_state is None:

        def get_state(p: torch.Tensor) -> dict[str, Any] | None:
            return optimizer.state.get(p) if optimizer is not None else None

    if get_param is None:

        def get_param(p: torch.Tensor) -> torch.Tensor:
            return p

    group0 = optimizer.param_groups[0] if optimizer is not None and optimizer.param_groups else {}
    beta1, beta2 = betas if betas is not None else tuple(group0.get("betas", (0.9, 0.999)))
    eps = eps if eps is not None else float(group0.get("eps", 1e-8))

    out: dict[str, float] = {"lr": float(lr)}
    grad_sq: dict[str, float] = {}
    upd_sq: dict[str, float] = {}
    w_sq: dict[str, float] = {}
    n_elem = 0
    s_sum = s_sq_sum = 0.0
    trust: list[float] = []
    state_step = None

    with torch.no_grad():
        for name, p in named_params:
            group = layer_group(name)
            g = get_grad(p)
            if g is not None:
                grad_sq[group] = grad_sq.get(group, 0.0) + float(g.detach().double().square().sum())
            state = get_state(p)
            if not state or "exp_avg_sq" not in state or "exp_avg" not in state:
                continue
            t = _as_int(state["step"]) if "step" in state else step
            state_step = t if state_step is None else max(state_step, t)
            if t < 1:
                continue
            if "trust_ratio" in state:
                trust.append(float(state["trust_ratio"]))
            v_hat = state["exp_avg_sq"].detach().double() / (1.0 - beta2**t)
            m_hat = state["exp_avg"].detach().double() / (1.0 - beta1**t)
            size = 1.0 / (v_hat.sqrt() + eps)
            s_sum += float(size.sum())
            s_sq_sum += float(size.square().sum())
            n_elem += size.numel()
            upd_sq[group] = upd_sq.get(group, 0.0) + float((m_hat * size).square().sum())
            w = get_param(p).detach()
            if w.numel() == size.numel():  # else a ZeRO-3 local shard was passed without get_param
                w_sq[group] = w_sq.get(group, 0.0) + float(w.double().square().sum())

    if grad_sq:
        out["grad_norm"] = sum(grad_sq.values()) ** 0.5
        for group, sq in sorted(grad_sq.items()):
            out[f"grad_norm/{group}"] = sq**0.5
    if n_elem:
        mean = s_sum / n_elem
        out["adam/step_size_mean"] = mean
        out["adam/step_size_var"] = max(0.0, s_sq_sum / n_elem - mean * mean)
        total_w = sum(w_sq.values())
        if total_w > 0:
            out["update_ratio"] = lr * sum(upd_sq[g] for g in w_sq) ** 0.5 / total_w**0.5
        for group in sorted(w_sq):
            if w_sq[group] > 0:
                out[f"update_ratio/{group}"] = lr * upd_sq[group] ** 0.5 / w_sq[group] ** 0.5
    t = state_step if state_step is not None else step
    if t >= 1 and 0.0 < beta2 < 1.0:
        rho_t, r_t = radam_rectification(t, beta2)
        out["radam/rho_t"] = rho_t
        out["radam/rectified"] = float(r_t is not None)
        if r_t is not None:
            out["radam/r_t"] = r_t
    if trust:
        out["lamb/trust_ratio_mean"] = sum(trust) / len(trust)
        out["lamb/trust_ratio_min"] = min(trust)
        out["lamb/trust_ratio_max"] = max(trust)
    return out


def gradient_histogram(
    named_params: Iterable[tuple[str, torch.Tensor]],
    *,
    bins: int = 64,
    log10_abs: bool = False,
    get_grad: GradGetter | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Histogram of all gradient entries: ``counts`` (``bins``) and ``edges`` (``bins + 1``), for ``add_histogram_raw``.

    ``log10_abs=True`` histograms log10|g| of the non-zero entries instead (readable when a few
    outliers would put everything in one linear bin). Two passes (range, then ``torch.histc`` per
    tensor) so no concatenated copy of all gradients is made. No gradients: empty arrays.
    """
    if get_grad is None:

        def get_grad(p: torch.Tensor) -> torch.Tensor | None:
            return p.grad

    def values(p: torch.Tensor) -> torch.Tensor | None:
        g = get_grad(p)
        if g is None:
            return None
        g = g.detach().float().reshape(-1)
        g = g[torch.isfinite(g)]
        if log10_abs:
            g = g.abs()
            g = g[g > 0].log10()
        return g if g.numel() else None

    grads = [v for _, p in named_params if (v := values(p)) is not None]
    if not grads:
        return np.zeros(0), np.zeros(0)
    lo = min(float(g.min()) for g in grads)
    hi = max(float(g.max()) for g in grads)
    if hi <= lo:  # all entries equal: one unit-wide range around them
        lo, hi = lo - 0.5, hi + 0.5
    counts = torch.zeros(bins, dtype=torch.float64)
    for g in grads:
        counts += torch.histc(g, bins=bins, min=lo, max=hi).double()
    edges = np.linspace(lo, hi, bins + 1)
    return counts.numpy(), edges


# --------------------------------------------------------------------------------------------
# The trainer's hook: everything above, on a cadence, into RunLogger (used by the warmup study)
# --------------------------------------------------------------------------------------------


def diagnostics_due(step: int, every: int) -> bool:
    """True on update 1 and every ``every``-th update (``logging.diagnostics_every``; 0 = never)."""
    return every > 0 and (step == 1 or step % every == 0)


def adam_update(
    p: torch.Tensor, g: torch.Tensor, state: dict[str, Any] | None, group: dict[str, Any], *, radam: bool
) -> torch.Tensor:
    """The step ``delta w`` that Adam/AdamW/RAdam is about to apply to ``p`` for (already clipped) gradient ``g``.

    m_t = b1 m + (1 - b1) g, v_t = b2 v + (1 - b2) g^2, u = lr m^ / (sqrt(v^) + eps) (Kingma & Ba 2015);
    RAdam multiplies by r_t once rho_t > 5 and applies lr m^ before (Liu et al. 2020, Alg. 2).
    L2 weight decay (Adam) enters g; decoupled decay (AdamW) adds lr wd w. Matches torch's
    optimizers up to where eps enters RAdam's denominator.
    """
    beta1, beta2 = group["betas"]
    lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group.get("weight_decay", 0.0))
    decoupled = bool(group.get("decoupled_weight_decay", False))
    w = p.detach().double()
    g = g.detach().double()
    if wd and not decoupled:
        g = g + wd * w
    state = state or {}
    t = (_as_int(state["step"]) if "step" in state else 0) + 1
    m = state["exp_avg"].detach().double() if "exp_avg" in state else torch.zeros_like(g)
    v = state["exp_avg_sq"].detach().double() if "exp_avg_sq" in state else torch.zeros_like(g)
    m_hat = (beta1 * m + (1 - beta1) * g) / (1 - beta1**t)
    v_hat = (beta2 * v + (1 - beta2) * g * g) / (1 - beta2**t)
    if radam:
        _, r_t = radam_rectification(t, beta2)
        u = m_hat if r_t is None else r_t * m_hat / (v_hat.sqrt() + eps)
    else:
        u = m_hat / (v_hat.sqrt() + eps)
    u = -lr * u
    if wd and decoupled:
        u = u - lr * wd * w
    return u


def _torch_optimizer(optimizer: Any) -> Any:
    """The innermost ``torch.optim.Optimizer`` (accelerate wraps it; its ``.optimizer`` is the real one)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def log_diagnostics(logger: Any, engine: Any, *, step: int, cfg: Any, bins: int = 64) -> dict[str, float] | None:
    """Log gradient/optimizer diagnostics for update ``step`` when ``diagnostics_due`` says so.

    Call it on **every rank** between the last ``engine.backward`` and ``engine.step()`` (the
    gradients still exist there); ``engine`` is ``pipelines.engine.distributed.Engine``, ``cfg`` the
    ``RunConfig``. Writes, under ``step``:

    - split ``diag`` (``RunLogger.log``): everything ``collect_diagnostics`` returns (Adam statistics
      of the state *before* this update, i.e. after ``step - 1`` updates), with ``radam/rho_t`` and
      ``radam/r_t`` of this update t and ``radam/effective_lr`` = lr r_t (0 while unrectified)
      for RAdam -- its implicit warmup (Liu et al. 2020, Fig. 3; Ma & Yarats 2019, sec. 4) -- and
      ``adam/step_size_{mean,var}_blocks`` over the transformer blocks' weights only (embedding rows
      no batch has hit yet have v = 0, a step size of 1/eps, and dominate the all-weights variance);
    - in the same ``diag`` record: histograms of log10|g| of the gradients (before clipping) and of log10|delta w|
      of the update about to be applied (``adam_update``, after clipping; Adam-family only), as
      ``grad_log10_counts`` / ``grad_log10_edges`` and ``update_log10_counts`` / ``update_log10_edges``
      (Liu et al. 2020, Fig. 2); also TensorBoard histograms ``diag/grad_log10_abs``, ``diag/update_log10_abs``.

    Under DeepSpeed the engine steps inside ``backward``, so gradients are gone by then: only the
    optimizer-state statistics (after this update) are logged. Returns the scalars (or None when not due).
    """
    if not diagnostics_due(step, cfg.logging.diagnostics_every):
        return None
    deepspeed = bool(getattr(engine, "deepspeed", False))
    if not deepspeed and getattr(engine, "rank", 0) != 0:
        return None  # DDP: gradients are identical on every rank after backward, no collective here
    model = engine.module
    radam = cfg.optim.name == "radam"
    if deepspeed:
        zero_opt = getattr(engine.model, "optimizer", None)
        getters = deepspeed_getters(zero_opt)
        optimizer = zero_opt
    else:
        getters, optimizer = {}, _torch_optimizer(engine.optimizer)
    lr = float(optimizer.param_groups[0]["lr"]) if optimizer is not None else float(cfg.optim.lr)
    named = list(model.named_parameters())
    scalars = collect_diagnostics(named, optimizer, step=step, lr=lr, **getters)
    beta2 = float(cfg.optim.betas[1])
    rho_t, r_t = radam_rectification(step, beta2)
    scalars["radam/rho_t"], scalars["radam/rectified"] = rho_t, float(r_t is not None)
    scalars.pop("radam/r_t", None)
    if r_t is not None:
        scalars["radam/r_t"] = r_t
    if radam:
        scalars["radam/effective_lr"] = lr * (r_t or 0.0)
    if not deepspeed and optimizer is not None:  # the same variance over the transformer blocks only (no
        blocks = [(n, p) for n, p in named if re.search(r"\.\d+\.", n)]  # never-hit embedding rows: 1/eps)
        sub = collect_diagnostics(blocks, optimizer, step=step, lr=lr) if blocks else {}
        if "adam/step_size_var" in sub:
            scalars["adam/step_size_var_blocks"] = sub["adam/step_size_var"]
            scalars["adam/step_size_mean_blocks"] = sub["adam/step_size_mean"]
    hist: dict[str, Any] = {}
    counts, edges = gradient_histogram(named, bins=bins, log10_abs=True, get_grad=getters.get("get_grad"))
    if len(counts):
        hist["grad_log10_counts"], hist["grad_log10_edges"] = counts.tolist(), edges.tolist()
        logger.log_histogram(step, "diag/grad_log10_abs", counts=counts, edges=edges)
    if not deepspeed and cfg.optim.name in ("adam", "adamw", "radam") and optimizer is not None:
        clip = float(cfg.optim.grad_clip)
        norm = scalars.get("grad_norm", 0.0)
        coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 and math.isfinite(norm) else 1.0
        groups = {id(q): grp for grp in optimizer.param_groups for q in grp["params"]}
        updates = {
            id(p): adam_update(p, p.grad * coef, optimizer.state.get(p), groups[id(p)], radam=radam)
            for _, p in named
            if p.grad is not None and id(p) in groups
        }
        counts, edges = gradient_histogram(named, bins=bins, log10_abs=True, get_grad=lambda q: updates.get(id(q)))
        if len(counts):
            hist["update_log10_counts"], hist["update_log10_edges"] = counts.tolist(), edges.tolist()
            logger.log_histogram(step, "diag/update_log10_abs", counts=counts, edges=edges)
    logger.log(step, {**scalars, **hist}, split="diag")
    return scalars
