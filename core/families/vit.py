"""ViT (Dosovitskiy et al. 2021), torch-free half: config, named sizes, per-image FLOPs, HF ``vit``.

The module is ``models.vit.ViT``; the FLOPs conventions are in ``models.flops``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from .spec import FamilySpec, register_family
from .transformer import TransformerConfig, attention_flops, block_matmul_params

__all__ = ["ViTConfig", "SPEC", "vit_training_flops", "eval_resize", "eval_processor_config", "PIXEL_MEAN", "PIXEL_STD",
           "EVAL_RESAMPLE", "usage_snippet", "shortest_edge_size", "resize_shortest_edge", "eval_view", "stored_geometry_problem"]


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


#: PIL resample filter of the one resize between an original image and the model (2 = bilinear): the
#: evaluation's, the release processor's (``eval_processor_config``) and prepare's (``data_prep.images``).
EVAL_RESAMPLE = 2


def eval_resize(image_size: int) -> int:
    """Shorter side before the eval centre crop: 256 for 224 (the ratio of ViT's and ResNet's evaluations)."""
    return image_size * 256 // 224


def shortest_edge_size(width: int, height: int, shortest_edge: int) -> tuple[int, int]:
    """(width, height) with the shorter side ``shortest_edge``: transformers' arithmetic
    (``get_resize_output_image_size(..., default_to_square=False)``: the longer side truncated, not rounded)."""
    if width <= height:
        return shortest_edge, int(shortest_edge * height / width)
    return int(shortest_edge * width / height), shortest_edge


def resize_shortest_edge(img: Any, shortest_edge: int) -> Any:
    """A PIL image with its shorter side resized to ``shortest_edge`` as the release's processor does (bilinear).

    PIL returns a copy when the size is already that, so resizing an image this gave again changes nothing:
    that is why prepare stores this and not another resize (see ``stored_geometry_problem``)."""
    return img.resize(shortest_edge_size(*img.size, shortest_edge), EVAL_RESAMPLE)


def eval_view(img: Any, image_size: int) -> Any:
    """The ``image_size`` square the evaluation and the release's processor give the model, before rescaling:
    shorter side to ``eval_resize`` (bilinear), then the centre crop (transformers' ``center_crop`` offsets).

    ``images.format=raw`` stores exactly this, so the evaluation reads raw pixels as they are: one resize from
    the original, as ``AutoImageProcessor`` makes on the release (a second one, at prepare, changed 10-17 % of
    the digits' predictions)."""
    img = resize_shortest_edge(img, eval_resize(image_size))
    w, h = img.size
    left, top = (w - image_size) // 2, (h - image_size) // 2
    return img.crop((left, top, left + image_size, top + image_size))


def stored_geometry_problem(manifest: dict[str, Any], image_size: int) -> str | None:
    """Why the evaluation of a model reading ``image_size`` px on the images corpus of ``manifest`` (its
    ``manifest.json``) would not see what the release's processor sees on the original images; None if it would.

    The processor resizes an original once (shorter side to ``eval_resize``, bilinear) and centre-crops.
    A corpus agrees if it stores the originals (no resize), that resize (png/jpeg ``resize_shorter`` equal
    to ``eval_resize``: the evaluation's resize is then a copy) or, raw, that view itself. Corpora of older
    prepares resized bicubic (raw: to the model's size), which made the evaluation resize a second time.
    """
    images = manifest.get("images") or {}
    edge = eval_resize(image_size)
    if images.get("format") == "raw":
        fix = f"re-run `pretrain prepare` with images.format=raw images.size={image_size}"
        if "crop" not in images:
            return (f"stores raw pixels resized by an older `pretrain prepare` (bicubic, to the model size), which the "
                    f"evaluation would resize again unlike the release's image processor: {fix} (into the same "
                    f"output, it rewrites the shards)")
        if images["crop"] != image_size:
            return (f"stores raw pixels for images.size={images['crop']}, not for data.image_size={image_size}: "
                    f"{fix} (or train at data.image_size={images['crop']})")
        return None
    if "resize" in images:
        shorter = int((images["resize"] or {}).get("shortest_edge") or 0)
    else:  # an older prepare: resize_shorter was bicubic (and rounded)
        shorter = int(((manifest.get("prep_config") or {}).get("images") or {}).get("resize_shorter") or 0)
        if shorter:
            return (f"stores images resized (bicubic) to a shorter side of {shorter} px by an older `pretrain prepare`, "
                    f"not as the release's image processor resizes them (bilinear, to {edge} px): re-run `pretrain "
                    f"prepare` with images.resize_shorter={edge} (or 0 to keep the originals)")
    if shorter and shorter != edge:
        return (f"stores images resized to a shorter side of {shorter} px; the evaluation at data.image_size="
                f"{image_size} resizes them again to {edge} px, which the release's image processor does not do "
                f"(it resizes the originals once): re-run `pretrain prepare` with images.resize_shorter={edge} "
                f"(or 0 to keep the originals)")
    return None


def eval_processor_config(image_size: int) -> dict[str, Any]:
    """``preprocessor_config.json`` that makes ``transformers`` see the pixels the image_cls evaluation sees.

    ``CLIPImageProcessor`` is the standard processor that resizes the shorter side and centre-crops
    in every supported ``transformers`` version (``ViTImageProcessor`` squashes to a square);
    with its PIL backend it gives ``eval_view`` of the original image, rescaled and normalised, which is
    what ``ImageClsTask`` evaluates on every corpus ``stored_geometry_problem`` accepts (tested).
    """
    return {
        "image_processor_type": "CLIPImageProcessor", "do_convert_rgb": True,
        "do_resize": True, "size": {"shortest_edge": eval_resize(image_size)}, "resample": EVAL_RESAMPLE,
        "do_center_crop": True, "crop_size": {"height": image_size, "width": image_size},
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [PIXEL_MEAN] * 3, "image_std": [PIXEL_STD] * 3,
    }  # fmt: skip


def _release_files(config: ViTConfig) -> dict[str, str]:
    return {"preprocessor_config.json": json.dumps(eval_processor_config(config.image_size), indent=2)}


def usage_snippet(path: str) -> str:
    """The card's Python block: the release scored on one image, made upright and opaque as the run's images were
    (``core.images.decode_image``): the processor applies no EXIF and not every transformers version composites."""
    return f"""```python
from PIL import Image, ImageOps
from transformers import AutoImageProcessor, AutoModelForImageClassification

processor = AutoImageProcessor.from_pretrained("{path}")
model = AutoModelForImageClassification.from_pretrained("{path}")
image = ImageOps.exif_transpose(Image.open("image.png")).convert("RGBA")  # upright, as the run stored it
image = Image.alpha_composite(Image.new("RGBA", image.size, "white"), image).convert("RGB")  # opaque, likewise
inputs = processor(image, return_tensors="pt")
print(model.config.id2label[int(model(**inputs).logits.argmax(-1))])
```
"""


def _usage(path: str) -> str:
    return f"""{usage_snippet(path)}
The processor resizes and crops exactly as the run's evaluation did, so on the image `pretrain prepare`
stored it scores what the run reported. Prepare stored each image upright (its EXIF orientation applied)
and opaque (transparency composited onto white); the processor does not apply EXIF, and not every
transformers version composites (5.0 drops the alpha): hence the two lines above.
`pipeline("image-classification", model="{path}")` does the same except on images with transparency:
its image loader applies the EXIF orientation but drops the alpha channel, where the run composited onto
white; give such images to the processor as above.
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
