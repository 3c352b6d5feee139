"""The torch-free half of a model family (torchtitan's ``TrainSpec`` in spirit), and its registry.

A ``FamilySpec`` says everything about a family that a pre-launch check, a planner or a release
card needs without building a model: its config dataclass and named sizes, the pretraining tasks it
trains under and the corpus kind they read, its training-FLOPs formula, and the ``transformers``
``model_type`` it exports as (None: the family does not export). ``models.register_family`` adds the
torch half (the module class) from it; ``pipelines.engine.check`` reads only this half, so checking a
launch never imports torch.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from core.registry import Registry

__all__ = ["FamilySpec", "register_family", "unregister_family", "registered_family", "get_family", "list_families",
           "family_of_model", "family_of_config", "families_for_task", "pretraining_tasks", "model_names", "model_catalog",
           "UnknownModel"]


class UnknownModel(ValueError):
    """A model name no registered family has; the message lists the closest names."""


#: ``flops(config, seq_len, include_head, mlm_fraction)``: training FLOPs per ``FamilySpec.flops_unit``.
FlopsFormula = Callable[[Any, int, bool, float], float]


@dataclass(frozen=True)
class FamilySpec:
    """One model family, torch-free. ``sizes``: size name -> config fields over the dataclass defaults."""

    name: str  # the family name models carry as ``.family`` ("bert", "gpt", "vit")
    config_class: type  # a (torch-free) dataclass; the module's ``config_class``
    sizes: dict[str, dict[str, Any]]
    tasks: tuple[str, ...]  # pretraining ``train.task`` values this family trains under
    corpus_kind: str  # what those tasks read (``core.corpus_kinds``)
    flops: FlopsFormula  # training FLOPs per token (text) or per sample (``flops_unit``)
    flops_unit: str = "token"  # "token": per token, times seq_len per sample; "sample": per sample (an image)
    hf_model_type: str | None = None  # the ``transformers`` model_type it exports as; None: no export
    card_usage: Callable[[str], str] | None = None  # the release card's "Use" section for a release path
    release_files: Callable[[Any], dict[str, str]] | None = None  # extra release files from the config (a processor)

    def config(self, size: str, **overrides: Any) -> Any:
        """The config dataclass of ``size`` with ``overrides`` (the same ``models.get_config`` builds)."""
        return self.config_class(**{**self.sizes[size], **overrides})

    @property
    def exports(self) -> bool:
        return self.hf_model_type is not None


_FAMILIES: Registry[FamilySpec] = Registry("model family", key="model family")
_SIZES: dict[str, str] = {}  # model size name -> family name


def register_family(spec: FamilySpec) -> FamilySpec:
    """Register ``spec`` (its sizes become model names); a name or size already taken is refused."""
    if not dataclasses.is_dataclass(spec.config_class):
        raise TypeError(f"FamilySpec {spec.name!r}: config_class must be a dataclass, got {spec.config_class!r}.")
    taken = sorted(set(spec.sizes) & set(_SIZES))
    if taken:
        raise ValueError(f"Model family {spec.name!r}: size(s) {taken} already belong to family {_SIZES[taken[0]]!r}.")
    for size in spec.sizes:
        spec.config(size)  # a bad default fails at registration, not at first use
    _FAMILIES.register(spec.name, spec)  # a taken name is refused (ValueError)
    _SIZES.update(dict.fromkeys(spec.sizes, spec.name))
    return spec


def unregister_family(name: str) -> None:
    """Remove family ``name`` and its sizes (a test's toy family; ``registered_family`` does it for you)."""
    spec = _FAMILIES.unregister(name)
    for size in spec.sizes:
        _SIZES.pop(size, None)


@contextmanager
def registered_family(spec: FamilySpec) -> Iterator[FamilySpec]:
    """``spec`` registered for the ``with`` block only (nothing leaks into other tests)."""
    register_family(spec)
    try:
        yield spec
    finally:
        unregister_family(spec.name)


def get_family(name: str) -> FamilySpec:
    if name not in _FAMILIES:
        raise ValueError(f"Unknown model family {name!r}. Registered: {', '.join(list_families())}.")
    return _FAMILIES[name]


def list_families() -> list[str]:
    return sorted(_FAMILIES)


def model_names() -> list[str]:
    """Every registered size of every family, sorted (what ``models.list_models()`` lists)."""
    return sorted(_SIZES)


def family_of_model(name: str) -> FamilySpec:
    """The family of model size ``name``; ``UnknownModel`` names the closest sizes."""
    if name not in _SIZES:
        close = difflib.get_close_matches(name, model_names(), n=3, cutoff=0.4)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownModel(f"Unknown model {name!r}.{hint} Registered: {', '.join(model_names())}.")
    return _FAMILIES[_SIZES[name]]


def family_of_config(config: Any) -> FamilySpec:
    """The family whose ``config_class`` ``config`` is (the nearest registered base class wins)."""
    for cls in type(config).__mro__:
        for spec in _FAMILIES.values():
            if spec.config_class is cls:
                return spec
    raise TypeError(f"No model family is registered for {type(config).__name__}.")


def families_for_task(task: str) -> list[FamilySpec]:
    """The families that pretrain under ``train.task=task`` (none: a fine-tuning task)."""
    return [spec for _, spec in sorted(_FAMILIES.items()) if task in spec.tasks]


def pretraining_tasks() -> list[str]:
    """Every ``train.task`` some family pretrains under, families in name order (the others fine-tune)."""
    return list(dict.fromkeys(task for _, spec in sorted(_FAMILIES.items()) for task in spec.tasks))


def model_catalog() -> dict[str, tuple[str, int]]:
    """Registered sizes -> (family, hidden_size), torch-free (what ``check`` and the CLI list)."""
    return {size: (family, int(getattr(_FAMILIES[family].config(size), "hidden_size", 0) or 0))
            for size, family in sorted(_SIZES.items())}
