"""The config fields every transformer family shares, and the FLOPs arithmetic of its blocks (torch-free).

``models.layers`` builds the blocks from ``TransformerConfig``; each family's spec
(``core.families.bert`` ...) subclasses it and writes its training-FLOPs formula over
``block_matmul_params`` and ``attention_flops`` (the counting conventions are in ``models.flops``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

__all__ = ["TransformerConfig", "block_matmul_params", "attention_flops", "check_pad_multiple", "padded_vocab_size"]

_CHOICES = {
    "activation": ("gelu", "gelu_tanh"),
    "norm_placement": ("post", "pre"),
    "init": ("standard", "t-fixup"),
}


@dataclass(kw_only=True)
class TransformerConfig:
    """Fields every family shares; each family's config subclasses this and adds its own."""

    hidden_size: int = 768  # d_model; the trainer reads it for the Noam schedule
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072  # MLP width d_ff
    activation: Literal["gelu", "gelu_tanh"] = "gelu"  # gelu = erf form (BERT, ViT); gelu_tanh = GPT-2
    hidden_dropout: float = 0.1  # on embeddings and each sublayer output
    attention_dropout: float = 0.1  # on the attention probabilities
    layer_norm_eps: float = 1e-12
    norm_placement: Literal["post", "pre"] = "post"
    init: Literal["standard", "t-fixup"] = "standard"  # t-fixup also removes every LayerNorm
    initializer_range: float = 0.02  # std of the standard normal init

    def __post_init__(self) -> None:
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{type(self).__name__}.{name} must be one of {allowed}, got {getattr(self, name)!r}.")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads}).")
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be >= 1, got {getattr(self, name)}.")

    @property
    def use_layer_norm(self) -> bool:
        return self.init != "t-fixup"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def block_matmul_params(cfg: TransformerConfig) -> int:
    """Matmul weights of all blocks: L (4 d^2 + 2 d d_ff)."""
    d = cfg.hidden_size
    return cfg.num_layers * (4 * d * d + 2 * d * cfg.intermediate_size)


def attention_flops(cfg: TransformerConfig, seq_len: int) -> int:
    """12 L d T per token (training) for Q K^T and A V."""
    return 12 * cfg.num_layers * cfg.hidden_size * seq_len


def check_pad_multiple(multiple: int) -> None:
    """``pad_vocab_multiple`` is a positive integer (1 = no padding; ``models.vocab`` explains the padding)."""
    if not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"pad_vocab_multiple must be an integer >= 1 (1 = no padding, 64 = GPU default), got {multiple!r}.")


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple`` (50257, 64 -> 50304)."""
    check_pad_multiple(multiple)
    return -(-vocab_size // multiple) * multiple
