"""A release scores in ``transformers`` what the run's evaluation reported: on scikit-learn's digits, upscaled to
non-square PNGs and prepared by our prepare as PNG (kept, or resized as the processor does) and as raw pixels,
and as JPEG files prepared as JPEG (kept byte for byte: re-encoded, 5 of 173 predictions differed),
the evaluation's pixels, logits and predictions are those ``AutoImageProcessor`` + the exported model give on
the original files. Corpora whose stored images would make the two differ (an older prepare's raw or resized
images, a resize or raw size for another ``data.image_size``) are refused with one line naming the fix."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from core.corpus import DataError, load_manifest
from data_prep.config import ImageConfig, PrepConfig, SourceConfig
from data_prep.job import run_prepare
from pipelines.engine.objectives import ImageClsTask
from pipelines.loading.loader import StreamingSource

SIZE = 32  # the model's image_size; the processor resizes the shorter side to 36 (256/224) and crops 32
SHAPES = [(40, 28), (28, 52), (33, 33), (61, 45), (36, 36), (50, 36)]  # (width, height): shorter and longer than 36
CORPORA = {"png": dict(format="png"), "png-resized": dict(format="png", resize_shorter=36),
           "raw": dict(format="raw", size=SIZE), "jpeg": dict(format="jpeg")}
SOURCES = {"jpeg": "jpegs"}  # the digits as JPEG files, stored as they are (the others: from the PNGs in images/)


@pytest.fixture(scope="module")
def prepared(ray_cluster, tmp_path_factory):
    """80 digits (8 per class) as PNGs of several sizes, each prepared as in ``CORPORA``; and a release of a
    tiny ViT trained a little on the raw corpus (so its predictions differ between images)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    root = tmp_path_factory.mktemp("digits")
    d = load_digits()
    for i in range(80):
        grey = Image.fromarray((d.images[i] * 255 / 16).round().astype(np.uint8), mode="L")
        folder = root / "images" / str(d.target[i])
        folder.mkdir(parents=True, exist_ok=True)
        rgb = grey.convert("RGB").resize(SHAPES[i % len(SHAPES)], Image.Resampling.BICUBIC)
        rgb.save(folder / f"{i:04d}.png")
        (root / "jpegs" / folder.name).mkdir(parents=True, exist_ok=True)
        rgb.save(root / "jpegs" / folder.name / f"{i:04d}.jpg", quality=90)
    for name, images in CORPORA.items():
        run_prepare(PrepConfig(kind="images", output=str(root / name), progress=False, validation_fraction=0.4,
                               sources=[SourceConfig(type="image_folder", paths=[str(root / SOURCES.get(name, "images"))])],
                               images=ImageConfig(**images)))
    return root, _release(root)


def _source(m, split, task, train=False):
    return StreamingSource(m, split, task.collate, micro_batch_size=8, rank=0, world=1, num_workers=0,
                           shuffle_buffer=32, seed=0, train=train)


def _release(root: Path) -> Path:
    """A short fit of a 1-layer ViT on the raw corpus (uncropped batches), saved as a DDP-engine checkpoint and
    exported."""
    import models
    from pipelines.engine.export import export_checkpoint

    m = load_manifest(root / "raw")
    task = ImageClsTask(m, seed=0, image_size=SIZE)
    overrides = {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "patch_size": 8,
                 "num_labels": task.num_labels, "image_size": SIZE}
    torch.manual_seed(0)
    model = models.create("vit-tiny", **overrides)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = list(_source(m, "train", task).batches(limit=6))
    for step in range(30):
        loss = task.forward(model, batches[step % len(batches)])["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    ckpt = root / "run" / "step-00000030"
    (ckpt / "engine").mkdir(parents=True)
    torch.save(model.state_dict(), ckpt / "engine" / "model.pt")
    state = {"step": 30, "task": "image_cls", "engine": "ddp", "zero_stage": 0,
             "model_build": {"name": "vit-tiny", "overrides": overrides}, "data_info": {"class_map": m.class_map}}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    return export_checkpoint(ckpt, root / "release")


def _our_evaluation(corpus: Path, model) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """(keys, pixel values, logits) of the run's evaluation path over the validation split."""
    m = load_manifest(corpus)
    task = ImageClsTask(m, seed=0, image_size=SIZE)
    keys, pixels = [], []
    for batch, counted in _source(m, "validation", task).evaluation_batches():
        if counted:
            keys += batch["keys"]
            pixels.append(task.model_inputs(batch)["pixel_values"])
    with torch.no_grad():
        px = torch.cat(pixels)
        return keys, px, model(pixel_values=px).logits


@pytest.mark.parametrize("name", list(CORPORA))
def test_our_evaluation_is_what_transformers_gives_on_the_original_images(prepared, name):
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageClassification, pipeline

    root, release = prepared
    model = AutoModelForImageClassification.from_pretrained(release).eval()
    keys, ours, logits = _our_evaluation(root / name, model)
    originals = {hashlib.sha256(p.read_bytes()).hexdigest()[:16]: p for p in (root / SOURCES.get(name, "images")).rglob("*.*")}
    files = [originals[k.split("-")[0]] for k in keys]  # a record's key is its source file's sha256
    assert len(files) >= 24 and len({Image.open(f).size for f in files}) == len(SHAPES)
    processor = AutoImageProcessor.from_pretrained(release)
    theirs = processor([Image.open(f) for f in files], return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)  # one resize, the processor's; not two
    with torch.no_grad():
        torch.testing.assert_close(logits, model(pixel_values=theirs).logits, atol=1e-5, rtol=1e-5)
    labels = [model.config.id2label[int(i)] for i in logits.argmax(-1)]
    assert len(set(labels)) > 1  # a model that tells the images apart, so agreeing says something
    clf = pipeline("image-classification", model=str(release))
    assert [p[0]["label"] for p in clf([str(f) for f in files], top_k=1)] == labels


def _edited(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    raw = json.loads((dst / "manifest.json").read_text())
    edit(raw)
    (dst / "manifest.json").write_text(json.dumps(raw))
    return dst


def _as_older_prepare(raw: dict) -> None:
    """The manifest an older prepare wrote: no record of the resize it made (raw: bicubic to the model's size)."""
    for key in ("resize", "crop"):
        raw["images"].pop(key, None)


@pytest.mark.parametrize("name,image_size,why", [
    ("raw", SIZE, r"raw pixels resized by an older `pretrain prepare` .* images.format=raw images.size=32 \(into the "
                  r"same output, it rewrites the shards\)\.$"),
    ("png-resized", SIZE, r"resized \(bicubic\) to a shorter side of 36 px by an older .* images.resize_shorter=36 "),
    ("png", SIZE, None),  # never resized: the originals, read alike by every version
])
def test_a_corpus_of_an_older_prepare_is_refused_when_its_images_were_resized(prepared, tmp_path, name, image_size, why):
    old = _edited(prepared[0] / name, tmp_path / name, _as_older_prepare)
    if why is None:
        ImageClsTask(load_manifest(old), seed=0, image_size=image_size)
        return
    with pytest.raises(DataError, match=why) as info:
        ImageClsTask(load_manifest(old), seed=0, image_size=image_size)
    assert str(info.value).startswith(f"{old}/manifest.json ") and "\n" not in str(info.value)


@pytest.mark.parametrize("name,image_size,why", [
    ("raw", 16, r"raw pixels for images.size=32, not for data.image_size=16: .* images.size=16 \(or train at "
                r"data.image_size=32\)"),
    ("png-resized", 16, r"shorter side of 36 px; the evaluation at data.image_size=16 resizes them again to 18 px.*"
                        r"images.resize_shorter=18 \(or 0"),
])
def test_a_corpus_stored_for_another_image_size_is_refused(prepared, name, image_size, why):
    with pytest.raises(DataError, match=why):
        ImageClsTask(load_manifest(prepared[0] / name), seed=0, image_size=image_size)
    ImageClsTask(load_manifest(prepared[0] / "png"), seed=0, image_size=image_size)  # originals: any size


def test_train_refuses_an_older_raw_corpus_in_one_line_before_launching(prepared, tmp_path, capsys):
    from pipelines.cli import main

    old = _edited(prepared[0] / "raw", tmp_path / "old", _as_older_prepare)
    config = Path(__file__).resolve().parents[2] / "configs/train/vit_tiny_cpu.yaml"
    code = main(["train", str(config), f"data.corpus={old}", f"train.run_dir={tmp_path / 'run'}",
                 f"data.image_size={SIZE}", "--nproc", "1"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {old}/manifest.json stores raw pixels"), lines
    assert lines[0].endswith("images.format=raw images.size=32 (into the same output, it rewrites the shards)."), lines
    assert not (tmp_path / "run").exists()


def test_a_mixture_refuses_raw_corpora_stored_differently(prepared, tmp_path):
    from pipelines.loading.blend import check_blendable

    new = load_manifest(prepared[0] / "raw")
    old = load_manifest(_edited(prepared[0] / "raw", tmp_path / "old", _as_older_prepare))
    check_blendable([new, load_manifest(prepared[0] / "raw")], ["a", "b"])
    for other in (old, load_manifest(prepared[0] / "png")):
        with pytest.raises(DataError, match=r"another raw-pixel storage .* with the same images settings"):
            check_blendable([new, other], ["new", "other"])
