"""Learning-rate schedules: a warmup factor times a decay, as pure functions of the step.

The LR used for the optimizer update with 0-based index ``step`` is::

    lr(step) = base_lr * multiplier(step),    multiplier(step) = omega(t) * delta(t),    t = step + 1

``t = step + 1`` is the number of the update being taken (1 for the first). With it a linear
warmup gives the very first update a non-zero LR (``1/tau``) and reaches the full LR at update
``tau`` (``step = tau - 1``). ``torch.optim.lr_scheduler.LambdaLR`` calls the multiplier with
``last_epoch``, which is exactly this 0-based ``step`` (0 at construction, +1 per ``sched.step()``).

Warmup factors omega(t) (``register_warmup``) each declare where the warmup *ends*; the decay
delta(t) (``register_decay``) starts there:

=====================  ==========================================  ===========================
warmup                 omega(t)                                    decay starts at t =
=====================  ==========================================  ===========================
none                   1                                           0
linear                 min(1, t / tau)                             tau
exponential            1 - exp(-t / tau)                           0 (whole run, multiplied)
untuned_exponential    1 - exp(-t (1 - beta2))                     0 (whole run, multiplied)
untuned_linear         min(1, t (1 - beta2) / 2)                   2 / (1 - beta2)
noam                   d^-0.5 min(t^-0.5, t w^-1.5) / base_lr      w
=====================  ==========================================  ===========================

The exponential warmups never reach 1 exactly, so they have no end: their decay runs over the
whole run and is multiplied with the warmup factor from t = 0 (Ma & Yarats 2019 use them the same
way, as a multiplicative factor on any schedule).

Noam (Vaswani et al. 2017, eq. 3) is an *absolute* LR; its factor is divided by ``base_lr`` so that
``base_lr * multiplier`` is exactly the paper's LR: ``optim.lr`` is then not a knob (the width
``d_model`` and ``w`` set the peak ``d^-0.5 w^-0.5`` at t = w). Noam already decays as t^-0.5 after
w, so use ``decay: constant`` for the paper's schedule; any other decay multiplies on top from w.

Decays delta(t) with ``s`` = the warmup end, ``T`` = total_steps, ``m`` = min_lr_ratio and the
progress ``p = clip((t - s) / (T - s), 0, 1)`` (p = 1 at the final update t = T):

- constant:     1
- linear:       m + (1 - m) (1 - p)
- cosine:       m + (1 - m) (1 + cos(pi p)) / 2            (Loshchilov & Hutter 2017, SGDR, no restarts)
- polynomial:   m + (1 - m) (1 - p)^power
- inverse_sqrt: max(m, sqrt(max(s, 1) / t)) for t > s, else 1   (Vaswani et al. 2017; Devlin/T5 style)

Schedules hold no state: a checkpoint needs only the step (LambdaLR's ``last_epoch``). The
function returned by ``build_schedule`` is a plain function, so ``LambdaLR.state_dict`` stores
nothing of it and a resumed run rebuilds it from the config.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from core.config import ConfigError
from pipelines.engine.config import ScheduleConfig
from pipelines.engine.registries import DECAYS, WARMUPS

__all__ = [
    "ScheduleContext",
    "WarmupSpec",
    "WARMUPS",
    "DECAYS",
    "register_warmup",
    "register_decay",
    "list_warmups",
    "list_decays",
    "warmup_end",
    "build_schedule",
]


@dataclass(frozen=True, kw_only=True)
class ScheduleContext:
    """Everything a warmup or decay may read; built once by ``build_schedule``."""

    base_lr: float
    total_steps: int
    warmup_steps: int = 0
    beta2: float = 0.999
    d_model: int = 0
    min_lr_ratio: float = 0.0
    power: float = 1.0


WarmupFn = Callable[[int, ScheduleContext], float]
DecayFn = Callable[[int, int, ScheduleContext], float]


@dataclass(frozen=True)
class WarmupSpec:
    """A registered warmup: ``factor(t, ctx)`` and ``end(ctx)`` (the t at which the decay starts)."""

    factor: WarmupFn
    end: Callable[[ScheduleContext], int]




def register_warmup(name: str, *, end: Callable[[ScheduleContext], int] = lambda ctx: 0):
    """Register ``fn(t, ctx) -> omega`` under ``name``; ``end(ctx)`` is where the decay starts."""

    def deco(fn: WarmupFn) -> WarmupFn:
        WARMUPS.register(name, WarmupSpec(fn, end))
        return fn

    return deco


def register_decay(name: str):
    """Register ``fn(t, start, ctx) -> delta`` under ``name``."""

    def deco(fn: DecayFn) -> DecayFn:
        DECAYS.register(name, fn)
        return fn

    return deco


def list_warmups() -> list[str]:
    return sorted(WARMUPS)


def list_decays() -> list[str]:
    return sorted(DECAYS)


# --------------------------------------------------------------------------------------------
# Warmup factors omega(t), t = step + 1
# --------------------------------------------------------------------------------------------


@register_warmup("none")
def warmup_none(t: int, ctx: ScheduleContext) -> float:
    """omega(t) = 1: no warmup (the baseline of Ma & Yarats 2019, arXiv:1910.04209)."""
    return 1.0


@register_warmup("linear", end=lambda ctx: ctx.warmup_steps)
def warmup_linear(t: int, ctx: ScheduleContext) -> float:
    """omega(t) = min(1, t / tau), tau = warmup_steps (Goyal et al. 2017, arXiv:1706.02677).

    tau = 0 means no warmup (omega = 1).
    """
    if ctx.warmup_steps <= 0:
        return 1.0
    return min(1.0, t / ctx.warmup_steps)


@register_warmup("exponential")
def warmup_exponential(t: int, ctx: ScheduleContext) -> float:
    """omega(t) = 1 - exp(-t / tau), tau = warmup_steps (Ma & Yarats 2019, arXiv:1910.04209, sec. 5)."""
    return 1.0 - math.exp(-t / ctx.warmup_steps)


@register_warmup("untuned_exponential")
def warmup_untuned_exponential(t: int, ctx: ScheduleContext) -> float:
    """omega(t) = 1 - exp(-t (1 - beta2)), i.e. tau = 1 / (1 - beta2) (Ma & Yarats 2019, sec. 5.1)."""
    return 1.0 - math.exp(-t * (1.0 - ctx.beta2))


def _untuned_linear_end(ctx: ScheduleContext) -> int:
    return math.ceil(2.0 / (1.0 - ctx.beta2))


@register_warmup("untuned_linear", end=_untuned_linear_end)
def warmup_untuned_linear(t: int, ctx: ScheduleContext) -> float:
    """omega(t) = min(1, t (1 - beta2) / 2), i.e. linear over 2 / (1 - beta2) steps (Ma & Yarats 2019, sec. 5.1)."""
    return min(1.0, t * (1.0 - ctx.beta2) / 2.0)


@register_warmup("noam", end=lambda ctx: ctx.warmup_steps)
def warmup_noam(t: int, ctx: ScheduleContext) -> float:
    """omega(t) = d^-0.5 min(t^-0.5, t w^-1.5) / base_lr (Vaswani et al. 2017, arXiv:1706.03762, eq. 3).

    ``base_lr * omega`` is the paper's absolute LR; its peak is d^-0.5 w^-0.5 at t = w.
    """
    w = ctx.warmup_steps
    return ctx.d_model**-0.5 * min(t**-0.5, t * w**-1.5) / ctx.base_lr


# --------------------------------------------------------------------------------------------
# Decays delta(t), starting at the warmup end s
# --------------------------------------------------------------------------------------------


def _progress(t: int, start: int, ctx: ScheduleContext) -> float:
    """p = clip((t - s) / (T - s), 0, 1); 0 throughout when the warmup fills the run (s >= T)."""
    span = ctx.total_steps - start
    if span <= 0:
        return 0.0
    return min(1.0, max(0.0, (t - start) / span))


@register_decay("constant")
def decay_constant(t: int, start: int, ctx: ScheduleContext) -> float:
    """delta(t) = 1."""
    return 1.0


@register_decay("linear")
def decay_linear(t: int, start: int, ctx: ScheduleContext) -> float:
    """delta(t) = m + (1 - m)(1 - p): linear to min_lr_ratio m at t = T (Devlin et al. 2019, BERT)."""
    m = ctx.min_lr_ratio
    return m + (1.0 - m) * (1.0 - _progress(t, start, ctx))


@register_decay("cosine")
def decay_cosine(t: int, start: int, ctx: ScheduleContext) -> float:
    """delta(t) = m + (1 - m)(1 + cos(pi p)) / 2 (Loshchilov & Hutter 2017, arXiv:1608.03983, eq. 5)."""
    m = ctx.min_lr_ratio
    return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * _progress(t, start, ctx)))


@register_decay("polynomial")
def decay_polynomial(t: int, start: int, ctx: ScheduleContext) -> float:
    """delta(t) = m + (1 - m)(1 - p)^power (the "poly" policy, Chen et al. 2017, arXiv:1606.00915)."""
    m = ctx.min_lr_ratio
    return m + (1.0 - m) * (1.0 - _progress(t, start, ctx)) ** ctx.power


@register_decay("inverse_sqrt")
def decay_inverse_sqrt(t: int, start: int, ctx: ScheduleContext) -> float:
    """delta(t) = max(m, sqrt(max(s, 1) / t)) for t > s, else 1 (Vaswani et al. 2017, eq. 3, after warmup).

    Continuous at the warmup end: delta(s) = 1.
    """
    if t <= start:
        return 1.0
    return max(ctx.min_lr_ratio, math.sqrt(max(start, 1) / t))


# --------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------


def warmup_end(cfg: ScheduleConfig, *, beta2: float = 0.999) -> int:
    """The update number t at which the decay of ``cfg`` starts (see the table in the module doc)."""
    spec = WARMUPS.lookup(cfg.warmup)
    return int(spec.end(ScheduleContext(base_lr=1.0, total_steps=1, warmup_steps=cfg.warmup_steps, beta2=beta2)))


def build_schedule(
    cfg: ScheduleConfig,
    *,
    base_lr: float,
    total_steps: int,
    d_model: int = 0,
    beta2: float = 0.999,
) -> Callable[[int], float]:
    """The LR multiplier of the 0-based ``step``: ``omega(step + 1) * delta(step + 1)``.

    Feed it to ``torch.optim.lr_scheduler.LambdaLR(optimizer, fn)``. ``d_model`` is used by
    ``noam`` when ``cfg.d_model`` is 0; ``beta2`` by the untuned warmups. Unknown names and
    impossible settings raise ``ConfigError``.
    """
    spec = WARMUPS.lookup(cfg.warmup)
    decay = DECAYS.lookup(cfg.decay)
    if total_steps < 1:
        raise ConfigError(f"build_schedule needs total_steps >= 1, got {total_steps}.")
    if base_lr <= 0:
        raise ConfigError(f"optim.lr must be positive, got {base_lr}.")
    if cfg.warmup_steps < 0:
        raise ConfigError(f"schedule.warmup_steps must be >= 0, got {cfg.warmup_steps}.")
    if cfg.warmup in ("exponential", "noam") and cfg.warmup_steps <= 0:
        raise ConfigError(f"schedule.warmup={cfg.warmup} needs schedule.warmup_steps > 0 (its tau / w).")
    if cfg.warmup.startswith("untuned") and not 0.0 < beta2 < 1.0:
        raise ConfigError(f"schedule.warmup={cfg.warmup} needs 0 < beta2 < 1, got {beta2}.")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise ConfigError(f"schedule.min_lr_ratio must be in [0, 1], got {cfg.min_lr_ratio}.")
    if cfg.decay == "polynomial" and cfg.power <= 0:
        raise ConfigError(f"schedule.power must be > 0 for the polynomial decay, got {cfg.power}.")
    width = cfg.d_model or d_model
    if cfg.warmup == "noam" and width <= 0:
        raise ConfigError("schedule.warmup=noam needs the model width: set schedule.d_model (or pass d_model).")

    ctx = ScheduleContext(
        base_lr=base_lr,
        total_steps=total_steps,
        warmup_steps=cfg.warmup_steps,
        beta2=beta2,
        d_model=width,
        min_lr_ratio=cfg.min_lr_ratio,
        power=cfg.power,
    )
    start = int(spec.end(ctx))
    factor = spec.factor

    def multiplier(step: int) -> float:
        t = step + 1
        return factor(t, ctx) * decay(t, start, ctx)

    multiplier.warmup_end = start  # type: ignore[attr-defined]  # for reports; not checkpointed
    return multiplier
