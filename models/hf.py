"""Exact conversion to and from Hugging Face ``transformers`` models.

``to_hf(model)`` returns the equivalent ``transformers`` model (same outputs to fp32 rounding);
``from_hf(dir_or_model)`` returns ``(our_model, LoadReport)``. Supported pairs:

==============================  =============================================================
ours                            transformers
==============================  =============================================================
``BertForPreTraining``          ``BertForPreTraining`` (also reads ``BertModel``, ``BertForMaskedLM``, ...)
``BertEncoder``                 ``BertModel``
``SequenceClassifier`` (BERT)   ``BertForSequenceClassification`` (``id2label`` in the config)
``QuestionAnswering`` (BERT)    ``BertForQuestionAnswering``
``GPT``                         ``GPT2LMHeadModel`` (also reads ``GPT2Model``)
``LastTokenClassifier`` (GPT)   ``GPT2ForSequenceClassification`` (``id2label``, ``pad_token_id``)
``ViT``                         ``ViTForImageClassification`` (also reads ``ViTModel``)
==============================  =============================================================

Each family's mapping is one ``HFFamily`` (GPT's lives in ``models.hf_gpt``) registered with ``register_hf`` (its spec's
``hf_model_type`` names the transformers side; a family without one does not export). Each pair is a
key table in ``models.hf_keys`` (fused QKV split/joined, GPT-2 ``Conv1D`` transposed,
transformers 4.x and 5.x ViT names both understood). Checkpoints (``models.hf_weights``: safetensors or
``.bin``, single or sharded) are read with ``safetensors`` or ``models.safe_load`` (``weights_only=True``,
errors naming the file), never run remote code, and
every file read must lie inside the checkpoint directory (no symlink out, no ``..`` shard name).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from core.families import get_family
from core.files import tree_inside

from .bert import BertConfig, BertEncoder, BertForPreTraining
from .heads import LastTokenClassifier, QuestionAnswering, SequenceClassifier
from .hf_family import _HF_ACT, HF_FAMILIES, HFFamily, _id2label, _label_kwargs, _new_task_head, _prefixed, register_hf
from .hf_keys import Spec, bert_keys, vit_keys, vit_rename
from .hf_weights import load_hf_state_dict
from .vit import ViT, ViTConfig
from .vocab import pad_vocab, unpad_vocab

__all__ = ["to_hf", "from_hf", "LoadReport", "HFFamily", "register_hf", "hf_config", "spec_for", "load_hf_state_dict", "set_special_ids", "SPECIAL_ID_NAMES"]

#: The special-token ids a release's config (and generation config) carries, as the tokenizer defines them.
SPECIAL_ID_NAMES = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "mask_token_id",
                    "cls_token_id", "sep_token_id")

_FROM_HF_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
# Buffers some checkpoints carry that hold no learned state.
_IGNORABLE = re.compile(r"(position_ids|\.attn\.bias|\.attn\.masked_bias)$")


@dataclass
class LoadReport:
    """What ``from_hf`` did: ``missing`` = our parameters freshly initialized; ``unexpected`` = checkpoint keys unused."""

    source: str
    architecture: str
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"Loaded {self.architecture} from {self.source}."]
        if self.missing:
            lines.append(f"Initialized (not in checkpoint): {', '.join(self.missing)}")
        if self.unexpected:
            lines.append(f"Unused checkpoint keys: {', '.join(self.unexpected)}")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Ours -> transformers
# --------------------------------------------------------------------------------------------


def _adapter(model: nn.Module) -> HFFamily:
    family = getattr(model, "family", None)
    if family not in HF_FAMILIES:
        raise TypeError(f"No Hugging Face equivalent known for {type(model).__name__} (family {family!r} has no "
                        f"transformers mapping: its FamilySpec.hf_model_type is None or models.hf.register_hf was not called).")
    return HF_FAMILIES[family]


def _adapter_of_type(model_type: str) -> HFFamily:
    by_type = {get_family(f).hf_model_type: a for f, a in sorted(HF_FAMILIES.items())}
    if model_type not in by_type:
        raise ValueError(f"Unsupported model_type {model_type!r}; supported: {', '.join(by_type)}.")
    return by_type[model_type]


def spec_for(model: nn.Module) -> Spec:
    """The key table between ``model`` and its transformers class (its family's adapter builds it)."""
    return _adapter(model).keys(model)


def _check_convertible(model: nn.Module) -> None:
    cfg = model.config
    expected = _adapter(model).norm_placement
    if cfg.init == "t-fixup" or cfg.norm_placement != expected:
        raise ValueError(
            f"{type(model).__name__} with init={cfg.init!r}, norm_placement={cfg.norm_placement!r} has no transformers "
            f"equivalent (the transformers class is {expected}-LN with LayerNorm); only the standard variant converts."
        )


def hf_config(model: nn.Module) -> transformers.PretrainedConfig:
    """The ``transformers`` config describing ``model``'s architecture."""
    return _adapter(model).config(model)


def _hf_class(model: nn.Module) -> type:
    return _adapter(model).hf_class(model)


@torch.no_grad()
def to_hf(model: nn.Module) -> transformers.PreTrainedModel:
    """The equivalent ``transformers`` model (eval mode, fp32, CPU) holding a copy of ``model``'s weights.

    Sinusoidal position tables are written into the HF learned-position table (identical outputs).
    Save a release with ``to_hf(model).save_pretrained(dir)`` (safetensors).
    """
    spec = spec_for(model)
    _check_convertible(model.backbone if isinstance(model, (SequenceClassifier, LastTokenClassifier, QuestionAnswering)) else model)
    adapter = _adapter(model)
    hf = adapter.new_hf(model) if adapter.new_hf else adapter.hf_class(model)(adapter.config(model))
    vocab = getattr(model.config, "vocab_size", 0)  # a padded vocabulary (models.vocab) is exported unpadded
    ours = {k: unpad_vocab(k, t, vocab) for k, t in {**dict(model.named_buffers()), **model.state_dict()}.items()}
    sd: dict[str, torch.Tensor] = {}
    for our_key, hf_keys, kind in spec:
        t = ours[our_key].detach().float().cpu()
        if kind == "qkv":
            for k, part in zip(hf_keys, t.chunk(3, dim=0), strict=True):
                sd[k] = part.clone()
        else:
            sd[hf_keys[0]] = (t.t() if kind == "t" else t).clone()
    target = set(hf.state_dict())
    if not set(sd) <= target:
        sd = {vit_rename(k, to_new=True): v for k, v in sd.items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    tied = {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias", "lm_head.weight"}
    if unexpected or set(missing) - tied:
        raise RuntimeError(
            f"to_hf key mismatch: missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}."
        )
    if hasattr(hf, "tie_weights"):
        hf.tie_weights()
    return hf.eval()


def set_special_ids(hf: transformers.PreTrainedModel, ids: dict[str, int | None]) -> None:
    """Give ``hf``'s config and generation config the tokenizer's special ids (``SPECIAL_ID_NAMES``).

    A release must stop ``generate()`` at the tokenizer's end of text and pad with its pad token;
    ids the model cannot know (which token is ``<|endoftext|>``) come only from the tokenizer.
    """
    unknown = set(ids) - set(SPECIAL_ID_NAMES)
    if unknown:
        raise ValueError(f"Unknown special ids {sorted(unknown)}; expected some of {SPECIAL_ID_NAMES}.")
    vocab = getattr(hf.config, "vocab_size", None)
    for name, value in ids.items():
        if value is not None and vocab is not None and not 0 <= value < vocab:
            raise ValueError(f"{name}={value} is outside the model's vocabulary of {vocab}; the tokenizer "
                             f"does not belong to this model.")
        setattr(hf.config, name, value)
        gen = getattr(hf, "generation_config", None)
        if gen is not None and name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            setattr(gen, name, value)


# --------------------------------------------------------------------------------------------
# transformers -> ours
# --------------------------------------------------------------------------------------------


def _our_config(hf_cfg: transformers.PretrainedConfig) -> Any:
    adapter = _adapter_of_type(hf_cfg.model_type)
    act = getattr(hf_cfg, "hidden_act", None) or getattr(hf_cfg, "activation_function", None)
    if act not in _FROM_HF_ACT:
        raise ValueError(f"Activation {act!r} is not supported (need one of {sorted(_FROM_HF_ACT)}).")
    return adapter.our_config(hf_cfg, dict(activation=_FROM_HF_ACT[act], initializer_range=hf_cfg.initializer_range))


def _normalize_keys(sd: dict[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """Map any checkpoint's key style onto our tables' (prefixed, 4.x names, LayerNorm weight/bias)."""
    normalize = _adapter_of_type(model_type).normalize_key
    out = {}
    for k, v in sd.items():
        k = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", k)  # TF-converted BERT releases
        k = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", k)
        out[normalize(k)] = v
    return out


_HEADS = {
    "BertForSequenceClassification": "classification",
    "BertForQuestionAnswering": "qa",
    "BertModel": "encoder",
}


def from_hf(
    src: str | Path | transformers.PreTrainedModel,
    *,
    head: str | None = None,
    num_labels: int | None = None,
    id2label: dict[int, str] | None = None,
    pad_vocab_multiple: int = 1,
) -> tuple[nn.Module, LoadReport]:
    """Our model + ``LoadReport`` from a checkpoint dir (``config.json`` + weights) or a ``transformers`` model.

    ``head`` picks what to build from a BERT checkpoint: ``"pretraining"``, ``"encoder"``,
    ``"classification"`` (``num_labels``/``id2label`` make a new task's head: no label names, ``problem_type`` or
    weights are taken from the checkpoint's head, unless it is a classifier of exactly those labels) or
    ``"qa"``. By default the checkpoint's architecture decides: ``BertModel`` -> encoder,
    ``BertForSequenceClassification`` -> classification, ``BertForQuestionAnswering`` -> qa,
    anything else (``BertForPreTraining``, ``BertForMaskedLM``, ...) -> pretraining. From a GPT-2 checkpoint:
    ``"lm"`` (``GPT``; the default) or ``"classification"`` (``LastTokenClassifier``; the default of a
    ``GPT2ForSequenceClassification``, whose ``pad_token_id`` it takes). Parameters the checkpoint lacks (e.g. MLM/pooler
    weights) keep their fresh init and are listed in ``report.missing`` (and warned about).
    ``pad_vocab_multiple`` (BERT, GPT): build the model with its vocabulary rows padded for training
    (``models.vocab``); the checkpoint's rows fill the first ``vocab_size``, the padding rows are zero.
    """
    if isinstance(src, transformers.PreTrainedModel):
        hf_cfg, sd, source = src.config, src.state_dict(), type(src).__name__ + " instance"
        arch = type(src).__name__
    else:
        path = Path(src)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json; expected a transformers checkpoint directory.")
        tree_inside(path, ".", what="the model directory")  # nothing outside it is read (an HF cache snapshot: cp -rL it)
        hf_cfg = transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=False)
        sd, source = load_hf_state_dict(path), str(path)
        arch = (hf_cfg.architectures or [""])[0]
    cfg = _our_config(hf_cfg)  # an unsupported model_type is refused here, naming the supported ones
    if pad_vocab_multiple != 1 and hasattr(cfg, "pad_vocab_multiple"):
        cfg.pad_vocab_multiple = pad_vocab_multiple
        cfg.__post_init__()
    sd = _normalize_keys(sd, hf_cfg.model_type)

    model, sd = _adapter_of_type(hf_cfg.model_type).build(cfg, hf_cfg, arch, sd, head, num_labels, id2label)

    loaded, consumed = _load(model, spec_for(model), sd)
    report = LoadReport(source=source, architecture=arch or hf_cfg.model_type)
    tied = {"mlm.decoder.weight", "lm_head.weight"} if getattr(cfg, "tie_word_embeddings", True) else set()
    report.missing = sorted(set(model.state_dict()) - loaded - tied)
    rest = sorted(set(sd) - consumed)
    report.ignored = [
        k
        for k in rest
        if _IGNORABLE.search(k)
        or k in ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias", "lm_head.weight")
    ]
    report.unexpected = [k for k in rest if k not in report.ignored]
    if report.missing:
        warnings.warn(f"from_hf: {len(report.missing)} parameters not in the checkpoint were freshly initialized: "
                      f"{', '.join(report.missing)}", stacklevel=2)  # fmt: skip
    return model, report


@torch.no_grad()
def _load(model: nn.Module, spec: Spec, sd: dict[str, torch.Tensor]) -> tuple[set[str], set[str]]:
    """Copy every table entry present in ``sd`` into ``model``; returns (our keys loaded, HF keys used)."""
    ours = model.state_dict()
    loaded, consumed, new = set(), set(), {}
    for our_key, hf_keys, kind in spec:
        if our_key not in ours or not all(k in sd for k in hf_keys):
            continue
        if kind == "qkv":
            t = torch.cat([sd[k] for k in hf_keys], dim=0)
        else:
            t = sd[hf_keys[0]].t() if kind == "t" else sd[hf_keys[0]]
        t = pad_vocab(our_key, t, getattr(model.config, "vocab_size", 0), ours[our_key].shape[0])  # models.vocab
        if t.shape != ours[our_key].shape:
            if our_key.split(".")[0] in ("head", "classifier", "qa_outputs", "score"):
                continue  # a new task head of another size: keep its init, report it missing
            raise ValueError(
                f"Shape mismatch for {our_key}: checkpoint {tuple(t.shape)} vs model {tuple(ours[our_key].shape)}."
            )
        new[our_key] = t
        loaded.add(our_key)
        consumed.update(hf_keys)
    model.load_state_dict(new, strict=False)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    if "cls.predictions.decoder.weight" in sd:
        consumed.add("cls.predictions.decoder.weight")
    return loaded, consumed


# --------------------------------------------------------------------------------------------
# The built-in families' mappings (a new family registers its own with ``register_hf``)
# --------------------------------------------------------------------------------------------


def _bert_config(model: nn.Module) -> transformers.PretrainedConfig:
    cfg = model.config
    kwargs: dict[str, Any] = {}
    if isinstance(model, SequenceClassifier):
        kwargs = {**_label_kwargs(model), "classifier_dropout": model.dropout_p}
    return transformers.BertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, intermediate_size=cfg.intermediate_size,
        hidden_act=_HF_ACT[cfg.activation], hidden_dropout_prob=cfg.hidden_dropout,
        attention_probs_dropout_prob=cfg.attention_dropout, max_position_embeddings=cfg.max_position_embeddings,
        type_vocab_size=cfg.type_vocab_size, initializer_range=cfg.initializer_range,
        layer_norm_eps=cfg.layer_norm_eps, pad_token_id=cfg.pad_token_id, **kwargs,
    )  # fmt: skip


_BERT_CLASSES = ((BertForPreTraining, "BertForPreTraining"), (BertEncoder, "BertModel"),
                 (SequenceClassifier, "BertForSequenceClassification"), (QuestionAnswering, "BertForQuestionAnswering"))


def _bert_class(model: nn.Module) -> type:
    return getattr(transformers, next(name for cls, name in _BERT_CLASSES if isinstance(model, cls)))


def _bert_new(model: nn.Module) -> transformers.PreTrainedModel:
    if isinstance(model, BertEncoder) and model.pooler is None:
        return transformers.BertModel(_bert_config(model), add_pooling_layer=False)
    return _bert_class(model)(_bert_config(model))


def _bert_our_config(hf_cfg: transformers.PretrainedConfig, common: dict[str, Any]) -> BertConfig:
    if getattr(hf_cfg, "position_embedding_type", "absolute") != "absolute" or getattr(hf_cfg, "is_decoder", False):
        raise ValueError("Only absolute-position, encoder (is_decoder=False) BERT checkpoints are supported.")
    return BertConfig(
        vocab_size=hf_cfg.vocab_size, hidden_size=hf_cfg.hidden_size, num_layers=hf_cfg.num_hidden_layers,
        num_heads=hf_cfg.num_attention_heads, intermediate_size=hf_cfg.intermediate_size,
        hidden_dropout=hf_cfg.hidden_dropout_prob, attention_dropout=hf_cfg.attention_probs_dropout_prob,
        max_position_embeddings=hf_cfg.max_position_embeddings, type_vocab_size=hf_cfg.type_vocab_size,
        layer_norm_eps=hf_cfg.layer_norm_eps, pad_token_id=hf_cfg.pad_token_id, **common,  # None: no padding_idx
    )  # fmt: skip


def _bert_build(cfg, hf_cfg, arch, sd, head, num_labels, id2label):
    head = head or _HEADS.get(arch, "pretraining")
    if head == "pretraining":
        model = BertForPreTraining(cfg)
    elif head == "encoder":
        model = BertEncoder(cfg, add_pooling_layer="bert.pooler.dense.weight" in sd)
        sd = {k.removeprefix("bert."): v for k, v in sd.items()}
    elif head == "classification":  # a new task's head (num_labels/id2label given) owes the checkpoint's old head nothing
        new_task = num_labels is not None or id2label is not None
        labels = id2label if new_task else _id2label(hf_cfg) if arch == "BertForSequenceClassification" else None
        n = num_labels or (len(labels) if labels else hf_cfg.num_labels)
        problem_type = None if new_task else getattr(hf_cfg, "problem_type", None)  # None: inferred as transformers does
        model = SequenceClassifier(BertEncoder(cfg), n, dropout=getattr(hf_cfg, "classifier_dropout", None),
                                   id2label=labels, problem_type=problem_type)  # fmt: skip
        if new_task:
            sd = _new_task_head(sd, "classifier.", hf_cfg, arch == "BertForSequenceClassification", id2label)
    elif head == "qa":
        model = QuestionAnswering(BertEncoder(cfg, add_pooling_layer=False))
    else:
        raise ValueError(f"head must be pretraining, encoder, classification or qa, got {head!r}.")
    return model, sd


def _vit_config(model: nn.Module) -> transformers.PretrainedConfig:
    cfg = model.config
    labels = cfg.id2label or {i: f"LABEL_{i}" for i in range(cfg.num_labels)}
    return transformers.ViTConfig(
        hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size, hidden_act=_HF_ACT[cfg.activation],
        hidden_dropout_prob=cfg.hidden_dropout, attention_probs_dropout_prob=cfg.attention_dropout,
        initializer_range=cfg.initializer_range, layer_norm_eps=cfg.layer_norm_eps, image_size=cfg.image_size,
        patch_size=cfg.patch_size, num_channels=cfg.num_channels, qkv_bias=cfg.qkv_bias,
        id2label=labels, label2id={v: k for k, v in labels.items()},
    )  # fmt: skip


def _vit_our_config(hf_cfg: transformers.PretrainedConfig, common: dict[str, Any]) -> ViTConfig:
    return ViTConfig(
        hidden_size=hf_cfg.hidden_size, num_layers=hf_cfg.num_hidden_layers, num_heads=hf_cfg.num_attention_heads,
        intermediate_size=hf_cfg.intermediate_size, hidden_dropout=hf_cfg.hidden_dropout_prob,
        attention_dropout=hf_cfg.attention_probs_dropout_prob, layer_norm_eps=hf_cfg.layer_norm_eps,
        image_size=hf_cfg.image_size, patch_size=hf_cfg.patch_size, num_channels=hf_cfg.num_channels,
        qkv_bias=hf_cfg.qkv_bias, num_labels=hf_cfg.num_labels, id2label=_id2label(hf_cfg), **common,
    )  # fmt: skip


def _vit_build(cfg, hf_cfg, arch, sd, head, num_labels, id2label):
    """``num_labels``/``id2label`` make a new task's head (its label names too, even at the checkpoint's class
    count; a checkpoint head of that shape is loaded into it, as BERT's)."""
    if num_labels is not None or id2label is not None:
        cfg = ViTConfig(**{**cfg.to_dict(), "num_labels": num_labels or len(id2label), "id2label": id2label})
    return ViT(cfg), sd


def _vit_key(k: str) -> str:
    return _prefixed("vit.", ("vit.", "classifier."))(vit_rename(k, to_new=False))


register_hf("bert", HFFamily(
    norm_placement="post", config=_bert_config, hf_class=_bert_class, keys=bert_keys, our_config=_bert_our_config,
    normalize_key=_prefixed("bert.", ("bert.", "cls.", "classifier.", "qa_outputs.")), build=_bert_build,
    new_hf=_bert_new))
register_hf("vit", HFFamily(
    norm_placement="pre", config=_vit_config, hf_class=lambda model: transformers.ViTForImageClassification,
    keys=vit_keys, our_config=_vit_our_config, normalize_key=_vit_key, build=_vit_build))

from . import hf_gpt  # noqa: E402, F401  (registers "gpt": its mapping needs the definitions above)
