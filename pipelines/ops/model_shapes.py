"""Torch-free shapes of the registered models: parameter counts, FLOPs and activation bytes for ``plan``.

``pretrain plan`` must answer in milliseconds without importing torch, so the architecture of each
registered size is read from its torch-free family spec (``MODEL_SHAPES``, ``core.families``) and
the counts are closed forms over it, per family. ``tests/pipelines/test_plan.py`` keeps every entry equal to
``models.get_config(name)``, every parameter count equal to the built model's and the FLOPs equal to
``models.flops``; ``tests/pipelines/test_model_shapes.py`` keeps the activation bytes within a stated tolerance
of what autograd really saves.

Activation bytes are what a training forward leaves for backward, per micro-batch, as our blocks
(``models/layers.py``) compute: per block 8 s b h values of the activation dtype (LN inputs and
outputs, the fused QKV output, SDPA's output, which the projection reads as a view) + 2 s b d_ff
(the MLP's GELU input and output), the two hidden-dropout masks (1 B per element on CUDA, where
they are bool; the activation dtype on CPU, as measured), LayerNorm's fp32 mean and rstd (16 s b)
and the fused attention kernel's fp32 log-sum-exp (4 a s b); no s^2 term, because SDPA's flash /
memory-efficient kernels do not store the attention matrix. This is Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models", Sec. 4.1: 34 s b h + 5 a s^2 b)
less the attention matrix. With
activation checkpointing each block keeps only its input (s b h) and one block is recomputed at a
time. The LM head (GPT's at every position, BERT's at the masked ones, P of them) keeps, run eager, the
fp32 log-softmax of the loss, 4 P V, plus the logits the output returns (e P V; GPT's training step returns
none with ``train_logits: false``, the GPU recipes); its backward adds the fp32 gradient of the log-softmax
and its cast, (4 + e) P V. Under ``torch.compile`` the loss keeps the logits and their fp32 log-sum-exp
instead of the log-softmax (e P V + 4 P: the softmax is recomputed in backward, fused with its gradient), and
the backward adds the logits' gradient, e P V, once more for the zero gradient of returned logits. Measured on
the CPU (tests/pipelines/test_model_shapes.py); the blocks keep the same bytes compiled or not.

Under autocast over fp32 weights (the DDP engine's bf16/fp16) the residual stream stays fp32 -- an fp32
embedding or position plus a half-precision sublayer output is fp32 -- so each block's two LayerNorm inputs
are kept in 4 bytes, not e (2 (4 - e) s b h more a block; with checkpointing the block's input is fp32; the
head's LayerNorm input too), and every matmul keeps the half-precision cast of its weight for backward,
compiled or not; DeepSpeed's bf16/fp16 runs the whole model in half precision, its weights are those casts. Measured on the
CPU against an all-bf16 model (tests/pipelines/test_model_shapes.py: GPT within 0.2 %, BERT 2.6 % over); on the H100,
ViT-B/16's DDP row peaked 0.9 GiB over the all-bf16 count, 1.0 GiB by this one (docs/benchmarks.md, gpu_check).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from core.families import family_of_model, model_names

__all__ = ["ModelShape", "MODEL_SHAPES", "model_shape", "param_count", "largest_layer_params", "flops_per_sample",
           "tokens_per_sample", "activation_bytes", "loss_backward_bytes"]


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The fields of a family's config that size it (names as in ``models/*Config``)."""

    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int = 0
    max_position_embeddings: int = 0
    position_embedding: str = "learned"
    tie_word_embeddings: bool = True
    type_vocab_size: int = 2
    image_size: int = 0
    patch_size: int = 0
    num_channels: int = 3
    num_labels: int = 0
    qkv_bias: bool = True
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init: str = "standard"
    train_logits: bool = True  # GPT: the training forward also returns the logits (BERT's masked ones always)


def _shape(name: str) -> ModelShape:
    """The shape of registered size ``name``, read from its family spec's config (``core.families``, torch-free)."""
    spec = family_of_model(name)
    cfg = spec.config(name)
    own = {f.name for f in fields(cfg)}
    return ModelShape(family=spec.name, **{f.name: getattr(cfg, f.name) for f in fields(ModelShape) if f.name in own})


#: Registered model sizes (``models.list_models()``) -> their default shape, from the family specs.
MODEL_SHAPES: dict[str, ModelShape] = {name: _shape(name) for name in model_names()}


def model_shape(name: str, overrides: dict[str, Any] | None = None) -> ModelShape:
    """The shape of ``model.name`` with ``model.overrides`` applied (keys that do not size it are ignored)."""
    if name not in MODEL_SHAPES:
        raise KeyError(name)
    known = {f.name for f in fields(ModelShape)} - {"family"}
    return replace(MODEL_SHAPES[name], **{k: v for k, v in (overrides or {}).items() if k in known})


def _norm(m: ModelShape) -> int:
    return 2 * m.hidden_size if m.init != "t-fixup" else 0


def _block_params(m: ModelShape, qkv_bias: bool = True) -> int:
    h, f = m.hidden_size, m.intermediate_size
    return 3 * h * h + (3 * h if qkv_bias else 0) + h * h + h + 2 * h * f + f + h + 2 * _norm(m)


def _patches(m: ModelShape) -> int:
    return (m.image_size // m.patch_size) ** 2


def param_count(m: ModelShape) -> int:
    """Distinct parameters (tied weights once), as ``sum(p.numel() for p in model.parameters())``."""
    h, V = m.hidden_size, m.vocab_size
    if m.family == "gpt":
        pos = m.max_position_embeddings * h if m.position_embedding == "learned" else 0
        head = 0 if m.tie_word_embeddings else V * h
        return V * h + pos + m.num_layers * _block_params(m) + _norm(m) + head
    if m.family == "bert":
        pos = m.max_position_embeddings * h if m.position_embedding == "learned" else 0
        emb = V * h + pos + m.type_vocab_size * h + _norm(m)
        heads = (h * h + h) + (h * h + h + _norm(m) + V) + (2 * h + 2)  # pooler, MLM transform + decoder bias, NSP
        return emb + m.num_layers * _block_params(m) + heads
    if m.family == "vit":
        P = _patches(m)
        emb = h + (P + 1) * h + m.num_channels * m.patch_size**2 * h + h  # cls, positions, patch conv + bias
        return emb + m.num_layers * _block_params(m, m.qkv_bias) + _norm(m) + h * m.num_labels + m.num_labels
    raise ValueError(f"no parameter count for family {m.family!r}")


def largest_layer_params(m: ModelShape) -> int:
    """Parameters of the largest single module (DeepSpeed's ``largest_layer_params`` for ZeRO-3's gather)."""
    h, f, V = m.hidden_size, m.intermediate_size, m.vocab_size
    blocks = max(3 * h * h + 3 * h, h * f + f)
    pos = m.max_position_embeddings * h if m.position_embedding == "learned" else 0
    if m.family == "gpt":
        return max(V * h, pos, blocks)
    if m.family == "bert":
        return max(V * h + V, pos, blocks)  # the MLM decoder: the tied embedding + its bias
    top = h + (_patches(m) + 1) * h  # ViT's own cls token and position table
    return max(m.num_channels * m.patch_size**2 * h + h, top, blocks, h * m.num_labels + m.num_labels)


def tokens_per_sample(m: ModelShape, seq_len: int) -> int:
    """Positions a sample runs through the blocks: seq_len for text, patches + CLS for ViT."""
    return _patches(m) + 1 if m.family == "vit" else seq_len


def flops_per_sample(m: ModelShape, seq_len: int, mlm_fraction: float = 0.15) -> float:
    """Training FLOPs per sample, the formula of ``models.flops`` (6 N + 12 L d T per token; ViT per image).

    BERT: our MLM head runs at the masked positions only (``mlm_fraction``, 0.15 by default).
    """
    h, L = m.hidden_size, m.num_layers
    blocks = L * (4 * h * h + 2 * h * m.intermediate_size)
    if m.family == "vit":
        T = _patches(m) + 1
        n = _patches(m) * m.num_channels * m.patch_size**2 * h + T * blocks + h * m.num_labels
        return 6 * n + T * 12 * L * h * T
    T = seq_len
    per_sequence = 0.0
    n = float(blocks)
    if m.family == "bert":
        n += mlm_fraction * (h * h + h * m.vocab_size)
        per_sequence = h * h + 2 * h
    else:
        n += h * m.vocab_size
    return (6 * n + 6 * per_sequence / T + 12 * L * h * T) * T


def _block_activation_bytes(m: ModelShape, tokens: int, act_bytes: int, mask_bytes: int, residual_bytes: int) -> float:
    h, f = m.hidden_size, m.intermediate_size
    masks = 2 * mask_bytes * tokens * h if m.hidden_dropout > 0 else 0
    ln_inputs = 2 * residual_bytes * tokens * h  # the residual stream at each LayerNorm
    return act_bytes * (6 * tokens * h + 2 * tokens * f) + ln_inputs + masks + 16 * tokens + 4 * m.num_heads * tokens


def _lm_head_positions(m: ModelShape, tokens: int, mlm_fraction: float) -> float:
    """Rows the LM head projects onto the vocabulary: every position (GPT), the masked ones (BERT), none (ViT)."""
    return {"gpt": tokens, "bert": mlm_fraction * tokens}.get(m.family, 0.0)


def _returns_logits(m: ModelShape) -> bool:
    return m.family == "bert" or m.train_logits


def _loss_bytes(m: ModelShape, rows: float, act_bytes: int, compiled: bool) -> float:
    """What the LM head's loss keeps for backward, with the logits the output returns (module docstring)."""
    if compiled:  # the logits (the returned ones are the same tensor) + the fp32 log-sum-exp per row
        return act_bytes * rows * m.vocab_size + 4 * rows
    return (4 + (act_bytes if _returns_logits(m) else 0)) * rows * m.vocab_size


def loss_backward_bytes(m: ModelShape, *, micro_batch: int, seq_len: int, act_bytes: int, compiled: bool,
                        mlm_fraction: float = 0.15) -> float:
    """Bytes the LM head's loss adds at the start of backward, on top of what the forward kept (module docstring)."""
    rows = _lm_head_positions(m, tokens_per_sample(m, seq_len) * micro_batch, mlm_fraction)
    if compiled:
        return (2 if _returns_logits(m) else 1) * act_bytes * rows * m.vocab_size
    return (4 + act_bytes) * rows * m.vocab_size


def activation_bytes(m: ModelShape, *, micro_batch: int, seq_len: int, act_bytes: int, checkpointing: bool,
                     mask_bytes: int = 1, mlm_fraction: float = 0.15, compiled: bool = False,
                     autocast: bool = False) -> dict[str, float]:
    """Bytes a forward keeps for backward per GPU: ``blocks``, ``head`` (embeddings, final norm, loss), ``total``
    (at the end of the forward) and ``recompute`` (one block rebuilt at a time in backward under checkpointing).
    ``autocast``: fp32 weights under autocast (the DDP engine's mixed precision), whose residual stream is fp32."""
    T = tokens_per_sample(m, seq_len) * micro_batch
    h = m.hidden_size
    residual = 4 if autocast else act_bytes
    block = _block_activation_bytes(m, T, act_bytes, mask_bytes, residual)
    blocks = m.num_layers * residual * T * h if checkpointing else m.num_layers * block
    emb_mask = mask_bytes * T * h if m.hidden_dropout > 0 else 0
    loss = _loss_bytes(m, _lm_head_positions(m, T, mlm_fraction), act_bytes, compiled)
    if m.family == "gpt":  # ln_f input, output and stats, and the loss
        head = emb_mask + act_bytes * 2 * T * h + 8 * T + loss
    elif m.family == "bert":
        n_masked = mlm_fraction * T
        head = (emb_mask + act_bytes * T * h + 8 * T  # embedding LN input + its stats
                + act_bytes * 4 * n_masked * h + loss)
    else:
        pixels = micro_batch * m.num_channels * m.image_size**2
        head = act_bytes * (pixels + 2 * T * h)  # the patch conv's input, final norm in/out
    if autocast:  # the matmuls' half-precision casts of their weights (a checkpointed block casts again when it is
        # recomputed), and the fp32 residual stream at the head's LayerNorm (GPT's and ViT's final, BERT's embedding)
        head += act_bytes * _matmul_weights(m, blocks=not checkpointing) + (4 - act_bytes) * T * h
    return {"blocks": float(blocks), "head": float(head), "total": float(blocks + head),
            "recompute": float(block if checkpointing else 0)}


def _matmul_weights(m: ModelShape, *, blocks: bool) -> int:
    """The weights a training forward multiplies by (the blocks' if ``blocks``, and the heads'), biases aside."""
    h, f, V = m.hidden_size, m.intermediate_size, m.vocab_size
    heads = {"gpt": V * h, "bert": V * h + 2 * h * h + 2 * h,  # tied LM head; BERT's MLM transform, pooler, NSP
             "vit": m.num_channels * m.patch_size**2 * h + h * m.num_labels}[m.family]
    return heads + (m.num_layers * (4 * h * h + 2 * h * f) if blocks else 0)
