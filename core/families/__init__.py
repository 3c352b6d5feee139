"""Model families, torch-free: one ``FamilySpec`` per family (see ``spec``), the built-in ones registered.

``check``, ``plan`` and the release card read families from here without importing torch;
``models`` registers each family's module (the torch half) from its spec. A new family is one
module defining its config dataclass and a ``FamilySpec``, and one ``models.register_family`` call.
"""

from __future__ import annotations

from . import bert, gpt, vit  # noqa: F401  (registers the built-in families)
from .spec import (
    FamilySpec,
    UnknownModel,
    families_for_task,
    family_of_config,
    family_of_model,
    get_family,
    list_families,
    model_catalog,
    model_names,
    pretraining_tasks,
    register_family,
    registered_family,
    unregister_family,
)

__all__ = ["FamilySpec", "UnknownModel", "register_family", "unregister_family", "registered_family", "get_family",
           "list_families", "family_of_model", "family_of_config", "families_for_task", "pretraining_tasks", "model_names", "model_catalog"]
