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

from core.families import family_of_config
from core.families.transformer import TransformerConfig, attention_flops, block_matmul_params
from core.families.vit import ViTConfig, vit_training_flops

__all__ = ["training_flops_per_token", "training_flops_per_sample", "training_flops_per_image", "block_matmul_params",
           "encoder_training_flops"]

def training_flops_per_token(
    config: TransformerConfig, seq_len: int | None = None, include_head: bool = True, mlm_fraction: float = 1.0
) -> float:
    """6 N + 12 L d T per token for BERT/GPT; for ViT the FLOPs per *image* (``seq_len`` ignored).

    The formula is the config's family's (``FamilySpec.flops``). ``seq_len`` defaults to
    ``config.max_position_embeddings``; ``include_head=False`` drops the pretraining heads (use it
    for fine-tuning heads, whose cost is negligible). ``mlm_fraction``: share of positions the BERT
    MLM head runs at (1.0 = dense as in transformers; our sparse head runs at the masked positions
    only, ~0.15).
    """
    spec = family_of_config(config)
    T = 0 if spec.flops_unit == "sample" else seq_len or config.max_position_embeddings
    return spec.flops(config, T, include_head, mlm_fraction)


def training_flops_per_image(config: ViTConfig, include_head: bool = True) -> float:
    """6 [P C p^2 d + T L (4 d^2 + 2 d d_ff) + d K] + 12 L d T^2 with T = P + 1."""
    return vit_training_flops(config, 0, include_head)


def training_flops_per_sample(config: TransformerConfig, seq_len: int | None = None, mlm_fraction: float = 1.0) -> float:
    """FLOPs per training sample: per token x T for text, per image for ViT (ThroughputMeter's ``flops_per_sample``)."""
    spec = family_of_config(config)
    if spec.flops_unit == "sample":
        return spec.flops(config, 0, True, mlm_fraction)
    T = seq_len or config.max_position_embeddings
    return spec.flops(config, T, True, mlm_fraction) * T


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
        total += 6 * n * L + attention_flops(config, L) * L + 6 * config.hidden_size * head_outputs * L + 6 * sequence_params
    return float(total)
