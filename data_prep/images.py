"""Image decoding, optional resize of the shorter side, and deterministic re-encoding (PIL).

Re-encoding gives every sample one format and colour mode so the training loader needs no
special cases; PNG output is lossless and byte-reproducible, JPEG is smaller. A file PIL cannot
decode raises `BadImage` and is counted and skipped by the job.
"""

from __future__ import annotations

import io

from data_prep.config import ImageConfig

__all__ = ["BadImage", "process_image"]


class BadImage(ValueError):
    """The bytes are not a decodable image."""


def process_image(data: bytes, cfg: ImageConfig) -> tuple[bytes, str, int, int]:
    """(encoded bytes, extension, width, height) of one image after resize and re-encoding."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            im = im.convert(cfg.mode)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise BadImage(str(exc)) from None
    if cfg.resize_shorter > 0 and min(im.size) != cfg.resize_shorter:
        w, h = im.size
        scale = cfg.resize_shorter / min(w, h)
        size = (max(1, round(w * scale)), max(1, round(h * scale)))
        im = im.resize(size, Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    if cfg.format == "png":
        im.save(buf, format="PNG", optimize=False, compress_level=6)
        ext = "png"
    else:
        im.save(buf, format="JPEG", quality=cfg.jpeg_quality, optimize=False, progressive=False)
        ext = "jpg"
    return buf.getvalue(), ext, im.size[0], im.size[1]
