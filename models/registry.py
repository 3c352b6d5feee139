"""Models by name: ``create("bert-base", vocab_size=32000)``.

Each family registers its sizes as (model class, default config fields). ``create`` builds the
family's config dataclass from the defaults plus overrides and refuses an unknown override key with
the closest valid field, so a typo in ``model.overrides`` fails loudly instead of being ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["register_model", "create", "list_models", "get_config", "make_config"]


@dataclass(frozen=True)
class _Entry:
    model_cls: type[nn.Module]
    defaults: dict[str, Any]


_REGISTRY: dict[str, _Entry] = {}


def register_model(name: str, model_cls: type[nn.Module], **defaults: Any) -> None:
    """Register size ``name`` of ``model_cls`` (which has a ``config_class`` dataclass attribute)."""
    if name in _REGISTRY:
        raise ValueError(f"Model {name!r} is already registered.")
    make_config(model_cls.config_class, defaults, name)  # validate the defaults now, not at first use
    _REGISTRY[name] = _Entry(model_cls, dict(defaults))


def list_models() -> list[str]:
    return sorted(_REGISTRY)


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
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=3, cutoff=0.4)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(f"Unknown model {name!r}.{hint} Registered: {', '.join(list_models())}.")
    return _REGISTRY[name]


def get_config(name: str, **overrides: Any) -> Any:
    """The config ``create(name, **overrides)`` would use, without building the model."""
    entry = _entry(name)
    return make_config(entry.model_cls.config_class, {**entry.defaults, **overrides}, name)


def create(name: str, **overrides: Any) -> nn.Module:
    """Build registered model ``name``; ``overrides`` replace fields of its config dataclass."""
    entry = _entry(name)
    return entry.model_cls(get_config(name, **overrides))
