"""Training FLOPs per token (text) or per image (ViT), for MFU reporting.

Kaplan et al. 2020 ("Scaling Laws for Neural Language Models", Table 1) count 2 FLOPs per
multiply-accumulate, a forward pass of 2 N per token for the N matmul parameters, and a backward
pass of twice the forward, so training costs 6 N per token. Attention's two activation-activation
matmuls (Q K^T and softmax(.) V) add 2 * 2 * T * d per token per layer forward; PaLM (Chowdhery et
al. 2022, Appendix B) writes the training total as 6 N + 12 L H Q T = 6 N + 12 L d T. We use that,
with no causal halving (PaLM's convention, so GPT and BERT numbers compare); elementwise work
(softmax, GELU, LayerNorm, biases) is ignored as in both papers. Embedding lookups are not matmuls.

N counts the matmul weights a token passes through:
- every block: Q, K, V, O (4 d^2) + MLP (2 d d_ff);
- BERT: MLM transform (d^2) + tied decoder (d V) at every position (or at the masked share of
  positions with our sparse MLM head, ``mlm_fraction``); pooler (d^2) and NSP (2 d) once
  per sequence, i.e. divided by T;  GPT: the tied LM head (d V).
- ViT (per image, T = P + 1 tokens, P = (image/patch)^2): patch projection (C p^2 d) per patch,
  blocks per token, classifier (d K) once per image.
"""

from __future__ import annotations

from .bert import BertConfig
from .gpt import GPTConfig
from .layers import TransformerConfig
from .vit import ViTConfig

__all__ = ["training_flops_per_token", "training_flops_per_sample", "block_matmul_params", "encoder_training_flops"]


def block_matmul_params(cfg: TransformerConfig) -> int:
    """Matmul weights of all blocks: L (4 d^2 + 2 d d_ff)."""
    d = cfg.hidden_size
    return cfg.num_layers * (4 * d * d + 2 * d * cfg.intermediate_size)


def _attention_flops(cfg: TransformerConfig, seq_len: int) -> int:
    """12 L d T per token (training) for Q K^T and A V."""
    return 12 * cfg.num_layers * cfg.hidden_size * seq_len


def training_flops_per_token(
    config: TransformerConfig, seq_len: int | None = None, include_head: bool = True, mlm_fraction: float = 1.0
) -> float:
    """6 N + 12 L d T per token for BERT/GPT; for ViT the FLOPs per *image* (``seq_len`` ignored).

    ``seq_len`` defaults to ``config.max_position_embeddings``; ``include_head=False`` drops the
    pretraining heads (use it for fine-tuning heads, whose cost is negligible). ``mlm_fraction``:
    share of positions the BERT MLM head runs at (1.0 = dense as in transformers; our sparse head
    runs at the masked positions only, ~0.15).
    """
    if isinstance(config, ViTConfig):
        return training_flops_per_image(config, include_head)
    T = seq_len or config.max_position_embeddings
    d = config.hidden_size
    n = block_matmul_params(config)
    per_sequence = 0
    if include_head and isinstance(config, BertConfig):
        n += mlm_fraction * (d * d + d * config.vocab_size)
        per_sequence = d * d + 2 * d
    elif include_head and isinstance(config, GPTConfig):
        n += d * config.vocab_size
    elif not isinstance(config, (BertConfig, GPTConfig)):
        raise TypeError(f"No FLOP count for {type(config).__name__}.")
    return 6 * n + 6 * per_sequence / T + _attention_flops(config, T)


def training_flops_per_image(config: ViTConfig, include_head: bool = True) -> float:
    """6 [P C p^2 d + T L (4 d^2 + 2 d d_ff) + d K] + 12 L d T^2 with T = P + 1."""
    P = config.grid_size**2
    T = P + 1
    d = config.hidden_size
    n = P * config.num_channels * config.patch_size**2 * d + T * block_matmul_params(config)
    if include_head:
        n += d * config.num_labels
    return 6 * n + T * _attention_flops(config, T)


def training_flops_per_sample(config: TransformerConfig, seq_len: int | None = None, mlm_fraction: float = 1.0) -> float:
    """FLOPs per training sample: per token x T for text, per image for ViT (ThroughputMeter's ``flops_per_sample``)."""
    if isinstance(config, ViTConfig):
        return training_flops_per_image(config)
    T = seq_len or config.max_position_embeddings
    return training_flops_per_token(config, T, mlm_fraction=mlm_fraction) * T


def encoder_training_flops(config: TransformerConfig, lengths, head_outputs: int = 0, sequence_params: int = 0) -> float:
    """Training FLOPs of a batch of sequences of the given real lengths through the blocks + a task head.

    Per sequence of L tokens: 6 N L + 12 l d L^2 (the per-token count above times L, attention at
    the sequence's own length) + 6 d K L for a head with K outputs per token (QA: K = 2) + 6 P for
    ``sequence_params`` P matmul weights run once per sequence (classification: pooler d^2 + classifier d K).
    Fine-tuning batches are padded to their longest item; padding is not useful work and not counted.
    No pretraining head (MLM/NSP) is counted: fine-tuning models do not run one.
    """
    n = block_matmul_params(config)
    total = 0.0
    for length in lengths:
        L = int(length)
        total += 6 * n * L + _attention_flops(config, L) * L + 6 * config.hidden_size * head_outputs * L + 6 * sequence_params
    return float(total)
