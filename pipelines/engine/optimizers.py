"""The built-in optimizers, registered by name with the facts the rest of the code asks about them.

Torch is imported inside each factory, so that importing this module (which ``OPTIMIZERS`` does on
first use) keeps ``check`` and ``pretrain plan`` torch-free. See ``pipelines.engine.optim`` for the
references, the parameter groups and ``build_optimizer``; a new optimizer is one
``@register_optimizer(name, ...)`` on its factory, here or in any module.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from pipelines.engine.registries import register_optimizer

if TYPE_CHECKING:
    from torch.optim import Optimizer

__all__: list[str] = []


def _cpu_adam(groups: list[dict], cfg: Any, *, adamw_mode: bool) -> Optimizer:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, adamw_mode=adamw_mode)


def _fused_on(device: str, kernel: str = "auto") -> dict[str, bool]:
    """torch's fused Adam(W) kernel on CUDA (``optim.kernel=auto``): one launch per parameter group and
    dtype instead of the foreach path's several (its step counters stay on the device: no host read),
    the same update rule, and a skip decided on the device (``found_inf``: ``DDPEngine``); also as
    DeepSpeed's client optimizer, where it steps the fp32 master partitions. CPU runs keep torch's
    default path unless ``optim.kernel=fused`` (the CPU parity tests compare them bit for bit)."""
    if kernel == "auto":
        return {"fused": True} if str(device).startswith("cuda") else {}
    return {"fused": kernel == "fused"}


@register_optimizer("adam", adam_update=True, deepspeed_cpu_kernel=True)
def _adam(groups: list[dict], cfg: Any, offload: bool, device: str) -> Optimizer:
    """Adam with L2 weight decay (Kingma & Ba 2015): g <- g + lambda w before the moments."""
    if offload:
        return _cpu_adam(groups, cfg, adamw_mode=False)
    import torch

    return torch.optim.Adam(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **_fused_on(device, cfg.kernel))


@register_optimizer("adamw", adam_update=True, deepspeed_cpu_kernel=True)
def _adamw(groups: list[dict], cfg: Any, offload: bool, device: str) -> Optimizer:
    """AdamW (Loshchilov & Hutter 2019): w <- w - lr (m^/(sqrt(v^)+eps) + lambda w)."""
    if offload:
        return _cpu_adam(groups, cfg, adamw_mode=True)
    import torch

    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **_fused_on(device, cfg.kernel))


@register_optimizer("radam", adam_update=True, has_rectification=True)
def _radam(groups: list[dict], cfg: Any, offload: bool, device: str) -> Optimizer:
    """RAdam (Liu et al. 2020, Alg. 2) via torch.optim.RAdam; ``decoupled_weight_decay`` selects AdamW-style decay."""
    import torch

    return torch.optim.RAdam(
        groups,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        decoupled_weight_decay=cfg.decoupled_weight_decay,
    )


@register_optimizer("lamb", layerwise=True)
def _lamb(groups: list[dict], cfg: Any, offload: bool, device: str) -> Optimizer:
    """LAMB (You et al. 2020, Alg. 2): DeepSpeed FusedLamb when training on CUDA, else ``Lamb``."""
    from pipelines.engine.optim import Lamb, use_fused_lamb

    if use_fused_lamb(device, offload):
        try:
            from deepspeed.ops.lamb import FusedLamb

            return FusedLamb(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, max_coeff=10.0, min_coeff=0.01)
        except Exception as exc:  # the CUDA op could not be built/loaded: the PyTorch path is exact, only slower
            warnings.warn(f"FusedLamb unavailable ({exc}); using the PyTorch Lamb.", stacklevel=3)
    return Lamb(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
