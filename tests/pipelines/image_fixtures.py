"""Small real inputs for image fine-tuning tests: scikit-learn's bundled digits as PNG class folders, a tiny ViT
release of ours (a run checkpoint exported as `pretrain export` does) and a transformers ViT directory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

TINY_VIT = {"num_layers": 2, "hidden_size": 64, "num_heads": 2, "intermediate_size": 128, "patch_size": 8,
            "image_size": 32}


def write_digit_folders(out: Path, per_class: int = 30, dev_share: float = 0.3, size: int = 32) -> tuple[Path, Path]:
    """``out/train/<digit>/*.png`` and ``out/validation/<digit>/*.png``: the first ``per_class`` digits of each
    class (8x8, 17 grey levels) upscaled to ``size`` px (bilinear), a ``dev_share`` of each class to dev."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for label in range(10):
        idx = np.flatnonzero(digits.target == label)[:per_class]
        n_dev = int(round(len(idx) * dev_share))
        for j, i in enumerate(idx):
            split = "validation" if j < n_dev else "train"
            pixels = (digits.images[i] * (255 / 16)).round().astype(np.uint8)
            path = out / split / str(label) / f"{i:04d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels, mode="L").resize((size, size), Image.BILINEAR).save(path)
    return out / "train", out / "validation"


def save_our_vit_checkpoint(root: Path, num_labels: int = 4, seed: int = 0, **overrides) -> Path:
    """A DDP-engine checkpoint of a tiny ViT (random init) trained on an image_cls corpus of ``num_labels`` classes."""
    import models

    build = {**TINY_VIT, "num_labels": num_labels, **overrides}
    torch.manual_seed(seed)
    model = models.create("vit-tiny", **build).eval()
    ckpt = root / "step-00000001"
    (ckpt / "engine").mkdir(parents=True)
    torch.save(model.state_dict(), ckpt / "engine" / "model.pt")
    state = {"step": 1, "task": "image_cls", "engine": "ddp", "zero_stage": 0,
             "model_build": {"name": "vit-tiny", "overrides": build},
             "data_info": {"class_map": {f"class{c}": c for c in range(num_labels)}}}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    return ckpt


def save_hf_vit(out: Path, *, bare: bool = False, seed: int = 1, image_size: int = 32) -> Path:
    """A tiny transformers ViT saved with ``save_pretrained`` (``ViTModel`` when ``bare``) + its ``ViTImageProcessor``."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                                 image_size=image_size, patch_size=8, num_labels=3)
    model = transformers.ViTModel(cfg) if bare else transformers.ViTForImageClassification(cfg)
    model.save_pretrained(str(out), safe_serialization=True)
    transformers.ViTImageProcessor(size={"height": image_size, "width": image_size}).save_pretrained(str(out))
    return out
