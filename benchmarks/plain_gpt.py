"""The baseline of issue #30: GPT-2 as a plain PyTorch loop would write it, to time our model against.

Written for this benchmark (not a copy of any project): pre-LN blocks, one fused QKV projection,
``scaled_dot_product_attention(is_causal=True)``, tanh GELU, learned positions, final LayerNorm, LM
head tied to the token embedding, the vocabulary padded to a multiple of 64 and the loss taken over
the padded logits (the padded rows only learn to lose), no dropout, no masks, no options. What our
model does beyond it (slicing the logits to the tokenizer's vocabulary, a float32 loss of the sum
over labels != -100, the attention-mask and checkpointing switches) is what ``model_step.py --plain``
measures. Same parameter count and FLOPs as ours at the same sizes.

    from benchmarks.plain_gpt import PlainGPT
    model = PlainGPT.like(ours.config)          # the same sizes as one of our GPT configs
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class PlainBlock(nn.Module):
    """A transformer block; GPT-2's by default (pre-LN, causal, tanh GELU, no dropout), ViT's with ``causal=False,
    gelu="none"`` and the paper's dropout on each sublayer's output (``plain_vit.py``), BERT's post-LN with
    ``post_norm=True``, attention dropout and a padding mask (``plain_bert.py``)."""

    def __init__(self, width: int, heads: int, ffn: int, *, causal: bool = True, gelu: str = "tanh",
                 dropout: float = 0.0, attn_dropout: float = 0.0, eps: float = 1e-5, post_norm: bool = False):
        super().__init__()
        self.heads, self.causal, self.gelu, self.attn_dropout, self.post_norm = heads, causal, gelu, attn_dropout, post_norm
        self.ln1, self.ln2 = nn.LayerNorm(width, eps=eps), nn.LayerNorm(width, eps=eps)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, ffn), nn.Linear(ffn, width)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    def attend(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if self.causal and mask is not None:
            raise ValueError("A causal plain block takes no padding mask (GPT-2's plain loop trains on packed windows).")
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal,
                                           dropout_p=self.attn_dropout if self.training else 0.0)
        return self.drop(self.out(y.transpose(1, 2).contiguous().view(B, T, C)))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(F.gelu(self.up(x), approximate=self.gelu)))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.post_norm:
            x = self.ln1(x + self.attend(x, mask))
            return self.ln2(x + self.mlp(x))
        x = x + self.attend(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class PlainGPT(nn.Module):
    """GPT-2 in plain PyTorch; ``forward(input_ids, labels)`` returns ``{"loss": ...}`` like ours."""

    def __init__(self, vocab: int, positions: int, width: int, layers: int, heads: int, ffn: int, pad_multiple: int = 64):
        super().__init__()
        self.vocab = math.ceil(vocab / pad_multiple) * pad_multiple
        self.wte, self.wpe = nn.Embedding(self.vocab, width), nn.Embedding(positions, width)
        self.blocks = nn.ModuleList(PlainBlock(width, heads, ffn) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, self.vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2's init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers)
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("out.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    @classmethod
    def like(cls, config) -> PlainGPT:
        """The plain model with the sizes of one of our ``GPTConfig`` s."""
        return cls(config.vocab_size, config.max_position_embeddings, config.hidden_size, config.num_layers,
                   config.num_heads, config.intermediate_size)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return {"loss": F.cross_entropy(logits.view(-1, self.vocab), labels.reshape(-1))}
