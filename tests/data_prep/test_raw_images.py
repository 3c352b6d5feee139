"""Raw-pixel image corpora (``images.format: raw``): prepared by our prepare from scikit-learn's digits, they give
the evaluation batches the PNG corpus of the same images gives (the release processor's view, stored once and
read as it is) and the training batches PIL gives on the stored pixels (crop, flip, normalisation and mixup done
where the batch is, on the device), a model trains on them, and a damaged record is an error naming its shard."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from core.config import ConfigError
from core.corpus import DataError, load_manifest, verify_shards
from data_prep.config import ImageConfig, PrepConfig, SourceConfig
from data_prep.inspect_corpus import inspect_corpus
from data_prep.job import run_prepare
from pipelines.engine.objectives import ImageClsTask
from pipelines.loading.loader import StreamingSource

SIZE = 8  # the digits' own size: stored as the model reads them


@pytest.fixture(scope="module")
def digits(ray_cluster, tmp_path_factory):
    """The same 300 digit PNGs prepared twice: encoded (png) and raw (uint8 8x8x3)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    root = tmp_path_factory.mktemp("digits")
    d = load_digits()
    for i in range(300):
        folder = root / "images" / str(d.target[i])
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((d.images[i] * 15).astype(np.uint8), mode="L").save(folder / f"{i:04d}.png")
    for fmt, extra in (("png", {}), ("raw", {"size": SIZE})):
        summary = run_prepare(PrepConfig(kind="images", output=str(root / fmt), progress=False, validation_fraction=0.2,
                                         sources=[SourceConfig(type="image_folder", paths=[str(root / "images")])],
                                         images=ImageConfig(format=fmt, **extra)))
        assert "map: read, decode, route" in summary["stages_s"]  # an image job tokenizes nothing
    return root


def _source(m, split, task, train, **kw):
    return StreamingSource(m, split, task.collate, micro_batch_size=16, rank=0, world=1, num_workers=0,
                           shuffle_buffer=64, seed=3, train=train, **kw)


def _through_pil(task, raw_batch):
    """The pixel values the PIL path (encoded images) makes of a raw batch's own stored pixels: the same keys and
    epoch draw the same crops, flips and mixup (the labels, compared with the PNG corpus's, do not enter)."""
    from PIL import Image

    samples = [{"key": k, "image": Image.fromarray(px.numpy()).convert("RGB"), "label": 0}
               for k, px in zip(raw_batch["keys"], raw_batch["pixels"], strict=True)]
    return task.collate(samples, epoch=0, train=True)["pixel_values"]


@pytest.mark.parametrize("split,train,mixup", [("train", True, 0.0), ("train", True, 0.4), ("validation", False, 0.0)])
def test_a_raw_corpus_gives_the_png_corpus_eval_batches_and_pil_training_crops(digits, split, train, mixup):
    png, raw = load_manifest(digits / "png"), load_manifest(digits / "raw")
    assert png.image_shape is None and raw.image_shape == (SIZE, SIZE, 3)
    assert json.loads((digits / "raw/manifest.json").read_text())["images"] == {
        "format": "raw", "shape": [SIZE, SIZE, 3], "dtype": "uint8", "layout": "HWC",
        "resize": {"shortest_edge": 9, "resample": "bilinear"}, "crop": SIZE}  # 8 px: 9 (256/224) then the centre 8
    if not mixup:
        assert "image [8, 8] RGB raw  label" in inspect_corpus(str(digits / "raw"), n=1)
    task = ImageClsTask(png, seed=0, image_size=SIZE, mixup_alpha=mixup)
    a, b = _source(png, split, task, train), _source(raw, split, task, train)
    n = 3 if train else a.batches_per_epoch
    for x, y in zip(a.batches(limit=n), b.batches(limit=n), strict=True):
        assert x["keys"] == y["keys"] and torch.equal(x["labels"], y["labels"])
        assert y["pixels"].dtype == torch.uint8 and "pixel_values" not in y  # the loader only stacked bytes
        got = task.model_inputs(y)["pixel_values"]
        assert got.shape == (16, 3, SIZE, SIZE)
        if not train:  # the PNG's one resize + crop, stored: read as it is (float rounding only)
            torch.testing.assert_close(got, x["pixel_values"], atol=1e-5, rtol=0)
            continue
        want = _through_pil(task, y)
        # PIL rounds its resized pixels to uint8 (and is fixed-point): within 2 grey levels, normalised by std 0.5
        assert torch.allclose(got, want, atol=2 / 255 / 0.5), float((got - want).abs().max())
        assert y["flips"].any() and not y["flips"].all()


def test_a_model_trains_on_raw_pixels(digits):
    from core.families.vit import SPEC
    from models.vit import ViT

    m = load_manifest(digits / "raw")
    task = ImageClsTask(m, seed=0, image_size=SIZE)
    torch.manual_seed(0)
    model = ViT(SPEC.config("vit-tiny", image_size=SIZE, patch_size=4, num_labels=task.num_labels, num_layers=1,
                           hidden_size=32, num_heads=2, intermediate_size=64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = list(_source(m, "train", task, False).batches(limit=4))  # no random crops: a short fit shows
    losses = []
    for step in range(30):
        batch = batches[step % len(batches)]
        loss = task.forward(model, batch)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert np.mean(losses[-4:]) < 0.8 * np.mean(losses[:4]), losses


@pytest.mark.parametrize("shape,why", [("(9, 8, 3)", "EOF: reading array data"),
                                       ("(4,16, 3)", r"raw image of shape \(4, 16, 3\), the manifest records \(8, 8, 3\)")])
def test_a_damaged_raw_record_is_an_error_naming_its_shard(digits, tmp_path, shape, why):
    corpus = tmp_path / "raw"
    shutil.copytree(digits / "raw", corpus)
    shard = corpus / "train-000000.tar"
    data = shard.read_bytes()
    old = b"'shape': (8, 8, 3)"
    assert data.count(old) > 2
    new = b"'shape': " + shape.encode()
    assert len(new) == len(old)
    shard.write_bytes(data.replace(old, new, 2))  # two records: same bytes, another header
    m = load_manifest(corpus)
    task = ImageClsTask(m, seed=0, image_size=SIZE)
    with pytest.raises(DataError, match=r"train-000000.tar has a different sha256"):  # what a run checks first
        verify_shards(m, ["train"])
    with pytest.raises(DataError, match=rf"Bad sample \S+ in shard train-000000.tar of {corpus}: .*{why}"):
        list(_source(m, "train", task, True, verify_checksums=False, on_bad_sample="fail").batches(limit=100))
    with pytest.raises(DataError, match=rf"are bad \(more than data.max_bad_share=0.001\); .*shard train-000000.tar: .*{why}"):
        list(_source(m, "train", task, True, verify_checksums=False).batches(limit=100))


def test_raw_needs_its_size():
    with pytest.raises(ConfigError, match="images.size"):
        ImageConfig(format="raw")
    with pytest.raises(ConfigError, match="applies to images.format=raw only"):
        ImageConfig(format="png", size=224)
    # raw stores the evaluation's view itself: a resize_shorter beside it was ignored without a word
    with pytest.raises(ConfigError, match=r"images.resize_shorter=64 applies to png and jpeg only.*shorter side 36"):
        ImageConfig(format="raw", size=32, resize_shorter=64)
