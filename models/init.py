"""Weight initialization: each family's standard scheme and T-Fixup.

Standard (what the reference implementations do, so a fresh model is statistically the release's):
- BERT (Devlin et al. 2019; HF ``BertPreTrainedModel._init_weights``): every Linear and Embedding
  ~ N(0, 0.02), biases 0, LayerNorm (1, 0), padding row 0.
- GPT-2 (Radford et al. 2019, §2.3): as BERT, plus the projections that write into the residual
  stream (attention output, MLP fc2) ~ N(0, 0.02 / sqrt(2 N)), "scale the weights of residual
  layers at initialization by a factor of 1/sqrt(N)" with N residual layers = 2 per block.
- ViT (Dosovitskiy et al. 2021; timm/HF): truncated normal(0.02) for Linear/Conv, [CLS] and positions.

T-Fixup (Huang et al. 2020, "Improving Transformer Optimization Through Better Initialization", §3.3):
LayerNorms removed (done by the model: ``init="t-fixup"`` builds ``nn.Identity`` norms), Xavier
uniform for every matrix except input embeddings, input embeddings ~ N(0, d^-1/2), then the value
projection v, the attention output projection w and both MLP matrices of every block — and the
input embeddings — are multiplied by 0.67 N^-1/4 (N = number of blocks).

Our rule for decoder-only stacks (GPT): the paper's (9N)^-1/4 decoder factor comes from decoder
blocks in an encoder-decoder having *three* residual sublayers (self-attention, cross-attention,
MLP). A decoder-only block has the encoder's two (self-attention + MLP); the causal mask changes
which positions mix but not the residual depth the update bound sums over, so GPT uses the
encoder factor 0.67 N^-1/4 too. ViT: [CLS] and positions are the input embeddings; the patch
projection is a matrix (Xavier) that produces them, so it is scaled by the same factor.
Task heads (MLM transform, pooler, classifiers) get Xavier only; BERT's MLM-head LayerNorm sits
outside the residual stack and is kept.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .layers import Block

__all__ = ["init_normal_", "scale_residual_projections_", "t_fixup_", "t_fixup_scale"]


@torch.no_grad()
def init_normal_(model: nn.Module, std: float = 0.02, truncated: bool = False) -> None:
    """N(0, std) (or truncated at ±2 std) for Linear/Conv/Embedding weights, zero biases, LayerNorm (1, 0)."""

    def normal(t: torch.Tensor) -> None:
        if truncated:
            nn.init.trunc_normal_(t, std=std, a=-2 * std, b=2 * std)
        else:
            nn.init.normal_(t, std=std)

    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            normal(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            normal(m.weight)
            if m.padding_idx is not None:
                m.weight[m.padding_idx].zero_()
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


@torch.no_grad()
def scale_residual_projections_(model: nn.Module, num_layers: int, std: float = 0.02) -> None:
    """GPT-2: residual-writing projections ~ N(0, std / sqrt(2 * num_layers))."""
    for m in model.modules():
        if isinstance(m, Block):
            for w in (m.attn.proj.weight, m.mlp.fc2.weight):
                nn.init.normal_(w, std=std / math.sqrt(2 * num_layers))


def t_fixup_scale(num_layers: int) -> float:
    """0.67 N^-1/4, the T-Fixup encoder factor (Huang et al. 2020, eq. 9 and Algorithm step 3)."""
    return 0.67 * num_layers**-0.25


@torch.no_grad()
def t_fixup_(model: nn.Module, num_layers: int, dim: int, embeddings: list[torch.Tensor] | None = None) -> None:
    """Apply T-Fixup in place (``dim`` = d_model). ``embeddings``: input-embedding tensors (default: every nn.Embedding weight).

    Order matters for tied output projections: matrices get Xavier first, embeddings last, so a
    decoder tied to the token embedding ends up with the embedding init, as in the paper.
    """
    scale = t_fixup_scale(num_layers)
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    for m in model.modules():
        if isinstance(m, Block):  # fused QKV: Xavier per [d, d] slice, as for separate projections
            for w in m.attn.qkv.weight.chunk(3, dim=0):
                nn.init.xavier_uniform_(w)
            d = m.attn.qkv.weight.shape[1]
            m.attn.qkv.weight[2 * d :].mul_(scale)  # v
            m.attn.proj.weight.mul_(scale)  # w
            m.mlp.fc1.weight.mul_(scale)
            m.mlp.fc2.weight.mul_(scale)
    if embeddings is None:
        embeddings = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    for w in embeddings:
        nn.init.normal_(w, std=dim**-0.5)
        w.mul_(scale)
