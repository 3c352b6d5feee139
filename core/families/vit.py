"""ViT (Dosovitskiy et al. 2021), torch-free half: config, named sizes, per-image FLOPs, HF ``vit``.

The module is ``models.vit.ViT``; the FLOPs conventions are in ``models.flops``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from .spec import FamilySpec, register_family
from .transformer import TransformerConfig, attention_flops, block_matmul_params

__all__ = ["ViTConfig", "SPEC", "vit_training_flops", "eval_resize", "eval_processor_config", "PIXEL_MEAN", "PIXEL_STD"]


@dataclass(kw_only=True)
class ViTConfig(TransformerConfig):
    """ViT sizes; defaults are ViT-B/16 at 224px with 1000 classes (HF ``ViTConfig`` defaults otherwise)."""

    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    num_labels: int = 1000
    id2label: dict[int, str] | None = None
    qkv_bias: bool = True
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    norm_placement: Literal["post", "pre"] = "pre"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size ({self.image_size}) must be a multiple of patch_size ({self.patch_size}).")
        if self.id2label is not None:  # YAML/JSON give string keys
            self.id2label = {int(k): str(v) for k, v in self.id2label.items()}
        if self.id2label is not None and len(self.id2label) != self.num_labels:
            raise ValueError(f"id2label has {len(self.id2label)} names but num_labels is {self.num_labels}.")

    @property
    def grid_size(self) -> int:
        return self.image_size // self.patch_size

    @property
    def max_position_embeddings(self) -> int:
        """Sequence length at the training resolution: patches + [CLS]."""
        return self.grid_size**2 + 1


def vit_training_flops(config: ViTConfig, seq_len: int = 0, include_head: bool = True, mlm_fraction: float = 1.0) -> float:
    """Per image (``seq_len`` ignored): 6 [P C p^2 d + T L (4 d^2 + 2 d d_ff) + d K] + 12 L d T^2 with T = P + 1."""
    P = config.grid_size**2
    T = P + 1
    d = config.hidden_size
    n = P * config.num_channels * config.patch_size**2 * d + T * block_matmul_params(config)
    if include_head:
        n += d * config.num_labels
    return 6 * n + T * attention_flops(config, T)


#: Pixel normalization of the image_cls task and of a release's processor (transformers' ViTImageProcessor defaults).
PIXEL_MEAN = PIXEL_STD = 0.5


def eval_resize(image_size: int) -> int:
    """Shorter side before the eval centre crop: 256 for 224 (the ratio of ViT's and ResNet's evaluations)."""
    return image_size * 256 // 224


def eval_processor_config(image_size: int) -> dict[str, Any]:
    """``preprocessor_config.json`` that makes ``transformers`` see the pixels the image_cls evaluation sees.

    ``CLIPImageProcessor`` is the standard processor that resizes the shorter side and centre-crops
    in every supported ``transformers`` version (``ViTImageProcessor`` squashes to a square);
    with its PIL backend it gives the same tensor as ``ImageClsTask.transform(img, None)`` (tested).
    """
    return {
        "image_processor_type": "CLIPImageProcessor", "do_convert_rgb": True,
        "do_resize": True, "size": {"shortest_edge": eval_resize(image_size)}, "resample": 2,  # PIL bilinear
        "do_center_crop": True, "crop_size": {"height": image_size, "width": image_size},
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [PIXEL_MEAN] * 3, "image_std": [PIXEL_STD] * 3,
    }  # fmt: skip


def _release_files(config: ViTConfig) -> dict[str, str]:
    return {"preprocessor_config.json": json.dumps(eval_processor_config(config.image_size), indent=2)}


def _usage(path: str) -> str:
    return f"""```python
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageClassification

processor = AutoImageProcessor.from_pretrained("{path}")
model = AutoModelForImageClassification.from_pretrained("{path}")
inputs = processor(Image.open("image.png"), return_tensors="pt")
print(model.config.id2label[int(model(**inputs).logits.argmax(-1))])
```

`pipeline("image-classification", model="{path}")` does the same; the processor resizes and crops
exactly as the run's evaluation did, so it scores what the run reported.
"""


# DeiT (Touvron et al. 2021) Ti/S widths; B/L from Dosovitskiy et al. Table 1. All patch 16.
_SIZES = {"tiny": (12, 192, 3), "small": (12, 384, 6), "base": (12, 768, 12), "large": (24, 1024, 16)}

SPEC = register_family(FamilySpec(
    name="vit", config_class=ViTConfig,
    sizes={f"vit-{name}": dict(num_layers=layers, hidden_size=width, num_heads=heads, intermediate_size=4 * width,
                               patch_size=16)
           for name, (layers, width, heads) in _SIZES.items()},
    tasks=("image_cls",), corpus_kind="images", flops=vit_training_flops, flops_unit="sample",
    hf_model_type="vit", card_usage=_usage, release_files=_release_files,
))
