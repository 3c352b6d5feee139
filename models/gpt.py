"""GPT-2 (Radford et al. 2019): decoder-only causal language model.

h_0 = E_token[x] + E_pos[t]; N pre-LN blocks with causal self-attention (position t attends to
positions <= t); final LN; logits = LN(h_N) E_token^T (tied). Loss = mean CE(logits_t, y_t) over
labels != -100, where the collator already shifted the labels (y_t = x_{t+1}).
State-dict layout maps 1:1 onto ``transformers.GPT2LMHeadModel`` (see ``models.hf``).
"""

from __future__ import annotations

import torch
from torch import nn

from core.families.gpt import GPTConfig

from . import init as inits
from .bert import masked_mean_cross_entropy
from .layers import Block, SinusoidalPositionEmbedding, attention_mask_for_sdpa, make_norm
from .layers import set_activation_checkpointing as _set_ckpt
from .registry import register_module

__all__ = ["GPTConfig", "GPT"]


class GPT(nn.Module):
    """Causal LM; ``forward`` follows docs/interfaces.md, ``generate`` samples for a quick look."""

    config_class = GPTConfig
    family = "gpt"

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.position_embedding == "learned":
            self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        else:
            self.wpe = SinusoidalPositionEmbedding(config.max_position_embeddings, config.hidden_size)
        self.drop = nn.Dropout(config.hidden_dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.num_layers)])
        # Pre-LN needs the final LN (GPT-2 §2.3); a post-LN stack ends normalized already.
        self.ln_f = make_norm(config) if config.norm_placement == "pre" else nn.Identity()
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.init_weights()

    def init_weights(self) -> None:
        cfg = self.config
        if cfg.init == "t-fixup":
            inits.t_fixup_(self, cfg.num_layers, cfg.hidden_size)
        else:
            inits.init_normal_(self, cfg.initializer_range)
            inits.scale_residual_projections_(self, cfg.num_layers, cfg.initializer_range)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight

    def set_activation_checkpointing(self, enabled: bool = True, layers=None) -> None:
        _set_ckpt(self.blocks, enabled, layers)

    def forward(self, input_ids, attention_mask=None, labels=None) -> dict[str, torch.Tensor]:
        T = input_ids.shape[1]
        if T > self.config.max_position_embeddings:
            raise ValueError(
                f"Sequence length {T} exceeds max_position_embeddings={self.config.max_position_embeddings}."
            )
        mask, is_causal = attention_mask_for_sdpa(attention_mask, T, causal=True)
        positions = torch.arange(T, device=input_ids.device)
        h = self.drop(self.wte(input_ids) + self.wpe(positions)[None])
        for block in self.blocks:
            h = block(h, mask, is_causal)
        logits = self.lm_head(self.ln_f(h))
        result = {"logits": logits}
        if labels is not None:
            result["loss"] = masked_mean_cross_entropy(logits, labels)
        return result

    @torch.no_grad()
    def generate(
        self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens (greedy when ``temperature == 0``); no KV cache."""
        was_training = self.training
        self.eval()
        ids = input_ids
        for _ in range(max_new_tokens):
            logits = self(ids[:, -self.config.max_position_embeddings :])["logits"][:, -1, :]
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1, None]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1)
            ids = torch.cat([ids, nxt], dim=1)
        self.train(was_training)
        return ids


register_module("gpt", GPT)
