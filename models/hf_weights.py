"""The tensors of a transformers checkpoint directory, read as data only.

The layouts ``save_pretrained`` writes (and transformers loads): ``model.safetensors``, its sharded
index, ``pytorch_model.bin`` and its sharded index (older releases). ``.bin`` files are read with
``models.safe_load`` (``weights_only=True``): a pickle that needs code is refused, naming the file.
Every file, a shard named by an index included, must lie inside the directory (no symlink out, no
``..`` shard name).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from core.files import inside

from .safe_load import safe_torch_load

__all__ = ["load_hf_state_dict"]

_WHAT = "a weights file of the model directory"


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    return safe_torch_load(path, map_location="cpu")


def _sharded(path: Path, index_name: str, load: Callable[[Path], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Every shard the index's ``weight_map`` names, each checked to lie inside ``path``."""
    index = json.loads(inside(path, index_name, what=_WHAT).read_text(encoding="utf-8"))
    sd: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        sd.update(load(inside(path, str(shard), what=_WHAT)))
    return sd


def load_hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of a checkpoint dir: ``model.safetensors`` or its sharded index, else ``pytorch_model.bin`` or its
    sharded index (weights_only) — safetensors first, as transformers prefers them."""
    from safetensors.torch import load_file

    path = Path(path)
    if (path / "model.safetensors").is_file():
        return load_file(inside(path, "model.safetensors", what=_WHAT))
    if (path / "model.safetensors.index.json").is_file():
        return _sharded(path, "model.safetensors.index.json", load_file)
    if (path / "pytorch_model.bin").is_file():
        return _load_bin(inside(path, "pytorch_model.bin", what=_WHAT))
    if (path / "pytorch_model.bin.index.json").is_file():
        return _sharded(path, "pytorch_model.bin.index.json", _load_bin)
    raise FileNotFoundError(f"{path} has no model.safetensors, pytorch_model.bin or a sharded index of either "
                            f"(model.safetensors.index.json, pytorch_model.bin.index.json).")
