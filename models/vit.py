"""Vision Transformer (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words").

Eq. 1-4: z_0 = [x_class; x_p^1 E; ...; x_p^P E] + E_pos (patch embedding E as a conv with
stride = kernel = patch); z_l = pre-LN blocks; y = LN(z_L^0); logits = W y + b.
When the input resolution differs from ``image_size`` the patch positions are resized by bicubic
interpolation (§3.2 "2D interpolation of the pre-trained position embeddings"), like
``ViTForImageClassification(..., interpolate_pos_encoding=True)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core.families.vit import ViTConfig

from . import init as inits
from .layers import Block, make_norm, run_blocks
from .layers import set_activation_checkpointing as _set_ckpt
from .registry import register_module

__all__ = ["ViTConfig", "ViT"]


class ViT(nn.Module):
    """Image classifier; ``forward(pixel_values, labels=None) -> {"loss"?, "logits"}``."""

    config_class = ViTConfig
    family = "vit"

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.patch_embed = nn.Conv2d(config.num_channels, d, kernel_size=config.patch_size, stride=config.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.zeros(1, config.grid_size**2 + 1, d))
        self.drop = nn.Dropout(config.hidden_dropout)
        self.blocks = nn.ModuleList([Block(config, qkv_bias=config.qkv_bias) for _ in range(config.num_layers)])
        self.norm = make_norm(config) if config.norm_placement == "pre" else nn.Identity()
        self.head = nn.Linear(d, config.num_labels)
        self.init_weights()

    def init_weights(self) -> None:
        cfg = self.config
        if cfg.init == "t-fixup":
            # The patch projection is a matrix (Xavier) that produces the input embeddings, so it gets
            # the paper's input-embedding scale too; [CLS] and positions are embeddings proper.
            inits.t_fixup_(self, cfg.num_layers, cfg.hidden_size, embeddings=[self.cls_token, self.pos_embed])
            with torch.no_grad():
                self.patch_embed.weight.mul_(inits.t_fixup_scale(cfg.num_layers))
        else:
            inits.init_normal_(self, cfg.initializer_range, truncated=True)
            for p in (self.cls_token, self.pos_embed):
                nn.init.trunc_normal_(
                    p, std=cfg.initializer_range, a=-2 * cfg.initializer_range, b=2 * cfg.initializer_range
                )

    def set_activation_checkpointing(self, enabled: bool = True, layers=None) -> None:
        _set_ckpt(self.blocks, enabled, layers)

    def position_embeddings(self, grid_h: int, grid_w: int) -> torch.Tensor:
        """E_pos for a ``grid_h x grid_w`` patch grid; bicubic-resized from the trained grid when it differs."""
        g = self.config.grid_size
        if (grid_h, grid_w) == (g, g):
            return self.pos_embed
        cls_pos, patch_pos = self.pos_embed[:, :1], self.pos_embed[:, 1:]
        d = patch_pos.shape[-1]
        patch_pos = patch_pos.reshape(1, g, g, d).permute(0, 3, 1, 2)
        patch_pos = F.interpolate(patch_pos, size=(grid_h, grid_w), mode="bicubic", align_corners=False)
        return torch.cat([cls_pos, patch_pos.permute(0, 2, 3, 1).reshape(1, grid_h * grid_w, d)], dim=1)

    def forward_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Final-layer token states ``[B, 1 + P, d]`` (after the final LN)."""
        B, _, H, W = pixel_values.shape
        p = self.config.patch_size
        # images arrive as fp32; under DeepSpeed bf16/fp16 the weights are half precision (no autocast there)
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype)).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(B, -1, -1), x], dim=1)
        x = self.drop(x + self.position_embeddings(H // p, W // p))
        x = run_blocks(self.blocks, x)
        return self.norm(x)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.head(self.forward_features(pixel_values)[:, 0])
        result = {"logits": logits}
        if labels is not None:
            if self.config.num_labels == 1:
                result["loss"] = F.mse_loss(logits.squeeze(-1), labels.to(logits.dtype).view(-1))
            elif labels.is_floating_point():  # soft targets, e.g. mixup
                result["loss"] = F.cross_entropy(logits.float(), labels.float())
            else:
                result["loss"] = F.cross_entropy(logits.float(), labels.view(-1))
        return result


register_module("vit", ViT)
