"""Key tables between our state dicts and transformers' (used by ``models.hf``).

One table builder per family (``bert_keys``, ``gpt_keys``, ``vit_keys``: what ``models.hf``'s
family adapters use). Each entry is (our key, HF keys, kind): ``copy``; ``qkv`` (our fused ``[3d, d]`` = the
row-concatenation of HF's query/key/value); ``t`` (GPT-2's ``Conv1D`` stores ``W^T``). Tables use
the on-disk (transformers 4.x) names; transformers >= 5 renames ViT modules in memory, which
``vit_rename`` maps both ways.
"""

from __future__ import annotations

import re

from torch import nn

from .bert import BertConfig, BertEncoder, BertForPreTraining
from .gpt import GPTConfig
from .heads import LastTokenClassifier, QuestionAnswering, SequenceClassifier
from .vit import ViTConfig

__all__ = ["Spec", "bert_keys", "gpt_keys", "vit_keys", "vit_rename"]

Spec = list[tuple[str, tuple[str, ...], str]]

# --------------------------------------------------------------------------------------------
# Key tables
# --------------------------------------------------------------------------------------------


def _linear(ours: str, hf: str) -> Spec:
    return [(f"{ours}.weight", (f"{hf}.weight",), "copy"), (f"{ours}.bias", (f"{hf}.bias",), "copy")]


def _bert_encoder_spec(cfg: BertConfig, o: str, h: str, pooler: bool) -> Spec:
    spec: Spec = [
        (f"{o}embeddings.word_embeddings.weight", (f"{h}embeddings.word_embeddings.weight",), "copy"),
        (f"{o}embeddings.position_embeddings.weight", (f"{h}embeddings.position_embeddings.weight",), "copy"),
        (f"{o}embeddings.token_type_embeddings.weight", (f"{h}embeddings.token_type_embeddings.weight",), "copy"),
        *_linear(f"{o}embeddings.norm", f"{h}embeddings.LayerNorm"),
    ]
    for i in range(cfg.num_layers):
        ob, hb = f"{o}blocks.{i}", f"{h}encoder.layer.{i}"
        for p in ("weight", "bias"):
            spec.append(
                (f"{ob}.attn.qkv.{p}", tuple(f"{hb}.attention.self.{n}.{p}" for n in ("query", "key", "value")), "qkv")
            )
        spec += _linear(f"{ob}.attn.proj", f"{hb}.attention.output.dense")
        spec += _linear(f"{ob}.norm1", f"{hb}.attention.output.LayerNorm")
        spec += _linear(f"{ob}.mlp.fc1", f"{hb}.intermediate.dense")
        spec += _linear(f"{ob}.mlp.fc2", f"{hb}.output.dense")
        spec += _linear(f"{ob}.norm2", f"{hb}.output.LayerNorm")
    if pooler:
        spec += _linear(f"{o}pooler", f"{h}pooler.dense")
    return spec


def _bert_pretraining_spec(cfg: BertConfig) -> Spec:
    return [
        *_bert_encoder_spec(cfg, "bert.", "bert.", pooler=True),
        *_linear("mlm.dense", "cls.predictions.transform.dense"),
        *_linear("mlm.norm", "cls.predictions.transform.LayerNorm"),
        ("mlm.decoder.bias", ("cls.predictions.bias",), "copy"),  # decoder.weight is tied to the embedding
        *_linear("nsp", "cls.seq_relationship"),
    ]


def _gpt_spec(cfg: GPTConfig, o: str = "", lm_head: bool = True) -> Spec:
    """``o``: our prefix (``backbone.`` under a task head, which has no LM head)."""
    spec: Spec = [
        (f"{o}wte.weight", ("transformer.wte.weight",), "copy"),
        (f"{o}wpe.weight", ("transformer.wpe.weight",), "copy"),
    ]
    for i in range(cfg.num_layers):
        ob, hb = f"{o}blocks.{i}", f"transformer.h.{i}"
        spec += _linear(f"{ob}.norm1", f"{hb}.ln_1")
        spec += [
            (f"{ob}.attn.qkv.weight", (f"{hb}.attn.c_attn.weight",), "t"),
            (f"{ob}.attn.qkv.bias", (f"{hb}.attn.c_attn.bias",), "copy"),
        ]
        spec += [
            (f"{ob}.attn.proj.weight", (f"{hb}.attn.c_proj.weight",), "t"),
            (f"{ob}.attn.proj.bias", (f"{hb}.attn.c_proj.bias",), "copy"),
        ]
        spec += _linear(f"{ob}.norm2", f"{hb}.ln_2")
        spec += [
            (f"{ob}.mlp.fc1.weight", (f"{hb}.mlp.c_fc.weight",), "t"),
            (f"{ob}.mlp.fc1.bias", (f"{hb}.mlp.c_fc.bias",), "copy"),
        ]
        spec += [
            (f"{ob}.mlp.fc2.weight", (f"{hb}.mlp.c_proj.weight",), "t"),
            (f"{ob}.mlp.fc2.bias", (f"{hb}.mlp.c_proj.bias",), "copy"),
        ]
    spec += _linear(f"{o}ln_f", "transformer.ln_f")
    if lm_head and not cfg.tie_word_embeddings:
        spec.append(("lm_head.weight", ("lm_head.weight",), "copy"))
    return spec


def _vit_spec(cfg: ViTConfig) -> Spec:
    spec: Spec = [
        ("cls_token", ("vit.embeddings.cls_token",), "copy"),
        ("pos_embed", ("vit.embeddings.position_embeddings",), "copy"),
        *_linear("patch_embed", "vit.embeddings.patch_embeddings.projection"),
    ]
    for i in range(cfg.num_layers):
        ob, hb = f"blocks.{i}", f"vit.encoder.layer.{i}"
        spec += _linear(f"{ob}.norm1", f"{hb}.layernorm_before")
        params = ("weight", "bias") if cfg.qkv_bias else ("weight",)
        for p in params:
            spec.append(
                (
                    f"{ob}.attn.qkv.{p}",
                    tuple(f"{hb}.attention.attention.{n}.{p}" for n in ("query", "key", "value")),
                    "qkv",
                )
            )
        spec += _linear(f"{ob}.attn.proj", f"{hb}.attention.output.dense")
        spec += _linear(f"{ob}.norm2", f"{hb}.layernorm_after")
        spec += _linear(f"{ob}.mlp.fc1", f"{hb}.intermediate.dense")
        spec += _linear(f"{ob}.mlp.fc2", f"{hb}.output.dense")
    return [*spec, *_linear("norm", "vit.layernorm"), *_linear("head", "classifier")]


def bert_keys(model: nn.Module) -> Spec:
    """The table of a BERT-family module: pretraining model, bare encoder, or a task head on the encoder."""
    if isinstance(model, BertForPreTraining):
        return _bert_pretraining_spec(model.config)
    if isinstance(model, BertEncoder):
        return _bert_encoder_spec(model.config, "", "", pooler=model.pooler is not None)
    if isinstance(model, (SequenceClassifier, QuestionAnswering)) and isinstance(model.backbone, BertEncoder):
        head = "classifier" if isinstance(model, SequenceClassifier) else "qa_outputs"
        return [
            *_bert_encoder_spec(model.config, "backbone.", "bert.", pooler=model.backbone.pooler is not None),
            *_linear(head, head),
        ]
    raise TypeError(f"No Hugging Face equivalent known for {type(model).__name__}.")


def gpt_keys(model: nn.Module) -> Spec:
    """``GPT`` <-> ``GPT2LMHeadModel``; ``LastTokenClassifier`` on a GPT <-> ``GPT2ForSequenceClassification``."""
    if isinstance(model, LastTokenClassifier):
        return [*_gpt_spec(model.config, "backbone.", lm_head=False), ("score.weight", ("score.weight",), "copy")]
    return _gpt_spec(model.config)


def vit_keys(model: nn.Module) -> Spec:
    return _vit_spec(model.config)


# ViT module names in transformers >= 5 (in memory) vs the 4.x / on-disk names our table uses.
_VIT_NEW = {
    "attention.attention.query": "attention.q_proj",
    "attention.attention.key": "attention.k_proj",
    "attention.attention.value": "attention.v_proj",
    "attention.output.dense": "attention.o_proj",
    "intermediate.dense": "mlp.fc1",
    "output.dense": "mlp.fc2",
}
_VIT_OLD = {v: k for k, v in _VIT_NEW.items()}


def vit_rename(key: str, to_new: bool) -> str:
    pat = (
        r"^(vit\.)?encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$"
        if to_new
        else r"^(vit\.)?layers\.(\d+)\.(.+)\.(weight|bias)$"
    )
    m = re.match(pat, key)
    if not m:
        return key
    prefix, idx, mid, p = m.groups()
    mid = (_VIT_NEW if to_new else _VIT_OLD).get(mid, mid)
    return f"{prefix or ''}{'layers' if to_new else 'encoder.layer'}.{idx}.{mid}.{p}"
