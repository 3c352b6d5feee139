"""Pure-PyTorch models: BERT, GPT-2, ViT and task heads, with exact Hugging Face interop.

``models.create(name, **overrides)`` builds a registered size; ``models.list_models()`` lists them.
A family is a torch-free ``core.families.FamilySpec`` plus its module: ``models.register_family(spec, module)``.
``models.hf`` (imports ``transformers``) is loaded lazily on first attribute access.
"""

from __future__ import annotations

import importlib

from . import bert, flops, gpt, heads, vit  # noqa: F401  (registers the sizes)
from .bert import BertConfig, BertEncoder, BertForPreTraining
from .gpt import GPT, GPTConfig
from .heads import QuestionAnswering, SequenceClassifier
from .registry import create, get_config, list_models, register_family, registered_family, unregister_family
from .vit import ViT, ViTConfig

__all__ = [
    "create",
    "list_models",
    "register_family",
    "registered_family",
    "unregister_family",
    "get_config",
    "BertConfig",
    "BertEncoder",
    "BertForPreTraining",
    "GPT",
    "GPTConfig",
    "ViT",
    "ViTConfig",
    "SequenceClassifier",
    "QuestionAnswering",
]


def __getattr__(name: str):
    if name == "hf":
        return importlib.import_module(".hf", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
