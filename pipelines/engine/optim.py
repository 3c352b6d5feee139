"""Optimizers by name (Adam, AdamW, RAdam, LAMB) with no weight decay on biases and norm weights.

``build_optimizer(model, cfg, offload=...)`` is the one entry point. It builds two parameter
groups (decay / no decay, see ``no_weight_decay``) and calls the factory registered under
``cfg.name`` (``register_optimizer`` in ``pipelines.engine.registries``; the built-in factories
are in ``pipelines.engine.optimizers``, torch-free so that ``check`` knows their names). The same object works as a DeepSpeed *client optimizer* under every ZeRO stage; the
DeepSpeed config must then carry ``deepspeed_optimizer_fields(cfg, offload=...)`` and must not
have an ``optimizer`` section.

- ``adam``  Kingma & Ba 2015 (arXiv:1412.6980); weight decay is the classic L2 term added to g.
- ``adamw`` Loshchilov & Hutter 2019 (arXiv:1711.05101); decoupled decay w <- w - lr*lambda*w.
- ``radam`` Liu et al. 2020 (arXiv:1908.03265, Algorithm 2), ``torch.optim.RAdam``; L2 decay, or
  decoupled with ``optim.decoupled_weight_decay``. ``core.optim_math.radam_rectification`` gives rho_t and r_t.
- ``lamb``  You et al. 2020 (arXiv:1904.00962, Algorithm 2): DeepSpeed's ``FusedLamb`` when the
  model trains on CUDA (``build_optimizer(..., device=)``), our ``Lamb`` otherwise.

ZeRO-Offload (``offload=True``) maps adam/adamw to ``deepspeed.ops.adam.DeepSpeedCPUAdam``
(``adamw_mode`` = decoupled). RAdam and LAMB have no DeepSpeed CPU kernel: they run as PyTorch
optimizers on the offloaded CPU partitions, which DeepSpeed refuses unless
``zero_force_ds_cpu_optimizer`` is false (``deepspeed_optimizer_fields`` sets it).

Caveat, LAMB under ZeRO >= 1: DeepSpeed flattens every parameter group into one flat fp32
partition per rank before the optimizer sees it, so the layer-wise trust ratio becomes one ratio
per (group, rank partition). Adam/AdamW/RAdam are element-wise and unaffected.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from core.config import ConfigError
from pipelines.engine.config import OptimConfig
from pipelines.engine.registries import OPTIMIZERS, register_optimizer

__all__ = [
    "OPTIMIZERS",
    "register_optimizer",
    "list_optimizers",
    "no_weight_decay",
    "param_groups",
    "build_optimizer",
    "use_fused_lamb",
    "deepspeed_optimizer_fields",
    "lamb_trust_ratio",
    "Lamb",
]


# Norm layers are recognised by these name fragments (lower-cased), e.g. BERT's ``LayerNorm``,
# GPT-2's ``ln_1``/``ln_f``, ``norm1``, ``final_norm``.
_NORM_FRAGMENTS = ("norm", "ln_", "ln.")


def list_optimizers() -> list[str]:
    return OPTIMIZERS.names()


# --------------------------------------------------------------------------------------------
# Parameter groups
# --------------------------------------------------------------------------------------------


def no_weight_decay(name: str, param: torch.Tensor, extra: Iterable[str] = ()) -> bool:
    """True when ``param`` must not be decayed.

    Rule: ``ndim < 2`` (biases, norm gains, scalars) or the name ends with ``bias`` or a name
    component contains a norm fragment (``norm``, ``ln_``) or the name is in ``extra`` (a model's
    ``no_weight_decay()`` set, the timm convention, e.g. ViT's ``cls_token``/``pos_embed``).
    Embedding matrices (2-D) are decayed, as in BERT.
    """
    lowered = name.lower()
    if param.ndim < 2 or lowered.endswith("bias") or name in set(extra):
        return True
    parts = lowered.split(".")[:-1]  # module path without the tensor's own name
    return any(frag in part + "." for part in parts for frag in _NORM_FRAGMENTS)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """``[{"params": decayed, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]``, empty groups dropped.

    Frozen parameters (``requires_grad=False``) are left out. Each group also carries
    ``"group_name"`` ("decay" / "no_decay"), which torch and DeepSpeed keep untouched.
    """
    extra = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if no_weight_decay(name, p, extra) else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "group_name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "group_name": "no_decay"},
    ]
    return [g for g in groups if g["params"]]


# --------------------------------------------------------------------------------------------
# RAdam rectification and the LAMB trust ratio (pure functions, shared with diagnostics)
# --------------------------------------------------------------------------------------------


def lamb_trust_ratio(w_norm: float, u_norm: float, *, min_ratio: float = 0.01, max_ratio: float = 10.0) -> float:
    """phi(||w||) / ||u|| with phi the identity, clamped to [min_ratio, max_ratio]; 1 if either norm is 0.

    You et al. 2020 (arXiv:1904.00962), Algorithm 2; the clamp bounds are FusedLamb's
    ``min_coeff``/``max_coeff`` defaults, so both LAMB paths agree.
    """
    if w_norm <= 0.0 or u_norm <= 0.0:
        return 1.0
    return min(max(w_norm / u_norm, min_ratio), max_ratio)


class Lamb(torch.optim.Optimizer):
    """LAMB, You et al. 2020 (arXiv:1904.00962), Algorithm 2, per parameter tensor:

        m_t = b1 m + (1 - b1) g,        v_t = b2 v + (1 - b2) g^2
        m^ = m_t / (1 - b1^t),          v^ = v_t / (1 - b2^t)        (if bias_correction)
        u  = m^ / (sqrt(v^) + eps) + lambda w
        w <- w - lr * trust * u,        trust = clamp(||w|| / ||u||, min, max), 1 if a norm is 0

    The last trust ratio of each tensor is kept in ``state[p]["trust_ratio"]`` for diagnostics.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        *,
        bias_correction: bool = True,
        min_trust_ratio: float = 0.01,
        max_trust_ratio: float = 10.0,
    ) -> None:
        if lr <= 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid Lamb hyper-parameters lr={lr} betas={betas} eps={eps} wd={weight_decay}")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            min_trust_ratio=min_trust_ratio,
            max_trust_ratio=max_trust_ratio,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                grad = p.grad.float()
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                if group["bias_correction"]:
                    m_hat, v_hat = m / (1.0 - beta1**t), v / (1.0 - beta2**t)
                else:
                    m_hat, v_hat = m, v
                w = p.float()
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"] != 0.0:
                    update.add_(w, alpha=group["weight_decay"])
                ratio = lamb_trust_ratio(
                    float(torch.linalg.vector_norm(w)),
                    float(torch.linalg.vector_norm(update)),
                    min_ratio=group["min_trust_ratio"],
                    max_ratio=group["max_trust_ratio"],
                )
                state["trust_ratio"] = torch.tensor(ratio)
                p.add_(update.to(p.dtype), alpha=-group["lr"] * ratio)
        return loss


# --------------------------------------------------------------------------------------------
# Kernel choice (the registered factories live in pipelines/engine/optimizers.py, torch-free)
# --------------------------------------------------------------------------------------------


def use_fused_lamb(device: str, offload: bool) -> bool:
    """FusedLamb (one CUDA kernel per step) when the parameters train on CUDA and are not offloaded;
    the per-tensor PyTorch ``Lamb`` syncs with the host twice per tensor there."""
    return device == "cuda" and not offload


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, *, offload: bool = False, device: str | torch.device | None = None
) -> torch.optim.Optimizer:
    """The optimizer ``cfg.name`` over ``param_groups(model, cfg.weight_decay)``.

    ``device``: where the model will train (the trainer passes its target device, since the
    optimizer is built before ``accelerate.prepare`` moves the model); None = where the parameters
    are now. It picks kernels (FusedLamb on CUDA). ``offload=True`` is DeepSpeed ZeRO-Offload of
    the optimizer (``distributed.offload_optimizer``).
    """
    spec = OPTIMIZERS.lookup(cfg.name)
    groups = param_groups(model, cfg.weight_decay)
    if not groups:
        raise ConfigError("The model has no trainable parameters to optimize.")
    if device is None:
        device = next(p.device for g in groups for p in g["params"])
    return spec.factory(groups, cfg, offload, torch.device(device).type)


def deepspeed_optimizer_fields(cfg: OptimConfig, *, offload: bool = False) -> dict:
    """Top-level DeepSpeed config entries needed to run ``build_optimizer``'s result as a client optimizer.

    - ``zero_allow_untested_optimizer: true``: ZeRO asserts on optimizers outside its tested list
      (torch Adam/AdamW, FusedAdam, DeepSpeedCPUAdam, ...), which RAdam, Lamb and FusedLamb are.
    - ``zero_force_ds_cpu_optimizer: false`` with offload for radam/lamb: otherwise ZeRO-Offload
      refuses any optimizer but DeepSpeedCPUAdam.
    - ``gradient_clipping``: under DeepSpeed the engine clips (``optim.grad_clip``, 0 = off).
    The config must not contain an ``optimizer`` section (DeepSpeed would build its own).
    """
    fields: dict = {"zero_allow_untested_optimizer": True, "gradient_clipping": float(cfg.grad_clip)}
    if offload and not OPTIMIZERS.lookup(cfg.name).deepspeed_cpu_kernel:
        fields["zero_force_ds_cpu_optimizer"] = False
    return fields
