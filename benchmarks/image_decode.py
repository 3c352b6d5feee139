"""What one training image costs the loader's CPUs: encoded (PNG / JPEG, decoded + cropped + normalised per
sample with PIL) against raw uint8 pixels at the model's size (``images.format: raw``: read and stacked only;
crop, flip, cast and normalisation run on the device). Issue #30, ViT-B/16 at 224 px.

    python benchmarks/image_decode.py [--images 96] [--size 224] [--batch 32] [--repeats 3]

Each form is prepared from the same photo-like 256 px images (``gpu_check.write_images``) with the prep
code (``data_prep.images.process_image``: JPEG and PNG at ``resize_shorter=256`` as an ImageNet-style corpus
stores them, raw at ``size``); then per batch of ``--batch`` the loader's work is timed in this process
(one core): ``Images.decode_parts`` for every sample + ``ImageClsTask.collate`` (train mode: random-resized
crop + flip). The best of ``--repeats`` passes is kept. Prints CPU-s per image, bytes per image, the ratio
against raw, and the images/s and CPU cores ViT-B/16 needs per GPU at 35 % MFU of an H100 SXM (989.5 TFLOP/s
bf16; FLOPs per image from ``core.families.vit.vit_training_flops``). The device side of the raw path
(``ImageClsTask.pixel_values``) is timed here on the CPU too, for reference only.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import write_images  # noqa: E402

from core.corpus_kinds import corpus_kind  # noqa: E402
from core.families.vit import SPEC, vit_training_flops  # noqa: E402
from data_prep.config import ImageConfig  # noqa: E402
from data_prep.images import process_image  # noqa: E402
from pipelines.engine.objectives import ImageClsTask  # noqa: E402

H100_BF16 = 989.5e12
TARGET_MFU = 0.35
FORMS = {"png": dict(format="png", resize_shorter=256), "jpeg": dict(format="jpeg", resize_shorter=256),
         "raw": dict(format="raw")}


def encode_all(files: list[Path], form: str, size: int) -> list[dict[str, bytes]]:
    cfg = ImageConfig(**FORMS[form], **({"size": size} if form == "raw" else {}))
    out = []
    for i, f in enumerate(files):
        data, ext, _, _ = process_image(f.read_bytes(), cfg)
        out.append({ext: data, "cls": str(i % 10).encode()})
    return out


def time_loader(records: list[dict[str, bytes]], task: ImageClsTask, batch: int, repeats: int) -> float:
    """Best CPU-s per image of decode + collate over ``records`` (a loader worker's work)."""
    kind = corpus_kind("images")
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        for lo in range(0, len(records), batch):
            samples = [kind.decode_parts(f"k{lo + j}", r, "uint16") for j, r in enumerate(records[lo: lo + batch])]
            task.collate(samples, epoch=0, train=True)
        best = min(best, (time.process_time() - t0) / len(records))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=96)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    manifest = SimpleNamespace(class_map={str(c): c for c in range(10)})
    task = ImageClsTask(manifest, seed=0, image_size=args.size)
    with tempfile.TemporaryDirectory() as tmp:
        write_images(Path(tmp), args.images, 256)
        files = sorted(Path(tmp).rglob("*.png"))
        forms = {form: encode_all(files, form, args.size) for form in FORMS}
    flops = vit_training_flops(SPEC.config("vit-base", image_size=args.size))
    need = TARGET_MFU * H100_BF16 / flops
    cost = {form: time_loader(records, task, args.batch, args.repeats) for form, records in forms.items()}
    print(f"ViT-B/16 at {args.size} px: {flops / 1e9:.1f} GFLOP per training image; 35 % MFU on an H100 SXM "
          f"(989.5 TFLOP/s bf16) = {need:,.0f} images/s per GPU")
    print("| stored as | bytes/image | loader CPU-ms/image | vs raw | CPU cores per GPU at 35 % MFU |")
    print("|---|---|---|---|---|")
    for form, records in forms.items():
        size = np.mean([sum(len(v) for v in r.values()) for r in records])
        print(f"| {form} | {size / 1e3:,.1f} kB | {cost[form] * 1e3:.3f} | {cost[form] / cost['raw']:.1f}x "
              f"| {need * cost[form]:.2f} |")
    raw = [corpus_kind("images").decode_parts(f"k{i}", r, "uint16") for i, r in enumerate(forms["raw"][: args.batch])]
    batch = task.collate(raw, epoch=0, train=True)
    task.pixel_values(batch)
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        task.pixel_values(batch)
    per = (time.perf_counter() - t0) / args.repeats / len(raw)
    print(f"raw path's device work (crop/resize/flip/normalise, grid_sample) on this CPU, for reference: "
          f"{per * 1e3:.3f} ms/image; read bandwidth at {need:,.0f} images/s: "
          f"{need * np.mean([len(r['pixels.npy']) for r in forms['raw']]) / 1e6:,.0f} MB/s per GPU (raw) vs "
          f"{need * np.mean([len(r['jpg']) for r in forms['jpeg']]) / 1e6:,.0f} MB/s (jpeg)")


if __name__ == "__main__":
    main()
