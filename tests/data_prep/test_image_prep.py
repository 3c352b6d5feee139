"""`process_image` stores the pixels transformers gives the released model: EXIF orientation applied
(``load_image``), transparency composited onto white (``convert_to_rgb``), resized as its processor resizes
(raw: its whole view); 16-bit images are bad records."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from data_prep.config import ImageConfig
from data_prep.images import BadImage, process_image


def _pixels(encoded: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(encoded)) as im:
        return np.asarray(im.convert("RGB"))


def _asymmetric(w: int = 40, h: int = 24) -> np.ndarray:
    """A non-square RGB image whose corners differ: red top-left block, blue bottom-right block."""
    a = np.full((h, w, 3), 128, np.uint8)
    a[:8, :8] = (255, 0, 0)
    a[-8:, -8:] = (0, 0, 255)
    return a


def _png(im: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG", **kw)
    return buf.getvalue()


@pytest.mark.parametrize("orientation, transpose", [(6, Image.Transpose.ROTATE_270), (8, Image.Transpose.ROTATE_90)])
@pytest.mark.parametrize("fmt", ["png", "jpeg"])
def test_exif_orientation_is_applied(orientation, transpose, fmt):
    src = Image.fromarray(_asymmetric())
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    src.save(buf, format="JPEG", quality=95, exif=exif.tobytes())
    data, _, w, h = process_image(buf.getvalue(), ImageConfig(format=fmt))
    assert (w, h) == (24, 40)  # rotated: portrait
    stored = _pixels(data).astype(int)
    with Image.open(io.BytesIO(buf.getvalue())) as decoded:
        expected = np.asarray(decoded.convert("RGB").transpose(transpose)).astype(int)
    assert stored.shape == expected.shape == (40, 24, 3)
    assert np.abs(stored - expected).mean() < 4  # JPEG tolerance
    # the same pixels as transformers' pipeline loader
    from transformers.image_utils import load_image

    assert np.abs(stored - np.asarray(load_image(Image.open(io.BytesIO(buf.getvalue())))).astype(int)).mean() < 4


def _rgba() -> Image.Image:
    a = np.zeros((20, 30, 4), np.uint8)
    a[..., :3] = (200, 30, 60)  # colour hidden under the transparent half
    a[:, :15, 3] = 255
    a[:, 15:20, 3] = 128  # half-transparent band
    return Image.fromarray(a, "RGBA")


def _convert_to_rgb(data: bytes) -> np.ndarray:
    """What transformers' processors make of the image: their ``convert_to_rgb`` where it composites alpha
    onto white (transformers 5.24 does; 5.0, our lowest, drops the alpha), else the same composite by hand."""
    from transformers.image_transforms import convert_to_rgb

    clear = Image.new("RGBA", (1, 1), (0, 0, 0, 0))
    with Image.open(io.BytesIO(data)) as im:
        if np.asarray(convert_to_rgb(clear)).reshape(-1)[:3].tolist() == [255, 255, 255]:
            return np.asarray(convert_to_rgb(im))
        white = Image.new("RGBA", im.size, (255, 255, 255, 255))
        return np.asarray(Image.alpha_composite(white, im.convert("RGBA")).convert("RGB"))


def test_rgba_transparency_is_white_as_transformers_processor():
    data = _png(_rgba())
    stored, ext, _, _ = process_image(data, ImageConfig(format="png"))
    assert ext == "png"
    px = _pixels(stored)
    assert (px[:, 20:] == 255).all()  # fully transparent: white, not black or the hidden colour
    assert (px[:, :15] == (200, 30, 60)).all()
    np.testing.assert_array_equal(px, _convert_to_rgb(data))  # lossless PNG: exact


def test_rgba_as_jpeg_matches_transformers_processor_within_jpeg_tolerance():
    data = _png(_rgba())
    stored, ext, _, _ = process_image(data, ImageConfig(format="jpeg", jpeg_quality=95))
    assert ext == "jpg"
    diff = np.abs(_pixels(stored).astype(int) - _convert_to_rgb(data).astype(int))
    assert diff.mean() < 4
    assert _pixels(stored)[:, 24:].min() > 240


def test_palette_transparency_is_white():
    p = Image.new("P", (16, 12), 1)
    p.putpalette([0, 0, 0, 10, 200, 30] + [0, 0, 0] * 254)
    for y in range(12):
        for x in range(8):
            p.putpixel((x, y), 0)  # left half: index 0 (black, transparent)
    data = _png(p, transparency=0)
    with Image.open(io.BytesIO(data)) as check:
        assert check.mode == "P" and check.info.get("transparency") == 0
    stored, _, _, _ = process_image(data, ImageConfig(format="png"))
    px = _pixels(stored)
    assert (px[:, :8] == 255).all()
    assert (px[:, 8:] == (10, 200, 30)).all()
    np.testing.assert_array_equal(px, _convert_to_rgb(data))
    gray, _, _, _ = process_image(data, ImageConfig(format="png", mode="L"))
    with Image.open(io.BytesIO(gray)) as g:
        assert (np.asarray(g)[:, :8] == 255).all()


def test_raw_format_composites_onto_white_too():
    stored, _, _, _ = process_image(_png(_rgba()), ImageConfig(format="raw", size=20))
    px = np.load(io.BytesIO(stored))
    assert px.shape == (20, 20, 3)
    assert (px[:, -3:] == 255).all()


def test_16bit_png_is_a_bad_record_with_its_reason():
    a = (np.arange(20 * 30, dtype=np.uint16).reshape(20, 30) * 100).astype(np.uint16)
    data = _png(Image.fromarray(a))
    with Image.open(io.BytesIO(data)) as check:
        assert check.mode.startswith("I")
    with pytest.raises(BadImage, match="16-bit or float image.*convert it to 8 bits") as info:
        process_image(data, ImageConfig(format="png"))
    assert info.value.rule == "16bit_or_float_image"


def test_the_job_counts_a_16bit_image_under_its_reason(tmp_path):
    from data_prep.context import JobContext
    from data_prep.stages import map_images

    a = (np.arange(20 * 30, dtype=np.uint16).reshape(20, 30) * 100).astype(np.uint16)
    wide, broken = tmp_path / "wide.png", tmp_path / "broken.png"
    Image.fromarray(a).save(wide)
    broken.write_bytes(b"not an image")
    ctx = JobContext(kind="images", sources=[], clean={}, images={}, seed=0, seq_len=0, short_seq_prob=0.0,
                     nsp_random_prob=0.0, dupe_factor=1, validation_fraction=0.0, output=str(tmp_path), job_id="t")
    stats = map_images([{"path": str(wide), "label": 0}, {"path": str(broken), "label": 0}], ctx)[0]
    assert stats["bad_by_file"] == {str(wide): {"16bit_or_float_image": 1}, str(broken): {"unreadable_image": 1}}
    assert stats["counts"].get("documents_in", 0) == 0


def _processor(tmp_path, size: int):
    """The image processor a release of a ``size`` px ViT ships (its preprocessor_config.json)."""
    from transformers import AutoImageProcessor

    from core.families.vit import eval_processor_config

    (tmp_path / "preprocessor_config.json").write_text(json.dumps(eval_processor_config(size)))
    return AutoImageProcessor.from_pretrained(tmp_path)


@pytest.mark.parametrize("size", [32, 64])  # the processor resizes to 36 / 73: even and odd margins around the crop
def test_raw_pixels_and_resized_pngs_are_what_the_release_processor_sees(tmp_path, size):
    """Raw stores the processor's view itself (one bilinear resize, its crop); a PNG resized to the processor's
    shorter side is one the processor only crops. Before, both were resized bicubic (raw to ``size``)."""
    from core.families.vit import eval_resize

    processor = _processor(tmp_path, size)
    rng = np.random.default_rng(0)
    for w, h in [(53, 37), (37, 61), (300, 41), (73, 73), (20, 90), (8, 8)]:
        original = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        theirs = processor(original, return_tensors="np")["pixel_values"][0]
        stored, _, _, _ = process_image(_png(original), ImageConfig(format="raw", size=size))
        pixels = np.load(io.BytesIO(stored))
        assert pixels.shape == (size, size, 3)
        np.testing.assert_allclose((pixels.transpose(2, 0, 1) / 255 - 0.5) / 0.5, theirs, atol=1e-6)
        data, _, rw, rh = process_image(_png(original), ImageConfig(format="png", resize_shorter=eval_resize(size)))
        with Image.open(io.BytesIO(data)) as resized:
            assert min(rw, rh) == eval_resize(size)
            np.testing.assert_allclose(processor(resized, return_tensors="np")["pixel_values"][0], theirs, atol=1e-6)


def _jpeg(im: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=85, **kw)
    return buf.getvalue()


def test_a_jpeg_that_needs_no_change_keeps_its_bytes_so_its_pixels_are_the_users():
    """Re-encoding an upright RGB JPEG at images.jpeg_quality changed its pixels (5 of 173 digits' predictions
    against the original files'); one that needs no change is stored as it came, another is still re-encoded."""
    src = Image.fromarray(_asymmetric())
    upright = _jpeg(src)
    data, ext, w, h = process_image(upright, ImageConfig(format="jpeg", jpeg_quality=60))
    assert (data, ext, (w, h)) == (upright, "jpg", src.size)
    exif = Image.Exif()
    exif[0x0112] = 1  # tagged upright
    tagged = _jpeg(src, exif=exif.tobytes())
    assert process_image(tagged, ImageConfig(format="jpeg"))[0] == tagged
    exif[0x0112] = 6
    for changed, cfg in [(_jpeg(src, exif=exif.tobytes()), ImageConfig(format="jpeg")),  # must be rotated
                         (upright, ImageConfig(format="jpeg", resize_shorter=12)),  # resized
                         (upright, ImageConfig(format="jpeg", mode="L")),  # another mode
                         (_jpeg(src.convert("L")), ImageConfig(format="jpeg")),  # a grey JPEG for an RGB corpus
                         (upright, ImageConfig(format="png"))]:  # another format
        data, _, _, _ = process_image(changed, cfg)
        assert data != changed
        with Image.open(io.BytesIO(data)) as im:
            assert im.mode == cfg.mode
