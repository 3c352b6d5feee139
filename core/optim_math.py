"""Closed-form quantities of the adaptive optimizers, torch-free.

The RAdam rectification term is read by three places that must agree: the diagnostics logged
during training (``monitoring.diagnostics``), the warmup study's effective-LR curves
(``pipelines.study.analysis``) and the optimizer tests; keeping it at the bottom layer lets all
of them import it without importing the training engine.
"""

from __future__ import annotations

import math

__all__ = ["radam_rectification"]


def radam_rectification(step: int, beta2: float) -> tuple[float, float | None]:
    """RAdam's (rho_t, r_t) after ``step`` updates (Liu et al. 2020, arXiv:1908.03265, eqs. 5-6 and Alg. 2).

    rho_inf = 2 / (1 - beta2) - 1,  rho_t = rho_inf - 2 t beta2^t / (1 - beta2^t),
    r_t = sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t)) when rho_t > 5
    (torch.optim.RAdam's threshold; the paper uses 4), else None: the update is then un-adapted
    SGD with momentum. ``step`` is t >= 1 (the update being taken).
    """
    if step < 1:
        raise ValueError(f"radam_rectification needs step >= 1, got {step}")
    rho_inf = 2.0 / (1.0 - beta2) - 1.0
    beta2_t = beta2**step
    rho_t = rho_inf - 2.0 * step * beta2_t / (1.0 - beta2_t)
    if rho_t <= 5.0:
        return rho_t, None
    r_t = math.sqrt((rho_t - 4.0) * (rho_t - 2.0) * rho_inf / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t))
    return rho_t, r_t
