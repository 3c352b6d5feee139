"""What a model family's transformers mapping is (``HFFamily``) and where it is registered (``register_hf``), apart
from ``models.hf`` so that a family's own mapping module (``models.hf_gpt``) imports these, not the converter that
imports it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import nn

from core.families import get_family

from .hf_keys import Spec

__all__ = ["HFFamily", "register_hf", "HF_FAMILIES"]

_HF_ACT = {"gelu": "gelu", "gelu_tanh": "gelu_new"}


@dataclass(frozen=True)
class HFFamily:
    """How one model family maps onto ``transformers`` (the torch half behind its spec's ``hf_model_type``).

    ``norm_placement``: the LayerNorm placement of the transformers classes (only that variant converts);
    ``config``/``hf_class``/``keys``: our module -> its transformers config, class and key table;
    ``our_config``: a transformers config (+ the shared activation/init fields) -> our config dataclass;
    ``normalize_key``: a checkpoint key in any of the family's styles -> our tables' style;
    ``build``: ``(cfg, hf_cfg, arch, sd, head, num_labels, id2label) -> (module, sd)``, the module to load into.
    """

    norm_placement: str
    config: Callable[[nn.Module], transformers.PretrainedConfig]
    hf_class: Callable[[nn.Module], type]
    keys: Callable[[nn.Module], Spec]
    our_config: Callable[[transformers.PretrainedConfig, dict[str, Any]], Any]
    normalize_key: Callable[[str], str]
    build: Callable[..., tuple[nn.Module, dict[str, torch.Tensor]]]
    new_hf: Callable[[nn.Module], transformers.PreTrainedModel] | None = None  # default: hf_class(model)(config(model))


HF_FAMILIES: dict[str, HFFamily] = {}  # family name -> adapter


def register_hf(family: str, adapter: HFFamily) -> None:
    """Give family ``family`` (whose spec names its ``hf_model_type``) its transformers mapping."""
    if not get_family(family).exports:
        raise ValueError(f"Model family {family!r} declares no hf_model_type in its FamilySpec; it does not export.")
    HF_FAMILIES[family] = adapter


def _id2label(hf_cfg) -> dict[int, str] | None:
    labels = {int(k): str(v) for k, v in (getattr(hf_cfg, "id2label", None) or {}).items()}
    default = {i: f"LABEL_{i}" for i in range(len(labels))}
    return labels if labels and labels != default else None


def _new_task_head(sd: dict[str, torch.Tensor], prefix: str, hf_cfg, own_head: bool,
                   id2label: dict[int, str] | None) -> dict[str, torch.Tensor]:
    """``sd`` without the checkpoint's classification head (keys under ``prefix``) when a new task's head is built:
    one of the same shape for other labels (or unnamed ones) started the new classes from the old classes' rows,
    label ids assigned anew. Kept only when it is that task's own head (``own_head``: the checkpoint is such a
    classifier) with the same label names in the same order: fine-tuning a fine-tuned release further."""
    if own_head and id2label is not None and _id2label(hf_cfg) == {int(k): str(v) for k, v in id2label.items()}:
        return sd
    return {k: v for k, v in sd.items() if not k.startswith(prefix)}


def _prefixed(prefix: str, keep: tuple[str, ...]) -> Callable[[str], str]:
    """Bare-model checkpoints (``BertModel``, ``GPT2Model``) have no prefix; our tables use the head model's."""
    return lambda k: k if k.startswith(keep) else f"{prefix}{k}"


def _label_kwargs(model: nn.Module) -> dict[str, Any]:
    """A sequence classifier's labels (transformers' LABEL_i names when it has none) and problem type, as config fields."""
    labels = model.id2label or {i: f"LABEL_{i}" for i in range(model.num_labels)}
    kwargs: dict[str, Any] = dict(id2label=labels, label2id={v: k for k, v in labels.items()})
    if model.problem_type:
        kwargs["problem_type"] = model.problem_type
    return kwargs
