"""Image decoding, optional resize of the shorter side, and deterministic re-encoding (PIL).

Re-encoding gives every sample one format and colour mode so the training loader needs no
special cases; PNG output is lossless and byte-reproducible, JPEG is smaller (a JPEG source that needs no
change keeps its own bytes: `_stored_as_is`). ``raw`` stores what
the accelerator needs instead: uint8 pixels (height, width, channels) at the model's square size
as a ``.npy`` member, so the loader only reads bytes (no decode, no resize: docs/benchmarks.md).

Geometry: a release's image processor resizes the user's original image once (shorter side to
``core.families.vit.eval_resize``, bilinear) and centre-crops; the run's evaluation must see the same
pixels, so what is stored here is never resized by anything else. ``raw`` stores that centre crop
itself (``core.families.vit.eval_view``: the evaluation reads it as it is), and ``resize_shorter``
is the processor's resize (bilinear, its size arithmetic), which the evaluation then repeats as a copy
when it equals ``eval_resize`` and the training refuses otherwise (``stored_geometry_problem``).
A second resize (at prepare, then at evaluation) changed 10-17 % of the digits' predictions against
``transformers``' on the same release (tests/data_prep/test_image_release.py holds them equal).
Why raw stores the processor's crop rather than the larger resized square it is cut from: the
stored square stays the model's size, so every random-resized training crop is an upsampling, where
the device's bilinear ``grid_sample`` equals PIL's, and the bytes per image stay those measured in
docs/benchmarks.md; the price is that training crops come from the evaluation's view (the centre
224/256 of the shorter side) instead of the whole centre square.
A file PIL cannot decode raises `BadImage` and is counted and skipped by the job under
``BadImage.rule``; so is a 16-bit or float image (see `process_image`).
"""

from __future__ import annotations

import io

import numpy as np

from core.corpus_kinds import RAW_PIXELS
from core.families.vit import eval_view, resize_shortest_edge
from core.images import BadImage, decode_image
from core.records import npy_bytes
from data_prep.config import ImageConfig

__all__ = ["BadImage", "process_image"]


def _stored_as_is(data: bytes, cfg: ImageConfig) -> bool:
    """A JPEG that needs no change (already upright, in the target mode, no resize) keeps its own bytes: a
    re-encode would change its pixels (at quality 90, 5 of 173 digits' predictions against the originals'),
    so what the run evaluates would no longer be what the user's file gives the release. ``jpeg_quality``
    applies to what is re-encoded. Reads the header only (`decode_image` has decoded the whole file)."""
    if cfg.format != "jpeg" or cfg.resize_shorter > 0:
        return False
    from PIL import Image

    with Image.open(io.BytesIO(data)) as src:
        return src.format == "JPEG" and src.mode == cfg.mode and src.getexif().get(0x0112, 1) == 1


def process_image(data: bytes, cfg: ImageConfig) -> tuple[bytes, str, int, int]:
    """(encoded bytes, extension, width, height) of one image after resize and re-encoding (raw: the
    model's ``cfg.size`` square of the release's processor, see the module docstring).

    The pixels are those transformers gives the released model: EXIF orientation applied
    (``load_image`` in ``pipeline("image-classification")`` calls ``ImageOps.exif_transpose``) and
    transparency composited onto white (``image_transforms.convert_to_rgb`` in its processors, since
    some 5.x release: 5.0 drops the alpha, 5.24 composites).
    A 16-bit or float image raises `BadImage` rather than turning flat white.
    """
    im = decode_image(data, cfg.mode)
    if _stored_as_is(data, cfg):
        return data, "jpg", im.size[0], im.size[1]
    if cfg.format == "raw":
        im = eval_view(im, cfg.size)
        pixels = np.asarray(im, dtype=np.uint8).reshape(cfg.size, cfg.size, -1)  # mode L: one channel
        return npy_bytes(pixels), RAW_PIXELS, cfg.size, cfg.size
    if cfg.resize_shorter > 0:
        im = resize_shortest_edge(im, cfg.resize_shorter)
    buf = io.BytesIO()
    if cfg.format == "png":
        im.save(buf, format="PNG", optimize=False, compress_level=6)
        ext = "png"
    else:
        im.save(buf, format="JPEG", quality=cfg.jpeg_quality, optimize=False, progressive=False)
        ext = "jpg"
    return buf.getvalue(), ext, im.size[0], im.size[1]
