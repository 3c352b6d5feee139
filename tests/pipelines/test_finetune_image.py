"""Image-classification fine-tuning of ViT releases (`train.task=image_classification`): the class-folder reader's
errors, the family refusals both ways, our classifier computing what transformers' `ViTForImageClassification`
computes on the release processor's pixels, and (slow) digits fine-tuned from our release and a transformers
directory, the export scoring under `pipeline("image-classification")` what the run reported."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from image_fixtures import save_hf_vit, save_our_vit_checkpoint, write_digit_folders
from PIL import Image

from pipelines.cli import main
from pipelines.finetune import FinetuneError

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs/finetune/image_classification.yaml"


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """Our ViT release (a run checkpoint exported as `pretrain export` does) and transformers ViT directories."""
    from pipelines.engine.export import export_checkpoint

    root = tmp_path_factory.mktemp("vit-releases")
    return {"ours": export_checkpoint(save_our_vit_checkpoint(root / "run"), root / "ours"),
            "transformers": save_hf_vit(root / "hf"), "transformers-bare": save_hf_vit(root / "hf-bare", bare=True)}


def _png(path: Path, seed: int, size=(12, 9), mode="RGB") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shape = (size[1], size[0]) + ((len(mode),) if len(mode) > 1 else ())
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode).save(path)
    return path


def _folders(root: Path, classes=("cat", "dog"), per_class=3) -> Path:
    for c in classes:
        for i in range(per_class):
            _png(root / c / f"{i}.png", hash((c, i)) % 1000)
    return root


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err  # one line, no traceback
    return lines[0]


def _finetune(capsys, checkpoint, train, validation, run_dir, *extra) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["finetune", str(CONFIG), f"checkpoint={checkpoint}", f"data.train={train}",
                 f"data.validation={validation}", f"train.run_dir={run_dir}", *extra])
    return code, capsys.readouterr().err


# ------------------------------------------------------------------------------ the class-folder reader


def _unreadable(root: Path) -> Path:
    (root / "cat" / "broken.png").write_bytes(b"not a png at all")
    return root / "cat" / "broken.png"


def _sixteen_bit(root: Path) -> Path:
    path = root / "dog" / "deep.png"
    Image.fromarray(np.full((9, 12), 40000, dtype=np.uint16)).save(path)
    assert Image.open(path).mode in {"I;16", "I"}  # Pillow 13 reads it as I;16, Pillow 10 (our lowest) as I
    return path


@pytest.mark.parametrize(("breaks", "message"), [
    (lambda r: r / "absent", r"data.train=.*absent does not exist. Point data.train at a folder holding one sub-folder of images per class"),
    (lambda r: r / "cat" / "0.png", r"data.train=.*0.png is a file, not a folder. Point data.train at a folder holding one"),
    (lambda r: (_png(r / "loose.png", 1), r)[1], r"loose.png lies in data.train .* itself, not in a class folder .*Move it into"),
    (lambda r: ((r / "bird").mkdir(), r)[1], r"bird \(class 'bird' of data.train\) holds no images .*Add its images, or remove the folder"),
    (lambda r: r / "cat", r"data.train .*cat holds images \(0.png, 3 in all\) but no class folders: .*Point data.train at the folder above"),
    (lambda r: ((r / "empty").mkdir(), r / "empty")[1], r"data.train .*empty has no class folders. Put each class's images in a sub-folder"),
    (lambda r: (_unreadable(r), r)[1], r"1 unreadable images \(first at .*broken.png .*over the limit of 1.0% \(data.max_bad_share\)"),
    (lambda r: (_sixteen_bit(r), r)[1], r"1 16bit or float images \(first at .*deep.png \(16-bit or float image .*convert it to 8 bits"),
])
def test_a_bad_train_folder_is_one_line_naming_it_and_the_fix_exit_2(releases, tmp_path, capsys, breaks, message):
    train = breaks(_folders(tmp_path / "train"))
    dev = _folders(tmp_path / "dev")
    code, err = _finetune(capsys, releases["ours"], train, dev, tmp_path / "run")
    line = _one_error_line(err)
    assert code == 2 and __import__("re").search(message, line), line
    assert not (tmp_path / "run").exists()  # nothing written


def test_a_dev_class_train_lacks_and_a_single_class_are_refused(tmp_path):
    """Also what the reader says itself (a launched rank's run_finetune) of a missing folder or a file."""
    from pipelines.finetune.image_data import read_image_folder

    with pytest.raises(FinetuneError, match=r"data.train .*absent does not exist. Point it at a folder holding one"):
        read_image_folder(tmp_path / "absent")
    with pytest.raises(FinetuneError, match=r"data.validation .*f.png is a file, not a folder: .*Point data.validation at"):
        read_image_folder(_png(tmp_path / "f.png", 0), what="data.validation")

    train, dev = _folders(tmp_path / "train"), _folders(tmp_path / "dev", classes=("cat", "dog", "fox"))
    _, labels, _ = read_image_folder(train)
    assert labels == ["cat", "dog"]
    with pytest.raises(FinetuneError, match=r"data.validation .*dev has class folder\(s\) fox that data.train does not have"):
        read_image_folder(dev, what="data.validation", label_names=labels)
    with pytest.raises(FinetuneError, match=r"has one class folder \(cat\); a classifier needs at least 2"):
        read_image_folder(_folders(tmp_path / "one", classes=("cat",)))


def test_bad_images_within_max_bad_share_are_skipped_and_reported(tmp_path):
    """As the text reader: a few bad files are counted with the first one named, and left out."""
    from pipelines.finetune.image_data import read_image_folder

    root = _folders(tmp_path / "train", per_class=4)
    bad = _unreadable(root)
    (root / "dog" / "notes.txt").write_text("not an image suffix: left alone")
    examples, labels, report = read_image_folder(root, max_bad_share=0.2)
    assert len(examples) == 8 and report.total == 9 and str(bad) not in [e.path for e in examples]
    assert "8 kept, 1 skipped: 1 unreadable images (first at" in report.summary() and str(bad) in report.summary()
    # a dev folder may lack a class; its labels are train's indices
    dev = _folders(tmp_path / "dev", classes=("dog",))
    dev_examples, _, _ = read_image_folder(dev, label_names=labels)
    assert {e.label for e in dev_examples} == {1}


def test_the_reader_decodes_as_prepare_does_exif_and_transparency(tmp_path):
    """The same rules as `pretrain prepare`'s images (one function): upright by EXIF, transparency onto white."""
    from data_prep.config import ImageConfig
    from data_prep.images import process_image
    from pipelines.finetune.image_data import load_image

    img = Image.new("RGBA", (6, 4), (255, 0, 0, 0))
    img.putpixel((0, 0), (0, 0, 255, 255))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90
    path = tmp_path / "a.png"
    img.save(path, exif=exif)
    ours = load_image(path)
    assert ours.size == (4, 6) and ours.mode == "RGB"
    assert ours.getpixel((1, 1)) == (255, 255, 255)  # transparent red is white, not red or black
    data, _, _, _ = process_image(path.read_bytes(), ImageConfig(format="png", resize_shorter=0, mode="RGB"))
    assert np.array_equal(np.asarray(Image.open(__import__("io").BytesIO(data))), np.asarray(ours))


# ------------------------------------------------------------------------------ which releases


@pytest.mark.parametrize("family", ["bert", "gpt"])
def test_image_classification_refuses_a_text_release_in_one_line(tmp_path, capsys, family):
    from finetune_fixtures import save_hf_bert_checkpoint, save_hf_gpt2

    release = save_hf_bert_checkpoint(tmp_path / "bert") if family == "bert" else save_hf_gpt2(tmp_path / "gpt")
    images = _folders(tmp_path / "imgs")
    code, err = _finetune(capsys, release, images, images, tmp_path / "run")
    line = _one_error_line(err)
    hint = "classification or qa" if family == "bert" else "classification"
    assert code == 2 and f"holds a {family} model; image_classification fine-tuning needs a ViT image model" in line
    assert f"A {family} release fine-tunes with train.task={hint}." in line, line
    assert not (tmp_path / "run").exists()


def test_text_classification_refuses_a_vit_release_and_names_the_image_task(releases, tmp_path, capsys):
    images = _folders(tmp_path / "imgs")
    capsys.readouterr()
    code = main(["finetune", str(REPO / "configs/finetune/classification_small.yaml"), f"checkpoint={releases['ours']}",
                 f"data.train={images}", f"data.validation={images}", f"train.run_dir={tmp_path / 'run'}"])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and "holds a vit model; classification fine-tuning needs a BERT" in line, line
    assert "A vit release fine-tunes with train.task=image_classification." in line


def test_a_release_without_its_image_processor_is_refused(releases, tmp_path):
    import shutil

    from pipelines.finetune.image_classification import load_processor

    release = Path(shutil.copytree(releases["transformers"], tmp_path / "noproc"))
    (release / "preprocessor_config.json").unlink()
    with pytest.raises(FinetuneError, match=r"no preprocessor_config.json, .*ViTImageProcessor\(size="):
        load_processor(release, 32, 3)
    with pytest.raises(FinetuneError, match=r"makes images of shape \(3, 32, 32\) but the model .* reads 3x48x48"):
        load_processor(releases["transformers"], 48, 3)


# ------------------------------------------------------------------------------ the model


@pytest.mark.parametrize("source", ["ours", "transformers", "transformers-bare"])
def test_our_classifier_computes_what_vit_for_image_classification_computes(releases, source, tmp_path):
    """Same weights, a batch of differently sized images made by the release's own processor: logits and loss
    equal transformers'; the trunk is the release's, the new head is fresh, and init=random is another trunk."""
    import transformers

    import models
    from pipelines.finetune.config import AugmentConfig
    from pipelines.finetune.image_classification import (
        ImageBatcher,
        ImageClassificationTask,
        build_image_classifier,
        load_processor,
    )

    release, labels = releases[source], ["ant", "bee", "cow"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # only the expected fresh head: no warning about other keys
        ours = build_image_classifier(release, labels, "pretrained", seed=0)
    assert ours.config.id2label == {0: "ant", 1: "bee", 2: "cow"} and not ours.head.bias.any()
    assert 0 < ours.head.weight.abs().max() <= 2 * ours.config.initializer_range
    if source == "transformers":  # its head has 3 classes too, other ones: not loaded as the new task's
        from safetensors.torch import load_file

        old = load_file(release / "model.safetensors")["classifier.weight"]
        assert old.shape == ours.head.weight.shape and not torch.equal(old, ours.head.weight)
    torch.manual_seed(3)
    with torch.no_grad():
        ours.head.weight.normal_(0, 0.5)  # a trained head's values, so the logits differ clearly
        ours.head.bias.normal_(0, 0.5)
    ours.eval()
    paths = [_png(tmp_path / f"{i}.png", i, size=s) for i, s in enumerate([(32, 32), (53, 37), (20, 61)])]
    batcher = ImageBatcher(load_processor(release, 32, 3), seed=0, augment=AugmentConfig())
    batch = batcher([{"path": str(p), "label": y, "index": i, "train": False, "valid": True}
                     for i, (p, y) in enumerate(zip(paths, [2, 0, 1], strict=True))])
    theirs = transformers.ViTForImageClassification.from_pretrained(str(release), num_labels=3,
                                                                     ignore_mismatched_sizes=True).eval()
    with torch.no_grad():
        theirs.classifier.weight.copy_(ours.head.weight)
        theirs.classifier.bias.copy_(ours.head.bias)
        mine = ImageClassificationTask(3, batcher).forward(ours, batch)
        ref = theirs(pixel_values=batch["pixel_values"], labels=batch["labels"])
        exported = models.hf.to_hf(ours)(pixel_values=batch["pixel_values"]).logits
    torch.testing.assert_close(mine["logits"], ref.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine["loss"], ref.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(exported, ref.logits, atol=1e-5, rtol=1e-5)
    scratch = build_image_classifier(release, labels, "random", seed=0)
    assert not torch.equal(scratch.blocks[0].mlp.fc1.weight, ours.blocks[0].mlp.fc1.weight)


def test_training_augmentation_is_per_epoch_and_item_and_off_able(releases, tmp_path):
    """Drawn from (seed, epoch, item): the same on a rerun (and a resumed epoch), another next epoch; with
    augment off, training sees exactly the evaluation's pixels. `MapStyleSource` passes each batch its epoch."""
    from pipelines.finetune.config import AugmentConfig
    from pipelines.finetune.image_classification import ImageBatcher, load_processor
    from pipelines.loading.map_style import MapStyleSource

    processor = load_processor(releases["ours"], 32, 3)
    items = [{"path": str(_png(tmp_path / f"{i}.png", i, size=(40, 30))), "label": 0, "index": i, "train": True,
              "valid": True} for i in range(4)]
    on = ImageBatcher(processor, seed=0, augment=AugmentConfig(min_crop_area=0.5, hflip=True))
    off = ImageBatcher(processor, seed=0, augment=AugmentConfig(min_crop_area=1.0, hflip=False))
    a, again, later = on(items, epoch=0)["pixel_values"], on(items, epoch=0)["pixel_values"], on(items, epoch=1)["pixel_values"]
    assert torch.equal(a, again) and not torch.equal(a, later)
    eval_view = off([{**it, "train": False} for it in items])["pixel_values"]
    assert torch.equal(off(items, epoch=3)["pixel_values"], eval_view) and not torch.equal(a, eval_view)
    source = MapStyleSource(items, on, micro_batch_size=4, shuffle=False)
    first, second = list(source.batches(limit=2))
    assert torch.equal(first["pixel_values"], a) and torch.equal(second["pixel_values"], later)


# ------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return write_digit_folders(tmp_path_factory.mktemp("digits"), per_class=40)


@pytest.fixture
def one_thread():
    """A 2-layer, 64-wide ViT steps several times faster on one thread than on two cores other jobs share."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["ours", "transformers"])
def test_digits_fine_tuned_from_a_vit_release_score_the_same_in_transformers(releases, digits, source, tmp_path, one_thread):
    """`pretrain finetune` on scikit-learn's digits (PNG class folders) from a tiny ViT release: well above the
    majority class, and `pipeline("image-classification")` on the export reproduces metrics.json's accuracy."""
    from transformers import pipeline

    from core.config import load_config
    from pipelines.finetune import FinetuneConfig, run_finetune

    train, dev = digits
    cfg = load_config(CONFIG, [f"checkpoint={releases[source]}", f"data.train={train}", f"data.validation={dev}",
                               f"train.run_dir={tmp_path / 'run'}", "augment.hflip=false", "augment.min_crop_area=1.0",
                               "epochs=12", "optim.lr=2e-3", "schedule.warmup_steps=5", "logging.tensorboard=false"],
                      cls=FinetuneConfig)
    result = run_finetune(cfg)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())["metrics"]
    assert metrics == result["metrics"] and metrics["accuracy"] >= 0.3, result["history"]  # majority: 0.1
    best = next(h for h in result["history"] if h["step"] == result["best_step"])
    assert best["accuracy"] == pytest.approx(metrics["accuracy"])  # the run's evaluation is the export's
    release = Path(result["release_dir"])
    config = json.loads((release / "config.json").read_text())
    assert config["architectures"] == ["ViTForImageClassification"] and config["label2id"]["7"] == 7
    assert (release / "preprocessor_config.json").read_bytes() == (releases[source] / "preprocessor_config.json").read_bytes()
    card = (release / "README.md").read_text()
    assert "pipeline_tag: image-classification" in card and "ImageOps.exif_transpose" in card
    clf = pipeline("image-classification", model=str(release))
    paths = sorted(dev.rglob("*.png"))
    hits = [clf(str(p), top_k=1)[0]["label"] == p.parent.name for p in paths]
    assert np.mean(hits) == pytest.approx(metrics["accuracy"])
