"""GPT-2 (Radford et al. 2019): decoder-only causal language model.

h_0 = E_token[x] + E_pos[t]; N pre-LN blocks with causal self-attention (position t attends to
positions <= t); final LN; logits = LN(h_N) E_token^T (tied). Loss = mean CE(logits_t, y_t) over
labels != -100, where the collator already shifted the labels (y_t = x_{t+1}).
State-dict layout maps 1:1 onto ``transformers.GPT2LMHeadModel`` (see ``models.hf``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from core.families.gpt import GPTConfig

from . import init as inits
from .bert import masked_mean_cross_entropy
from .layers import Block, SinusoidalPositionEmbedding, attention_mask_for_sdpa, make_norm, run_blocks
from .layers import set_activation_checkpointing as _set_ckpt
from .registry import register_module
from .vocab import pad_vocab_rows_

__all__ = ["GPTConfig", "GPT", "chunked_lm_loss"]


class GPT(nn.Module):
    """Causal LM; ``forward`` follows docs/interfaces.md, ``generate`` samples for a quick look."""

    config_class = GPTConfig
    family = "gpt"

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)  # padded after init (models.vocab)
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
        pad_vocab_rows_(self.wte, cfg.vocab_size, cfg.padded_vocab_size)
        self.tie_weights()
        pad_vocab_rows_(self.lm_head, cfg.vocab_size, cfg.padded_vocab_size)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight

    def set_activation_checkpointing(self, enabled: bool = True, layers=None) -> None:
        _set_ckpt(self.blocks, enabled, layers)

    def hidden_states(self, input_ids, attention_mask=None) -> torch.Tensor:
        """The final-LN states ``[B, T, d]`` (``GPT2Model``'s ``last_hidden_state``): what a task head reads."""
        return self(input_ids, attention_mask, hidden_only=True)["hidden_states"]

    def forward(self, input_ids, attention_mask=None, labels=None, *, hidden_only: bool = False) -> dict[str, torch.Tensor]:
        # The trunk stays in this frame: compiled around per-block graphs (model.compile_regions), the model is then one
        # graph before the blocks and one after them; a nested call would cut the part after them in two.
        T = input_ids.shape[1]
        if T > self.config.max_position_embeddings:
            raise ValueError(
                f"Sequence length {T} exceeds max_position_embeddings={self.config.max_position_embeddings}."
            )
        mask, is_causal = attention_mask_for_sdpa(attention_mask, T, causal=True)
        positions = torch.arange(T, device=input_ids.device)
        h = self.drop(self.wte(input_ids) + self.wpe(positions)[None])
        h = self.ln_f(run_blocks(self.blocks, h, mask, is_causal))
        if hidden_only:
            return {"hidden_states": h}
        training_step = labels is not None and self.training and torch.is_grad_enabled()
        if training_step and self.config.loss_chunk_tokens:
            # Memory-lean training step: the loss without the full logits (not returned: none exist).
            return {"loss": chunked_lm_loss(h, self.lm_head.weight, labels, self.config.vocab_size,
                                            self.config.loss_chunk_tokens)}
        # The padded rows' logits are dropped here (a view): they never reach the loss or sampling.
        logits = self.lm_head(h)[..., : self.config.vocab_size]
        if labels is None:
            return {"logits": logits}
        loss = masked_mean_cross_entropy(logits, labels)
        if training_step and not self.config.train_logits:
            # Under torch.compile every output that requires grad gets a gradient in backward, zeros when
            # unused: [B, T, V] allocated, filled and read per step (GPT-2 small, 16 x 1024: 1.6 GB in bf16).
            return {"loss": loss}
        return {"logits": logits, "loss": loss}

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


def _chunk_loss_sum(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    logits = nn.functional.linear(h, weight)[:, :vocab_size]
    return nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")


def chunked_lm_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_size: int, chunk: int) -> torch.Tensor:
    """``masked_mean_cross_entropy(h @ weight[:vocab_size].T, labels)`` computed ``chunk`` positions at a time.

    Each chunk's logits (bf16 and their fp32 copy: ~6 B x chunk x V) live only inside the chunk; backward
    recomputes them (activation checkpointing), so the step holds no [B*T, V] tensor at the price of one
    more LM-head matmul. Sums per chunk, then one division: equal to the one-shot loss up to fp32
    summation order (not bitwise), which is why it is an option (``GPTConfig.loss_chunk_tokens``).
    """
    flat_h, flat_y = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for start in range(0, flat_y.numel(), chunk):
        part = slice(start, start + chunk)
        total = total + checkpoint(_chunk_loss_sum, flat_h[part], weight, flat_y[part], vocab_size, use_reentrant=False)
    return total / (flat_y != -100).sum().clamp(min=1)


register_module("gpt", GPT)
