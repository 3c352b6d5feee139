"""The one transformer core shared by BERT, GPT and ViT.

A block is attention + MLP, each wrapped in a residual connection with LayerNorm either after the
sum (post-LN, Vaswani et al. 2017 / BERT: ``x = LN(x + F(x))``) or before the sublayer (pre-LN,
GPT-2 / ViT / Xiong et al. 2020 "On Layer Normalization in the Transformer Architecture":
``x = x + F(LN(x))``). T-Fixup (Huang et al. 2020) removes the LayerNorms altogether, so a model
built with ``init="t-fixup"`` gets ``nn.Identity`` in their place.

Attention is Attention(Q, K, V) = softmax(Q K^T / sqrt(d_head) + mask) V (Vaswani et al., eq. 1),
computed by ``torch.nn.functional.scaled_dot_product_attention`` so PyTorch picks the flash /
memory-efficient kernel. Q, K and V come from one fused ``[3d, d]`` projection (rows in that order).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from core.families.transformer import TransformerConfig

__all__ = [
    "TransformerConfig",
    "SelfAttention",
    "MLP",
    "Block",
    "SinusoidalPositionEmbedding",
    "sinusoidal_table",
    "make_norm",
    "attention_mask_for_sdpa",
    "set_activation_checkpointing",
    "run_blocks",
    "loop_blocks",
    "ONE_GRAPH_PER_BLOCK",
]

def make_norm(cfg: TransformerConfig) -> nn.Module:
    """LayerNorm, or Identity when T-Fixup removed normalization."""
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps) if cfg.use_layer_norm else nn.Identity()


def attention_mask_for_sdpa(
    attention_mask: torch.Tensor | None, seq_len: int, causal: bool
) -> tuple[torch.Tensor | None, bool]:
    """Turn a ``[B, T]`` 1/0 padding mask into SDPA's boolean ``[B, 1, Tq, Tk]`` (True = attend).

    Returns ``(mask, is_causal)``: without padding the causal case uses SDPA's ``is_causal`` flag so
    the flash kernel stays eligible; with padding the causal triangle is folded into the mask.
    """
    if attention_mask is None:
        return None, causal
    keep = attention_mask.to(torch.bool)[:, None, None, :]
    if causal:
        tri = torch.ones(seq_len, seq_len, dtype=torch.bool, device=attention_mask.device).tril()
        # Each position may always see itself, so a left-padded query row is never fully masked
        # (an all-masked row gives NaN in some fused kernels); real tokens never see padding.
        keep = (keep & tri) | torch.eye(seq_len, dtype=torch.bool, device=attention_mask.device)
    return keep, False


class SelfAttention(nn.Module):
    """Multi-head self-attention with a fused QKV projection (Vaswani et al. 2017, eq. 1 and 4)."""

    def __init__(self, hidden_size: int, num_heads: int, dropout: float, bias: bool = True):
        super().__init__()
        self.num_heads = num_heads
        self.dropout = dropout
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=bias)
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        B, T, C = x.shape
        # split + view, not view + unbind: the same strided views, but autograd then joins the three gradients with
        # one cat straight into [B, T, 3C], where unbind's backward stacks them and copies the stack into that layout
        # -- one more pass over the QKV gradient per layer (docs/benchmarks.md, model_step)
        q, k, v = (t.view(B, T, self.num_heads, C // self.num_heads).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=self.dropout if self.training else 0.0, is_causal=is_causal
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    """Position-wise feed-forward FFN(x) = W2 GELU(W1 x + b1) + b2 (Hendrycks & Gimpel 2016 GELU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str):
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, intermediate_size)
        self.fc2 = nn.Linear(intermediate_size, hidden_size)
        self.approximate = "tanh" if activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class Block(nn.Module):
    """One residual transformer layer; post-LN or pre-LN per ``cfg.norm_placement``.

    post-LN: h = LN1(x + Drop(Attn(x)));  y = LN2(h + Drop(MLP(h)))
    pre-LN:  h = x + Drop(Attn(LN1(x)));  y = h + Drop(MLP(LN2(h)))
    ``checkpointing`` recomputes this block in backward (activation checkpointing) when training.
    """

    def __init__(self, cfg: TransformerConfig, qkv_bias: bool = True):
        super().__init__()
        self.attn = SelfAttention(cfg.hidden_size, cfg.num_heads, cfg.attention_dropout, bias=qkv_bias)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.activation)
        self.norm1 = make_norm(cfg)
        self.norm2 = make_norm(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.pre_norm = cfg.norm_placement == "pre"
        self.checkpointing = False

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        if self.checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, x, attn_mask, is_causal, use_reentrant=False)
        return self._forward(x, attn_mask, is_causal)

    def _forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.dropout(self.attn(self.norm1(x), attn_mask, is_causal))
            return x + self.dropout(self.mlp(self.norm2(x)))
        x = self.norm1(x + self.dropout(self.attn(x, attn_mask, is_causal)))
        return self.norm2(x + self.dropout(self.mlp(x)))


def sinusoidal_table(num_positions: int, dim: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)) (Vaswani et al. §3.5)."""
    pos = torch.arange(num_positions, dtype=torch.float64)[:, None]
    inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    table = torch.zeros(num_positions, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * inv_freq)
    table[:, 1::2] = torch.cos(pos * inv_freq)[:, : dim // 2]
    return table.float()


class SinusoidalPositionEmbedding(nn.Module):
    """Fixed sinusoidal positions, looked up like ``nn.Embedding``; the table is a non-persistent buffer."""

    def __init__(self, num_positions: int, dim: int):
        super().__init__()
        self.register_buffer("weight", sinusoidal_table(num_positions, dim), persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions, self.weight)


def set_activation_checkpointing(blocks: nn.ModuleList, enabled: bool = True, layers=None) -> None:
    """Switch recomputation on/off for every block, or only for block indices in ``layers``."""
    chosen = set(range(len(blocks))) if layers is None else set(layers)
    for i, block in enumerate(blocks):
        block.checkpointing = bool(enabled) and i in chosen


#: The attribute ``pipelines.engine.model_build.compile_each_block_`` sets on a model's ``blocks`` once each block is
#: compiled on its own: ``loop_blocks`` wrapped in ``torch.compiler.disable``, which ``run_blocks`` then calls.
ONE_GRAPH_PER_BLOCK = "one_graph_per_block"


def run_blocks(blocks: nn.ModuleList, x: torch.Tensor, *args) -> torch.Tensor:
    """``x`` through every block in order (the loop of every model here). Traced by ``torch.compile`` it is part of
    the model's one graph; once the blocks are compiled one by one (``ONE_GRAPH_PER_BLOCK``), the loop stays out of
    the model's graph, which then ends before the first block and resumes after the last, so the backward is one
    autograd node per block and each block's gradients are ready as soon as its own backward ends."""
    outside_the_graph = getattr(blocks, ONE_GRAPH_PER_BLOCK, None)
    if outside_the_graph is not None:
        return outside_the_graph(blocks, x, *args)
    return loop_blocks(blocks, x, *args)


def loop_blocks(blocks: nn.ModuleList, x: torch.Tensor, *args) -> torch.Tensor:
    for block in blocks:
        x = block(x, *args)
    return x
