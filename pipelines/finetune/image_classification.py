"""Image-classification fine-tuning of ViT releases on new labels (``train.task=image_classification``).

Flow, as the text tasks': resolve the checkpoint (a release dir, ours or a transformers ViT one, or one of our
run checkpoints exported on the fly) → read the class folders (``image_data``) → the release's trunk with a
fresh head of the new classes (initialized as transformers initializes a new one; a zero head, as Dosovitskiy
et al. fine-tune large models, learnt slower on tiny ones: 0.22 vs 0.38 dev accuracy after 8 epochs of
digits) or the same architecture from random init → `Trainer` with one evaluation and one checkpoint per epoch → the best epoch
exported as a ``ViTForImageClassification`` release → ``metrics.json`` computed by that export on the whole
dev set (each rank scoring its share on its device, ``scoring``).

Pixels: the release's own ``preprocessor_config.json`` (ours: ``core.families.vit.eval_processor_config``;
a transformers directory: its ``ViTImageProcessor``) turns every image into the model's input, loaded with
``AutoImageProcessor`` as a transformers user loads it, and is copied into the export unchanged: the run's
dev evaluation, ``metrics.json`` and ``pipeline("image-classification")`` on the export see the same tensors.
Training may first take a random crop of the decoded image and mirror it (``augment``), then the processor.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipelines.engine.distributed import DistEnv
from pipelines.engine.objectives import key_seed
from pipelines.finetune import FinetuneConfig
from pipelines.finetune.classification import ClassificationTask
from pipelines.finetune.config import AugmentConfig
from pipelines.finetune.data import FinetuneError
from pipelines.finetune.image_data import ImageCheck, ImageExample, load_image, read_image_folder
from pipelines.finetune.metrics import classification_metrics
from pipelines.finetune.runner import FinetuneJob, fit_export_score, resolve_release, start_ranks
from pipelines.finetune.scoring import forward_on_ranks, scoring_device

__all__ = ["FAMILIES", "ImageClassificationTask", "ImageBatcher", "ImageItems", "load_processor", "build_image_classifier",
           "finetune_image_classification", "evaluate_release"]

#: The model families a release must be of (``pipelines.finetune.task_families``).
FAMILIES = ("vit",)

PROCESSOR_FILE = "preprocessor_config.json"

#: What a loader worker needs to unpickle an ``ImageBatcher``, imported once by the workers' forkserver (the
#: processor's transformers base module costs ~4 s; each worker would import it again for every epoch).
WORKER_PRELOAD = ("pipelines.finetune.image_classification", "transformers.image_processing_utils")


class ImageClassificationTask(ClassificationTask):
    """Cross-entropy over the valid images of a batch; the confusion-matrix metrics of text classification."""

    name, family = "image_classification", "vit"
    unit, counted = "img", "images"
    input_names = ("pixel_values",)

    def __init__(self, num_labels: int, batcher: ImageBatcher):
        super().__init__(num_labels, pad_id=0, seq_len=0)
        self.batcher = batcher

    def collate(self, samples, *, epoch=0, train=True):
        return self.batcher(samples, epoch=epoch)

    def flops_kwargs(self):
        return {}  # ViT's FLOPs are per image (``core.families.vit.vit_training_flops``)

    def tokens(self, batch):
        return int(batch["valid"].sum())

    def batch_flops(self, batch, config):
        from models.flops import training_flops_per_sample

        return training_flops_per_sample(config) * float(batch["valid"].sum())  # fillers are not work


def _crop_box(w: int, h: int, min_area: float, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """A random box of ``min_area``..1 of the image at aspect 3/4..4/3 (Inception-style; the whole image if none fits)."""
    for _ in range(10):
        area = w * h * rng.uniform(min_area, 1.0)
        ratio = float(np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3))))
        cw, ch = int(round((area * ratio) ** 0.5)), int(round((area / ratio) ** 0.5))
        if 0 < cw <= w and 0 < ch <= h:
            x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
            return x, y, x + cw, y + ch
    return 0, 0, w, h


class ImageBatcher:
    """Items (``path``, ``label``, ``index``, ``train``, ``valid``) -> ``pixel_values`` by the release's processor.

    A training item is first augmented (``augment``) from ``rng(seed, epoch, index)``: the same on every rank
    and after a resume. ``takes_epoch``: ``MapStyleSource`` passes the training epoch.
    """

    takes_epoch = True

    def __init__(self, processor: Any, seed: int, augment: AugmentConfig):
        self.processor, self.seed, self.augment = processor, seed, augment

    def augmented(self, img: Any, rng: np.random.Generator) -> Any:
        from PIL import Image

        if self.augment.min_crop_area < 1.0:
            img = img.crop(_crop_box(*img.size, self.augment.min_crop_area, rng))
        if rng.random() < 0.5 and self.augment.hflip:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return img

    def __call__(self, items: list[dict[str, Any]], epoch: int = 0) -> dict[str, Any]:
        images = []
        for it in items:
            img = load_image(it["path"])
            if it["train"]:
                img = self.augmented(img, np.random.default_rng(key_seed(self.seed, epoch, it["index"])))
            images.append(img)
        return {"pixel_values": self.processor(images, return_tensors="pt")["pixel_values"],
                "labels": torch.tensor([it["label"] for it in items], dtype=torch.long),
                "valid": torch.tensor([bool(it["valid"]) for it in items])}


def load_processor(release: Path, image_size: int, num_channels: int) -> Any:
    """The release's image processor (``AutoImageProcessor``, as its users load it); refused when there is none or
    when it does not give the model its input size (transformers' ViT raises on another size)."""
    from PIL import Image
    from transformers import AutoImageProcessor

    if not (release / PROCESSOR_FILE).is_file():
        raise FinetuneError(
            f"{release}: no {PROCESSOR_FILE}, so nothing says how images are resized and normalized for this model. "
            f"Save the processor it was trained with into it (e.g. ViTImageProcessor(size={{'height': {image_size}, "
            f"'width': {image_size}}}).save_pretrained('{release}')).")
    try:
        processor = AutoImageProcessor.from_pretrained(str(release), trust_remote_code=False)
        shape = tuple(processor(Image.new("RGB", (61, 37)), return_tensors="pt")["pixel_values"].shape)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FinetuneError(f"{release}/{PROCESSOR_FILE} is not a usable image processor ({exc}). Save a "
                            f"ViTImageProcessor for the model into it.") from None
    if shape != (1, num_channels, image_size, image_size):
        raise FinetuneError(
            f"{release}/{PROCESSOR_FILE} makes images of shape {shape[1:]} but the model (config.json) reads "
            f"{num_channels}x{image_size}x{image_size}. Fix the processor's size/crop_size to {image_size}.")
    return processor


def build_image_classifier(release: Path, label_names: list[str], init: str, seed: int) -> torch.nn.Module:
    """The release's ViT trunk with a fresh head of ``label_names`` (``init=random``: a fresh trunk too)."""
    import models

    torch.manual_seed(seed)  # init=random weights are the same on every rank and rerun
    with warnings.catch_warnings():  # a new head is expected; anything else is reported below
        warnings.simplefilter("ignore", UserWarning)
        try:
            model, report = models.hf.from_hf(release, num_labels=len(label_names), id2label=dict(enumerate(label_names)))
        except ValueError as exc:
            raise FinetuneError(f"{release}: {exc} Image classification fine-tunes ViT-architecture checkpoints.") from None
    if getattr(model, "family", None) not in FAMILIES:
        raise FinetuneError(f"{release} holds a {getattr(model, 'family', '?')} model; image classification "
                            f"fine-tuning needs a ViT release.")
    # the pretraining head (its classes are not these) and a ViTModel's pooler are expected to go unused
    if [k for k in report.missing if not k.startswith("head.")] or \
            [k for k in report.unexpected if not k.startswith(("classifier.", "vit.pooler."))]:
        warnings.warn(str(report), stacklevel=2)
    if init == "random":
        model.init_weights()
    with torch.no_grad():  # a fresh head as transformers initializes one, also where one of this shape was loaded
        std = model.config.initializer_range
        torch.nn.init.trunc_normal_(model.head.weight, std=std, a=-2 * std, b=2 * std)
        model.head.bias.zero_()
    return model


class ImageItems(Sequence):
    """A split's items as ``ImageBatcher`` reads them (``path``, ``label``, ``index``, ``train``, ``valid``), kept
    in three numpy arrays: the paths' bytes end to end (their common start once), where each ends, the labels.
    A loader pickles its dataset into every worker it starts, at each epoch and evaluation: ImageNet's 1.28 M
    items as dicts were 101 MB that took 1.2 s to pickle per worker (and as long to load) while the GPUs
    waited; as these, 49 MB and 0.03 s (``benchmarks/image_folder_scale.py``). ``pad_to``: topped up with invalid
    copies of the first item to a whole multiple of it (every rank evaluates the same number of batches)."""

    def __init__(self, examples: list[ImageExample], train: bool, pad_to: int = 1):
        paths = [os.fsencode(e.path) for e in examples]
        self._prefix = os.path.commonprefix(paths) if paths else b""  # the folder, stored once
        cut = len(self._prefix)
        self._bytes = np.frombuffer(b"".join(p[cut:] for p in paths), dtype=np.uint8)
        self._ends = np.cumsum([len(p) - cut for p in paths], dtype=np.int64)
        self._labels = np.array([e.label for e in examples], dtype=np.int32)
        self.train, self.count = train, len(examples)
        self.padded = self.count + (-self.count % pad_to)

    def __len__(self) -> int:
        return self.padded

    def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        if not -self.padded <= i < self.padded:
            raise IndexError(f"item {i} of {self.padded}")
        i = i % self.padded
        valid, k = i < self.count, i if i < self.count else 0
        start = int(self._ends[k - 1]) if k else 0
        path = os.fsdecode(self._prefix + self._bytes[start: int(self._ends[k])].tobytes())
        return {"path": path, "label": int(self._labels[k]), "index": k, "train": self.train, "valid": valid}


def finetune_image_classification(cfg: FinetuneConfig) -> dict[str, Any]:
    """Read the class folders, build the classifier and its batcher, then the shared fit/export/score skeleton."""
    env = start_ranks(cfg)  # the ranks share the image check
    run_dir = Path(cfg.train.run_dir)
    release = resolve_release(cfg.checkpoint, run_dir, env, FAMILIES, "image_classification")
    d = cfg.data
    with ImageCheck(cfg.loader_workers, env, preload=WORKER_PRELOAD) as check:  # its pool starts the forkserver
        train_ex, labels, train_report = read_image_folder(d.train, what="data.train", max_bad_share=d.max_bad_share,
                                                           check=check)
        val_ex, _, val_report = read_image_folder(d.validation, what="data.validation", label_names=labels,
                                                  max_bad_share=d.max_bad_share, check=check)
    if env.rank == 0:
        print(train_report.summary().replace("examples", "images"), val_report.summary().replace("examples", "images"),
              sep="\n", flush=True)
    model = build_image_classifier(release, labels, cfg.init, cfg.train.seed)
    processor = load_processor(release, model.config.image_size, model.config.num_channels)
    task = ImageClassificationTask(len(labels), ImageBatcher(processor, cfg.train.seed, cfg.augment))
    val_items = ImageItems(val_ex, train=False, pad_to=env.world_size * d.micro_batch_size)
    return fit_export_score(cfg, env, release, FinetuneJob(
        model=model, task=task, model_name="vit-classifier",
        train_feats=ImageItems(train_ex, train=True), val_feats=val_items, collate=task.batcher,
        model_build={"name": "vit-classifier", "checkpoint": str(release), "labels": labels},
        data_info={"train": str(d.train), "validation": str(d.validation), "labels": labels},
        export=lambda step: _export_best(model, run_dir / "checkpoints", step, release, run_dir / "release", labels),
        score=lambda out: evaluate_release(out, val_ex, labels, env),
        card_name="image-classifier", pipeline_tag="image-classification", worker_preload=WORKER_PRELOAD,
    ))


def _export_best(model, checkpoints: Path, step: int, base: Path, out: Path, labels: list[str]) -> Path:
    """The best epoch as a ``ViTForImageClassification`` release with the base's processor file, byte for byte."""
    import models
    from core.families.vit import usage_snippet
    from pipelines.engine.checkpoint import step_dir_name
    from pipelines.engine.export import consolidated_state_dict, write_release

    model.load_state_dict(consolidated_state_dict(checkpoints / step_dir_name(step)))
    hf = models.hf.to_hf(model.float().eval())
    hf.config.id2label = dict(enumerate(labels))
    hf.config.label2id = {name: i for i, name in enumerate(labels)}
    card = (f"# Fine-tuned image classifier\n\nFrom `{base}`, best epoch at step {step}. Labels: {', '.join(labels)}.\n\n"
            f"{usage_snippet(str(out))}\nThe processor (`{PROCESSOR_FILE}`, the base release's) made the inputs of the "
            f"run's evaluation. The run read each image upright (EXIF orientation applied) and opaque (transparency "
            f"composited onto white), as the two lines above do; `pipeline(\"image-classification\", model=\"{out}\")` "
            f"scores the same except on images with transparency (its loader drops the alpha channel).\n")
    return write_release(hf, out, card=card,
                         extra_files={PROCESSOR_FILE: (base / PROCESSOR_FILE).read_text(encoding="utf-8")})


@torch.no_grad()
def evaluate_release(release: Path, examples: list[ImageExample], labels: list[str],
                     env: DistEnv | None = None) -> dict[str, float]:
    """Dev metrics of the exported model and processor, loaded back with transformers (the release is what was
    measured). Under ``env`` every rank calls it and runs its share of the batches on its device."""
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    processor = AutoImageProcessor.from_pretrained(str(release), trust_remote_code=False)
    device = scoring_device(env)
    hf = AutoModelForImageClassification.from_pretrained(str(release), trust_remote_code=False).eval().to(device)

    def logits(chunk: list[ImageExample]) -> np.ndarray:
        inputs = processor([load_image(e.path) for e in chunk], return_tensors="pt")
        return hf(**inputs.to(device)).logits.float().cpu().numpy()

    out = forward_on_ranks([examples[i: i + 64] for i in range(0, len(examples), 64)], logits, env)
    return classification_metrics(np.concatenate(out).argmax(-1).tolist(), [e.label for e in examples], len(labels))
