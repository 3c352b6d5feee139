"""Full views of ZeRO-partitioned parameters -- gradient, optimizer state, fp32 value -- for diagnostics
(``DeepSpeedEngine.parameter_reads``), through DeepSpeed's ``safe_get_full_*`` API."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["deepspeed_getters"]


def deepspeed_getters(
    zero_optimizer: Any = None, state_keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
) -> dict[str, Any]:
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
