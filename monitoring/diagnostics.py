"""Optimizer and gradient diagnostics, computed every K steps on rank 0.

``collect_diagnostics`` returns a flat ``{name: float}`` dict for ``RunLogger.log``;
``gradient_histogram`` returns ``(counts, edges)`` for TensorBoard's ``add_histogram_raw``.
Both read gradients, weights and optimizer state only through injectable getters, so the caller passes
whatever it has:

- plain PyTorch: the defaults, ``p.grad`` and ``optimizer.state[p]``;
- a training engine: ``engine.parameter_reads()`` (``DiagnosticsEngine``, the questions this module
  asks the engine; ``pipelines.engine.engines`` answers them for DDP and DeepSpeed ZeRO). Under ZeRO
  the reads are collectives, so *every* rank must call (only rank 0 logs); gradients exist only
  between ``backward`` and ``step``.

This module never imports or inspects DeepSpeed.

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
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from core.optim_math import radam_rectification

__all__ = [
    "layer_group",
    "collect_diagnostics",
    "gradient_histogram",
    "DiagnosticsEngine",
    "ParameterReads",
    "TorchView",
    "diagnostics_due",
    "adam_update",
    "log_diagnostics",
]

GradGetter = Callable[[torch.Tensor], "torch.Tensor | None"]
StateGetter = Callable[[torch.Tensor], "dict[str, Any] | None"]

@dataclass(frozen=True)
class ParameterReads:
    """Full (unpartitioned) views of a parameter: its gradient, optimizer state and fp32 value."""

    get_grad: GradGetter
    get_state: StateGetter
    get_param: Callable[[torch.Tensor], torch.Tensor]

    def as_kwargs(self) -> dict[str, Callable]:
        return {"get_grad": self.get_grad, "get_state": self.get_state, "get_param": self.get_param}


class DiagnosticsEngine(Protocol):
    """What ``log_diagnostics`` asks the training engine (``pipelines.engine.engines.Engine`` answers).

    ``optimizer_facts``: the registered optimizer's entry (``adam_update``: its update is Adam's and can
    be replayed; ``has_rectification``: RAdam's r_t scales it); ``reads_are_collective``: every rank
    must call (ZeRO partitions); ``grads_before_step``: the gradients (and the update to come) still
    exist between ``backward`` and ``step`` (False when the engine updates inside ``backward``).
    """

    rank: int
    module: torch.nn.Module
    optimizer_facts: Any
    reads_are_collective: bool
    grads_before_step: bool

    def optimizer_param_groups(self) -> list[dict[str, Any]]: ...

    def parameter_reads(self) -> ParameterReads: ...

    def clip_coefficient(self, grad_norm: float) -> float: ...


class TorchView:
    """``DiagnosticsEngine`` for a plain PyTorch model and optimizer (one process, gradients on ``p.grad``);
    clipping as ``torch.nn.utils.clip_grad_norm_(max_norm=grad_clip)``, 0 = off."""

    reads_are_collective = False
    grads_before_step = True

    def __init__(self, module: torch.nn.Module, optimizer: Any, *, grad_clip: float, optimizer_facts: Any,
                 rank: int = 0) -> None:
        while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):  # accelerate's wrapper
            optimizer = optimizer.optimizer
        self.module, self.optimizer, self.grad_clip = module, optimizer, float(grad_clip)
        self.optimizer_facts, self.rank = optimizer_facts, rank

    def optimizer_param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def parameter_reads(self) -> ParameterReads:
        return ParameterReads(lambda p: p.grad, lambda p: self.optimizer.state.get(p), lambda p: p)

    def clip_coefficient(self, grad_norm: float) -> float:
        if self.grad_clip > 0 and math.isfinite(grad_norm):
            return min(1.0, self.grad_clip / (grad_norm + 1e-6))
        return 1.0


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


def _as_int(value: Any) -> int:
    return int(value.item()) if isinstance(value, torch.Tensor) else int(value)


def _read_steps(values: list[Any], *, default: int) -> list[int]:
    """The optimizer states' step counters as ints, with one host read for all that are tensors (fused
    Adam keeps them on the device); a state without one counts ``default``."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    read = iter(torch.stack([v.detach().reshape(()).to(tensors[0].device, torch.float64) for v in tensors]).tolist()
                if tensors else [])
    return [default if v is None else int(next(read)) if isinstance(v, torch.Tensor) else int(v) for v in values]


class _DeviceSums:
    """Named float64 sums accumulated where the tensors live, plus a list of items, read back with one
    ``tolist()``: on a GPU each host read waits for the device, and the diagnostics took several per tensor."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.items: list[torch.Tensor] = []
        self.device: torch.device | None = None

    def _here(self, value: Any) -> torch.Tensor:
        if self.device is None and isinstance(value, torch.Tensor):
            self.device = value.device
        return torch.as_tensor(value, dtype=torch.float64, device=self.device).reshape(())

    def add(self, key: str, value: torch.Tensor) -> None:
        value = self._here(value)
        self.sums[key] = value if key not in self.sums else self.sums[key] + value  # the order float() + float() had

    def add_item(self, value: Any) -> None:
        self.items.append(self._here(value))

    def read(self) -> tuple[dict[str, float], list[float]]:
        keys = list(self.sums)
        flat = [self.sums[k] for k in keys] + self.items
        values = torch.stack(flat).tolist() if flat else []
        return dict(zip(keys, values[: len(keys)], strict=True)), values[len(keys):]


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
    named = list(named_params)
    sums = _DeviceSums()  # float64 sums kept on the device, read back once (not several host reads per tensor)
    n_elem = 0
    state_step = None
    adam_states = [(name, p, st) for name, p in named
                   if (st := get_state(p)) and "exp_avg_sq" in st and "exp_avg" in st]
    steps = _read_steps([st.get("step") for _, _, st in adam_states], default=step)

    with torch.no_grad():
        for name, p in named:
            g = get_grad(p)
            if g is not None:
                sums.add(f"grad_sq/{layer_group(name)}", g.detach().double().square().sum())
        for (name, p, state), t in zip(adam_states, steps, strict=True):
            group = layer_group(name)
            state_step = t if state_step is None else max(state_step, t)
            if t < 1:
                continue
            if "trust_ratio" in state:
                sums.add_item(state["trust_ratio"])
            v_hat = state["exp_avg_sq"].detach().double() / (1.0 - beta2**t)
            m_hat = state["exp_avg"].detach().double() / (1.0 - beta1**t)
            size = 1.0 / (v_hat.sqrt() + eps)
            sums.add("s_sum", size.sum())
            sums.add("s_sq_sum", size.square().sum())
            n_elem += size.numel()
            sums.add(f"upd_sq/{group}", (m_hat * size).square().sum())
            w = get_param(p).detach()
            if w.numel() == size.numel():  # else a ZeRO-3 local shard was passed without get_param
                sums.add(f"w_sq/{group}", w.double().square().sum())
    read, trust = sums.read()
    grad_sq = {k.split("/", 1)[1]: v for k, v in read.items() if k.startswith("grad_sq/")}
    upd_sq = {k.split("/", 1)[1]: v for k, v in read.items() if k.startswith("upd_sq/")}
    w_sq = {k.split("/", 1)[1]: v for k, v in read.items() if k.startswith("w_sq/")}
    s_sum, s_sq_sum = read.get("s_sum", 0.0), read.get("s_sq_sum", 0.0)

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
        if g is None or g.numel() == 0:
            return None
        g = g.detach().float().reshape(-1)
        return g.abs().log10() if log10_abs else g  # zeros -> -inf: dropped with the non-finite entries

    grads = [v for _, p in named_params if (v := values(p)) is not None]
    if not grads:
        return np.zeros(0), np.zeros(0)
    # the range over the finite entries, with one host read for all tensors (no boolean indexing: each is a sync)
    finite = [torch.isfinite(g) for g in grads]
    inf = torch.tensor(float("inf"), device=grads[0].device)
    lo, hi, n = torch.stack([
        torch.stack([torch.where(f, g, inf).amin() for g, f in zip(grads, finite, strict=True)]).amin().double(),
        torch.stack([torch.where(f, g, -inf).amax() for g, f in zip(grads, finite, strict=True)]).amax().double(),
        torch.stack([f.sum() for f in finite]).sum().double(),
    ]).tolist()
    if n == 0:
        return np.zeros(0), np.zeros(0)
    if hi <= lo:  # all entries equal: one unit-wide range around them
        lo, hi = lo - 0.5, hi + 0.5
    below = lo - 1.0  # where the non-finite entries go: outside the range, so histc drops them
    counts = torch.zeros(bins, dtype=torch.float64, device=grads[0].device)  # summed where the gradients live
    for g, f in zip(grads, finite, strict=True):
        counts += torch.histc(torch.where(f, g, below), bins=bins, min=lo, max=hi).double()
    edges = np.linspace(lo, hi, bins + 1)
    return counts.cpu().numpy(), edges


# --------------------------------------------------------------------------------------------
# The trainer's hook: everything above, on a cadence, into RunLogger (used by the warmup study)
# --------------------------------------------------------------------------------------------


def diagnostics_due(step: int, every: int) -> bool:
    """True on update 1 and every ``every``-th update (``logging.diagnostics_every``; 0 = never)."""
    return every > 0 and (step == 1 or step % every == 0)


def adam_update(
    p: torch.Tensor, g: torch.Tensor, state: dict[str, Any] | None, group: dict[str, Any], *, radam: bool,
    steps_done: int | None = None,
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
    if steps_done is None:  # the state's counter (a host read where it lives on the device)
        steps_done = _as_int(state["step"]) if "step" in state else 0
    t = steps_done + 1
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


def log_diagnostics(logger: Any, engine: DiagnosticsEngine, *, step: int, cfg: Any,
                    bins: int = 64) -> dict[str, float] | None:
    """Log gradient/optimizer diagnostics for update ``step`` when ``diagnostics_due`` says so.

    Call it on **every rank** between the last ``engine.backward`` and ``engine.step()`` (the
    gradients still exist there); ``engine`` answers ``DiagnosticsEngine`` (the trainer's ``Engine``,
    or ``TorchView`` for a plain loop), ``cfg`` is the ``RunConfig``. Writes, under ``step``:

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

    When the engine steps inside ``backward`` (DeepSpeed: ``grads_before_step`` is False), gradients
    are gone by then: only the optimizer-state statistics (after this update) are logged. Returns the scalars (or None when not due).
    """
    if not diagnostics_due(step, cfg.logging.diagnostics_every):
        return None
    if not engine.reads_are_collective and engine.rank != 0:
        return None  # DDP: gradients are identical on every rank after backward, no collective here
    model, facts, before_step = engine.module, engine.optimizer_facts, engine.grads_before_step
    groups = engine.optimizer_param_groups()
    reads = engine.parameter_reads()
    lr = float(groups[0]["lr"]) if groups else float(cfg.optim.lr)
    betas = tuple(groups[0]["betas"]) if groups and "betas" in groups[0] else None
    eps = float(groups[0]["eps"]) if groups and "eps" in groups[0] else None
    named = list(model.named_parameters())
    scalars = collect_diagnostics(named, None, step=step, lr=lr, betas=betas, eps=eps, **reads.as_kwargs())
    beta2 = float(cfg.optim.betas[1])
    rho_t, r_t = radam_rectification(step, beta2)
    scalars["radam/rho_t"], scalars["radam/rectified"] = rho_t, float(r_t is not None)
    scalars.pop("radam/r_t", None)
    if r_t is not None:
        scalars["radam/r_t"] = r_t
    if facts.has_rectification:
        scalars["radam/effective_lr"] = lr * (r_t or 0.0)
    if before_step and groups:  # the same variance over the transformer blocks only (never-hit embedding rows: 1/eps)
        blocks = [(n, p) for n, p in named if re.search(r"\.\d+\.", n)]
        sub = collect_diagnostics(blocks, None, step=step, lr=lr, betas=betas, eps=eps, **reads.as_kwargs()) if blocks else {}
        if "adam/step_size_var" in sub:
            scalars["adam/step_size_var_blocks"] = sub["adam/step_size_var"]
            scalars["adam/step_size_mean_blocks"] = sub["adam/step_size_mean"]
    hist: dict[str, Any] = {}
    counts, edges = gradient_histogram(named, bins=bins, log10_abs=True, get_grad=reads.get_grad)
    if len(counts):
        hist["grad_log10_counts"], hist["grad_log10_edges"] = counts.tolist(), edges.tolist()
        logger.log_histogram(step, "diag/grad_log10_abs", counts=counts, edges=edges)
    if before_step and facts.adam_update and groups:
        coef = engine.clip_coefficient(scalars.get("grad_norm", 0.0))
        by_param = {id(q): grp for grp in groups for q in grp["params"]}
        todo = [(p, g, reads.get_state(p)) for _, p in named if (g := reads.get_grad(p)) is not None and id(p) in by_param]
        steps_done = _read_steps([(st or {}).get("step", 0) for _, _, st in todo], default=0)  # one read for all
        updates = {
            id(p): adam_update(p, g * coef, st, by_param[id(p)], radam=facts.has_rectification, steps_done=t)
            for (p, g, st), t in zip(todo, steps_done, strict=True)
        }
        counts, edges = gradient_histogram(named, bins=bins, log10_abs=True, get_grad=lambda q: updates.get(id(q)))
        if len(counts):
            hist["update_log10_counts"], hist["update_log10_edges"] = counts.tolist(), edges.tolist()
            logger.log_histogram(step, "diag/update_log10_abs", counts=counts, edges=edges)
    logger.log(step, {**scalars, **hist}, split="diag")
    return scalars
