"""GPT's transformers mapping (``models.hf``'s adapter for the ``gpt`` family).

``GPT`` <-> ``GPT2LMHeadModel`` (``GPT2Model`` is read too) and ``LastTokenClassifier`` on a GPT <->
``GPT2ForSequenceClassification``: same key table for the body (``models.hf_keys.gpt_keys``), the
bias-free ``score`` head, and in the config the labels, ``problem_type`` and the ``pad_token_id`` that
decides which token is classified (``models.heads.last_non_pad_index``).
"""

from __future__ import annotations

from typing import Any

import transformers
from torch import nn

from .gpt import GPT, GPTConfig
from .heads import LastTokenClassifier
from .hf_family import _HF_ACT, HFFamily, _id2label, _label_kwargs, _new_task_head, _prefixed, register_hf
from .hf_keys import gpt_keys

__all__: list[str] = []

#: transformers GPT-2 class name -> the head ``from_hf`` builds by default from a checkpoint of it.
_HEADS = {"GPT2ForSequenceClassification": "classification"}


def _gpt_config(model: nn.Module) -> transformers.PretrainedConfig:
    cfg = model.config
    kwargs: dict[str, Any] = {}
    if isinstance(model, LastTokenClassifier):
        kwargs = {**_label_kwargs(model), "pad_token_id": model.pad_token_id}
    return transformers.GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.max_position_embeddings, n_embd=cfg.hidden_size,
        n_layer=cfg.num_layers, n_head=cfg.num_heads, n_inner=cfg.intermediate_size,
        activation_function=_HF_ACT[cfg.activation], resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout,
        attn_pdrop=cfg.attention_dropout, layer_norm_epsilon=cfg.layer_norm_eps,
        initializer_range=cfg.initializer_range, tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=None, eos_token_id=None,  # the tokenizer's ids: set_special_ids
        **kwargs,
    )  # fmt: skip


def _gpt_class(model: nn.Module) -> type:
    return transformers.GPT2ForSequenceClassification if isinstance(model, LastTokenClassifier) else transformers.GPT2LMHeadModel


def _gpt_our_config(hf_cfg: transformers.PretrainedConfig, common: dict[str, Any]) -> GPTConfig:
    if getattr(hf_cfg, "scale_attn_by_inverse_layer_idx", False) or not getattr(hf_cfg, "scale_attn_weights", True):
        raise ValueError("GPT-2 checkpoints with non-standard attention scaling are not supported.")
    return GPTConfig(
        vocab_size=hf_cfg.vocab_size, max_position_embeddings=hf_cfg.n_positions, hidden_size=hf_cfg.n_embd,
        num_layers=hf_cfg.n_layer, num_heads=hf_cfg.n_head, intermediate_size=hf_cfg.n_inner or 4 * hf_cfg.n_embd,
        hidden_dropout=hf_cfg.resid_pdrop, attention_dropout=hf_cfg.attn_pdrop, layer_norm_eps=hf_cfg.layer_norm_epsilon,
        tie_word_embeddings=getattr(hf_cfg, "tie_word_embeddings", True), **common,
    )  # fmt: skip


def _gpt_build(cfg, hf_cfg, arch, sd, head, num_labels, id2label):
    """``head``: ``"lm"`` (default) or ``"classification"`` (default for a ``GPT2ForSequenceClassification``
    checkpoint; ``num_labels``/``id2label`` make a new task's head, as for BERT). The classified token is
    the last one that is not the config's ``pad_token_id``."""
    head = head or _HEADS.get(arch, "lm")
    if head == "lm":
        return GPT(cfg), sd
    if head != "classification":
        raise ValueError(f"A GPT checkpoint builds head lm or classification, got {head!r}.")
    new_task = num_labels is not None or id2label is not None
    labels = id2label if new_task else _id2label(hf_cfg) if arch == "GPT2ForSequenceClassification" else None
    n = num_labels or (len(labels) if labels else hf_cfg.num_labels)
    problem_type = None if new_task else getattr(hf_cfg, "problem_type", None)
    if new_task:
        sd = _new_task_head(sd, "score.", hf_cfg, arch == "GPT2ForSequenceClassification", id2label)
    return LastTokenClassifier(GPT(cfg), n, pad_token_id=hf_cfg.pad_token_id, id2label=labels,
                               problem_type=problem_type), sd


register_hf("gpt", HFFamily(
    norm_placement="pre", config=_gpt_config, hf_class=_gpt_class, keys=gpt_keys, our_config=_gpt_our_config,
    normalize_key=_prefixed("transformer.", ("transformer.", "lm_head.", "score.")), build=_gpt_build))
