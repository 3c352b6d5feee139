"""How an image file becomes the pixels a ViT release is given: one definition for `pretrain prepare`
(``data_prep.images``) and image fine-tuning (``pipelines.finetune.image_data``).

transformers gives a released model an image upright (``load_image`` in ``pipeline("image-classification")``
calls ``ImageOps.exif_transpose``) and opaque (``image_transforms.convert_to_rgb`` composites transparency
onto white since some 5.x release: 5.0 drops the alpha, 5.24 composites); a 16-bit or float image would be
clipped to flat white by an 8-bit conversion (and by transformers' processors), so it is refused instead.
PIL is imported on use: ``core`` stays cheap to import.
"""

from __future__ import annotations

import io
from typing import Any

__all__ = ["BadImage", "decode_image", "IMAGE_EXTENSIONS"]

#: File suffixes read as images (an image class folder's files; others are not images and are left alone).
IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"})

# PIL modes of 16/32-bit integer and float images: converting them to 8 bits clips at 255 (a flat
# white image), and transformers' processor clips them the same way, so no rescale here would match it.
_WIDE_MODES = {"I;16", "I;16B", "I;16L", "I;16N", "I", "F"}


class BadImage(ValueError):
    """The bytes are not an image this project reads; ``rule`` is the bad-record reason it is counted under."""

    def __init__(self, message: str, rule: str = "unreadable_image"):
        super().__init__(message)
        self.rule = rule


def decode_image(data: bytes, mode: str = "RGB") -> Any:
    """The PIL image of ``data`` in ``mode``: EXIF orientation applied, transparency composited onto white.

    Raises `BadImage` for bytes PIL cannot decode and for 16-bit or float images.
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            if im.mode in _WIDE_MODES:
                raise BadImage(f"16-bit or float image (PIL mode {im.mode}): convert it to 8 bits first",
                               rule="16bit_or_float_image")
            im = ImageOps.exif_transpose(im)
            if "A" in im.getbands() or im.info.get("transparency") is not None:
                # as transformers.image_transforms.convert_to_rgb: alpha over a white background
                white = Image.new("RGBA", im.size, (255, 255, 255, 255))
                im = Image.alpha_composite(white, im.convert("RGBA"))
            return im.convert(mode)
    except BadImage:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise BadImage(str(exc)) from None
