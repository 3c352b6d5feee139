"""Issue #30's ViT baseline: ViT-B/16 as a plain PyTorch loop would write it, to time our model against.

Written for this benchmark (not a copy of any project), like ``plain_gpt.py``, whose pre-LN block it takes
(non-causal, exact GELU): a strided-conv patch projection, a class token and learned positions, blocks with one
fused QKV projection and ``scaled_dot_product_attention``, dropout where the ViT paper puts it (after the
embedding and on each sublayer's output, at the rate of ours so both compute the same thing), a final LayerNorm
on the class token only, a linear classifier, a cross-entropy loss. No options. Same parameter count and FLOPs
as ours at the same sizes; what ours does beyond it (a resolution-agnostic position lookup, the soft-target and
regression losses, the checkpointing switch, the final LayerNorm over every token, which ``forward_features``
returns) is what ``model_step.py --plain`` measures.

    from benchmarks.plain_vit import PlainViT
    model = PlainViT.like(ours.config)          # the same sizes as one of our ViT configs
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.plain_gpt import PlainBlock


class PlainViT(nn.Module):
    """ViT in plain PyTorch; ``forward(pixel_values, labels)`` returns ``{"loss": ...}`` like ours."""

    def __init__(self, image: int, patch: int, channels: int, width: int, layers: int, heads: int, ffn: int,
                 classes: int, dropout: float = 0.0, eps: float = 1e-12):
        super().__init__()
        self.patch = nn.Conv2d(channels, width, kernel_size=patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, width))
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, width) * 0.02)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(PlainBlock(width, heads, ffn, causal=False, gelu="none", dropout=dropout, eps=eps)
                                    for _ in range(layers))
        self.ln_f = nn.LayerNorm(width, eps=eps)
        self.head = nn.Linear(width, classes)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.trunc_normal_(p, std=0.02, a=-0.04, b=0.04)

    @classmethod
    def like(cls, config) -> PlainViT:
        """The plain model with the sizes (and dropout) of one of our ``ViTConfig`` s."""
        return cls(config.image_size, config.patch_size, config.num_channels, config.hidden_size, config.num_layers,
                   config.num_heads, config.intermediate_size, config.num_labels, config.hidden_dropout,
                   config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.patch(pixel_values).flatten(2).transpose(1, 2)
        x = self.dropout(torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos)
        for block in self.blocks:
            x = block(x)
        return {"loss": F.cross_entropy(self.head(self.ln_f(x[:, 0])), labels)}
