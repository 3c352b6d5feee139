"""Models by name: ``create("bert-base", vocab_size=32000)``.

A model family's torch-free half (``core.families.FamilySpec``: config dataclass, named sizes, ...)
names the sizes; this registry adds its torch half, the module class that ``create`` builds.
``register_family(spec, module)`` registers both halves of a new family in one call
(``registered_family`` for the length of a ``with`` block, as tests do). ``create`` builds the
family's config dataclass from the size's fields plus overrides and refuses an unknown override key
with the closest valid field, so a typo in ``model.overrides`` fails loudly instead of being ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from core import families
from core.families import FamilySpec

__all__ = ["register_family", "register_module", "unregister_family", "registered_family", "create", "list_models",
           "get_config", "make_config", "module_of"]


@dataclass(frozen=True)
class _Entry:
    model_cls: type[nn.Module]
    defaults: dict[str, Any]


_MODULES: dict[str, type[nn.Module]] = {}  # family name -> its module class


def register_module(family: str, model_cls: type[nn.Module]) -> None:
    """Attach ``model_cls`` (the torch half) to the registered family spec ``family``."""
    spec = families.get_family(family)
    if family in _MODULES:
        raise ValueError(f"Model family {family!r} already has its module ({_MODULES[family].__name__}).")
    if getattr(model_cls, "config_class", None) is not spec.config_class or getattr(model_cls, "family", None) != family:
        raise TypeError(f"{model_cls.__name__} must set config_class = {spec.config_class.__name__} and "
                        f"family = {family!r} to be family {family!r}'s module.")
    _MODULES[family] = model_cls


def register_family(spec: FamilySpec, model_cls: type[nn.Module]) -> FamilySpec:
    """A new family in one call: its spec (torch-free half) and its module (torch half)."""
    families.register_family(spec)
    try:
        register_module(spec.name, model_cls)
    except Exception:
        families.unregister_family(spec.name)
        raise
    return spec


def unregister_family(name: str) -> None:
    _MODULES.pop(name, None)
    families.unregister_family(name)


@contextmanager
def registered_family(spec: FamilySpec, model_cls: type[nn.Module]) -> Iterator[FamilySpec]:
    """Both halves of ``spec`` registered for the ``with`` block only (nothing leaks past it)."""
    register_family(spec, model_cls)
    try:
        yield spec
    finally:
        unregister_family(spec.name)


def module_of(family: str) -> type[nn.Module]:
    """The module class of family ``family``."""
    if family not in _MODULES:
        raise ValueError(f"Model family {family!r} has no module registered (models.register_family).")
    return _MODULES[family]


def list_models() -> list[str]:
    return [name for name in families.model_names() if families.family_of_model(name).name in _MODULES]


def make_config(config_cls: type, fields: dict[str, Any], name: str | None = None) -> Any:
    """Build ``config_cls(**fields)``; an unknown key raises ValueError naming it and the closest field."""
    valid = [f.name for f in dataclasses.fields(config_cls) if f.init]
    for key in fields:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
            hint = f" Did you mean `{close[0]}`?" if close else ""
            where = f" for model {name!r}" if name else ""
            raise ValueError(
                f"Unknown {config_cls.__name__} field `{key}`{where}.{hint} Valid fields: {', '.join(sorted(valid))}."
            )
    return config_cls(**fields)


def _entry(name: str) -> _Entry:
    spec = families.family_of_model(name)  # UnknownModel (a ValueError) names the closest sizes
    return _Entry(module_of(spec.name), dict(spec.sizes[name]))


def get_config(name: str, **overrides: Any) -> Any:
    """The config ``create(name, **overrides)`` would use, without building the model."""
    entry = _entry(name)
    return make_config(entry.model_cls.config_class, {**entry.defaults, **overrides}, name)


def create(name: str, **overrides: Any) -> nn.Module:
    """Build registered model ``name``; ``overrides`` replace fields of its config dataclass."""
    entry = _entry(name)
    return entry.model_cls(get_config(name, **overrides))
