"""Issue #30's BERT baseline: BERT pretraining (MLM + NSP) as a plain PyTorch loop would write it, to time ours against.

Written for this benchmark (not a copy of any project), like ``plain_gpt.py``, whose block it takes in its post-LN
form: token + position + segment embeddings, LayerNorm, dropout; post-LN blocks with one fused QKV projection,
``scaled_dot_product_attention`` under the batch's padding mask with attention dropout, exact GELU, dropout on each
sublayer's output; a tanh pooler on [CLS] and the next-sentence classifier; the MLM head (dense, GELU, LayerNorm, the
decoder tied to the token embedding) on the masked positions only, gathered by ``masked_positions`` as NVIDIA's
BERT recipe and ours do; mean cross-entropies over the masked tokens and the pairs. The vocabulary is padded like
the recipe's and the loss taken over the padded logits (as ``plain_gpt.py``: the padded rows only learn to lose).
No options. Same parameter count and FLOPs as ours at the same sizes; what ours does beyond it (the logits sliced
to the tokenizer's vocabulary, a float32 loss summed over labels != -100, the pre-LN / T-Fixup / sinusoidal
variants, the dense head without labels, the checkpointing switch) is what ``model_step.py --plain`` measures.

    from benchmarks.plain_bert import PlainBERT
    model = PlainBERT.like(ours.config)          # the same sizes as one of our BERT configs
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.plain_gpt import PlainBlock


class PlainBERT(nn.Module):
    """BERT in plain PyTorch; ``forward(**batch)`` takes the loader's batch and returns ``{"loss": ...}`` like ours."""

    def __init__(self, vocab: int, positions: int, segments: int, width: int, layers: int, heads: int, ffn: int,
                 dropout: float = 0.1, attn_dropout: float = 0.1, eps: float = 1e-12, pad_multiple: int = 1,
                 pad_id: int = 0):
        super().__init__()
        padded = math.ceil(vocab / pad_multiple) * pad_multiple
        self.tok = nn.Embedding(padded, width, padding_idx=pad_id)
        self.pos, self.seg = nn.Embedding(positions, width), nn.Embedding(segments, width)
        self.ln_emb, self.drop = nn.LayerNorm(width, eps=eps), nn.Dropout(dropout)
        self.blocks = nn.ModuleList(PlainBlock(width, heads, ffn, causal=False, gelu="none", dropout=dropout,
                                               attn_dropout=attn_dropout, eps=eps, post_norm=True) for _ in range(layers))
        self.pool, self.nsp = nn.Linear(width, width), nn.Linear(width, 2)
        self.transform, self.ln_head = nn.Linear(width, width), nn.LayerNorm(width, eps=eps)
        self.decoder_bias = nn.Parameter(torch.zeros(padded))
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    @classmethod
    def like(cls, config) -> PlainBERT:
        """The plain model with the sizes (dropout, padded vocabulary) of one of our ``BertConfig`` s."""
        return cls(config.vocab_size, config.max_position_embeddings, config.type_vocab_size, config.hidden_size,
                   config.num_layers, config.num_heads, config.intermediate_size, config.hidden_dropout,
                   config.attention_dropout, config.layer_norm_eps, config.pad_vocab_multiple, config.pad_token_id)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor, masked_positions: torch.Tensor, next_sentence_label: torch.Tensor) -> dict[str, torch.Tensor]:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.ln_emb(self.tok(input_ids) + self.pos(positions) + self.seg(token_type_ids)))
        mask = attention_mask.bool()[:, None, None, :]
        for block in self.blocks:
            x = block(x, mask)
        masked = x.flatten(0, 1)[masked_positions]
        logits = F.linear(self.ln_head(F.gelu(self.transform(masked))), self.tok.weight, self.decoder_bias)
        mlm = F.cross_entropy(logits.float(), labels.flatten()[masked_positions])
        nsp = F.cross_entropy(self.nsp(torch.tanh(self.pool(x[:, 0]))).float(), next_sentence_label)
        return {"loss": mlm + nsp}
